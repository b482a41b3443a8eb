"""``python -m benchmarks.gpu_report OUT_DIR [--write]``: a GPU check's outputs (``summary.json``,
``calibration.json`` in OUT_DIR, as ``bash benchmarks/gpu_check.sh`` leaves them) as the rows of
docs/PERFORMANCE.md's "Measured on a GPU": the card, driver, date and every figure with the command
that measured it, and each proof's verdict. Printed; with ``--write`` also put into
docs/PERFORMANCE.md (a run's rows replace those of the same card and date) and the calibration
stored as ``benchmarks/calibration/<card>-<date>.json`` (the card's spaces as ``_``), where the
timeline model finds it by name.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from dpq.testing.timeline.calibration import Calibration

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "PERFORMANCE.md"
CALIBRATIONS = ROOT / "benchmarks" / "calibration"
SECTION = "## Measured on a GPU"
NONE_YET = "No GPU has run the check yet.\n\n"  # the section's line until a first run
COMMAND = "bash benchmarks/gpu_check.sh"


def _fmt(x, unit: str = "") -> str:
    return "—" if x is None else f"{x:g}{unit}"


def rows(summary: dict, cal: Calibration) -> list[str]:
    """The markdown of one run: a line naming it, a table of its figures, a table of its proofs."""
    steps = summary.get("steps", {})
    lanes = (steps.get("lanes") or {}).get("result") or {}
    core = " --core" if summary.get("core_only") else ""
    out = [f"<!-- gpu_report: {cal.label} -->",
           f"**{cal.card}**, driver {cal.extra.get('driver')}, torch {cal.extra.get('torch')}, auto-round "
           f"{cal.extra.get('auto_round')}, {summary.get('date_utc', cal.date)}: `{COMMAND}{core}` "
           f"(calibration `benchmarks/calibration/{cal.label}.json`)", "",
           "| figure | value | step (`" + COMMAND + "`) |", "|---|---:|---|"]
    for path in ("compile", "eager"):
        for batch in sorted(cal.paths.get(path, {}), reverse=True):
            m = cal.measurement(path, batch)
            phases = ", ".join(f"{k} {v:g}" for k, v in m.phases_ms.items())
            out.append(f"| {path}, batch {batch}: ms / iteration (GPU ms by phase: {phases}) | "
                       f"{_fmt(m.iteration_ms)} | paths |")
            out.append(f"| {path}, batch {batch}: issuing thread's host ms / iteration; kernel launches / iteration | "
                       f"{_fmt(m.host_ms_per_iteration)}; {_fmt(m.launches_per_iteration)} | paths |")
    out.append(f"| compile seconds of the block (no-grad and tuning compiles) | {_fmt(cal.compile_s.get('block'))} "
               f"| paths |")
    out.append(f"| dpq world 1 / auto-round serial, ms per iteration, compile on (goal <= 1.02) | "
               f"{_fmt(cal.extra.get('dpq_world1_vs_serial'))} | lanes |")
    for w, entry in sorted((lanes.get("worlds") or {}).items()):
        timed = (entry.get("timed") or {}).get("median_ms")
        out.append(f"| world {w} on one GPU vs 1 lane at batch 8: ms / iteration; per-lane work that does not "
                   f"divide, ms | {_fmt(timed)} vs {_fmt(entry.get('one_lane_ms'))}; "
                   f"{_fmt(entry.get('per_lane_undivided_ms'))} | lanes |")
    out.append(f"| bf16 8192³ matmul, TFLOP/s; device copy, GB/s | {_fmt(cal.extra.get('gemm_8192_tflops'))}; "
               f"{_fmt(cal.extra.get('copy_GBps'))} | paths |")
    out += ["", "| proof | verdict |", "|---|---|"]
    out += [f"| {name} | {verdict.splitlines()[0][:300].replace('|', '/')} |"
            for name, verdict in summary.get("proofs", {}).items()]
    return out


def insert(docs: str, block: list[str], label: str) -> str:
    """``docs`` with ``block`` as the first run of its "Measured on a GPU" section (added at the end
    if missing); an earlier block of the same label is replaced."""
    text = "\n".join(block) + "\n"
    docs = docs.replace(NONE_YET, "", 1)
    marker = f"<!-- gpu_report: {label} -->"
    if marker in docs:  # a run's block ends at the next run's marker or the next heading
        pattern = re.compile(re.escape(marker) + r".*?(?=\n<!-- gpu_report: |\n## |\Z)", re.S)
        return pattern.sub(lambda _: text, docs, count=1)
    if SECTION not in docs:
        return f"{docs.rstrip()}\n\n{SECTION}\n\n{text}"
    at = docs.index(SECTION)
    first = docs.find("\n<!-- gpu_report: ", at)
    nxt = docs.find("\n## ", at + len(SECTION))
    cut = first + 1 if first >= 0 and (nxt < 0 or first < nxt) else (nxt + 1 if nxt >= 0 else len(docs))
    return docs[:cut] + text + "\n" + docs[cut:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="a GPU check's $OUT (summary.json, calibration.json)")
    p.add_argument("--write", action="store_true", help="put the rows into the docs and store the calibration")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--calibration-dir", type=Path, default=CALIBRATIONS)
    args = p.parse_args(argv)
    summary = json.loads((args.out_dir / "summary.json").read_text())
    cal = Calibration.load(args.out_dir / "calibration.json")
    if summary.get("dry_run"):
        print("a dry run measured no GPU: nothing to report", file=sys.stderr)
        return 1
    block = rows(summary, cal)
    print("\n".join(block))
    if args.write:
        args.docs.write_text(insert(args.docs.read_text(), block, cal.label))
        args.calibration_dir.mkdir(parents=True, exist_ok=True)
        stored = args.calibration_dir / f"{cal.label}.json"
        shutil.copyfile(args.out_dir / "calibration.json", stored)
        print(f"wrote {args.docs} and {stored}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
