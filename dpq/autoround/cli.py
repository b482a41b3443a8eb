"""``auto-round-dp``: the auto-round CLI, every argument unchanged, plus

  --parallel_quantization {off,auto,N}   tune each block data-parallel (default off)
  --parallel_devices LIST                lane devices, e.g. 0,1,2,3 or cpu,cpu

Our two flags are taken out of argv, ``enable()`` is called, and auto-round's own ``run()``
gets the rest. At the end a per-block summary is printed (world, seconds, exchange bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

OUR_HELP = """
dpq (data-parallel tuning) options:
  --parallel_quantization {off,auto,N}
                        tune each block on N lanes (auto: every device that fits; off: plain auto-round).
                        Default: off
  --parallel_devices LIST
                        lane devices, e.g. 0,1,2,3 or cuda:0,cuda:1 or cpu,cpu. Default: the devices of
                        --device_map when it lists several, else every visible device of that type
  --parallel_debug      check after every step that all lanes hold bitwise-identical tuned values
  --parallel_report PATH
                        write the per-block records (world, seconds, exchange bytes, per-iteration
                        losses) as JSON
"""


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--parallel_quantization", default="off")
    p.add_argument("--parallel_devices", default=None)
    p.add_argument("--parallel_debug", action="store_true")
    p.add_argument("--parallel_report", default=None)
    return p.parse_known_args(argv)


def format_summary(records) -> str:
    if not records:
        return ""
    lines = ["dpq summary:", f"{'block':<28} {'world':>5} {'seconds':>8} {'exchange MB':>12}  note"]
    for r in records:
        note = "fell back to serial" if r.fell_back else (r.communicator or (r.reasons[0] if r.reasons else ""))
        lines.append(f"{r.name:<28} {r.world:>5} {r.seconds:>8.2f} {r.wire_bytes / 1e6:>12.2f}  {note}")
    total = sum(r.seconds for r in records)
    lines.append(f"{'total':<28} {'':>5} {total:>8.2f} {sum(r.wire_bytes for r in records) / 1e6:>12.2f}")
    return "\n".join(lines)


def write_report(path: str, world, devices, records, phases: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"world": world, "devices": devices, "phase_seconds": phases, "blocks": [asdict(r) for r in records]}
    out.write_text(json.dumps(body, indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = split_argv(argv)
    from dpq.autoround import integration, shard_seams
    from dpq.plan import validate_world

    try:
        world = validate_world(ours.parallel_quantization)
    except ValueError as e:
        print(f"auto-round-dp: error: --parallel_quantization: {e}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):
        print(OUR_HELP)
    from auto_round.__main__ import run

    if world != "off":
        integration.enable(world, ours.parallel_devices, debug_identical=ours.parallel_debug)
    sys.argv = ["auto-round-dp", *rest]
    try:
        run()
    finally:
        integration.disable()
        records = integration.run_summary()
        phases = shard_seams.phase_seconds()
        if world != "off" and records:
            print(format_summary(records), flush=True)
        if world != "off" and any(phases.values()):
            print("dpq phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
        if ours.parallel_report:
            write_report(ours.parallel_report, world, ours.parallel_devices, records, phases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
