"""``python -m benchmarks.gpu_report OUT_DIR [OUT_DIR ...] [--write]``: a GPU check's outputs
(``summary.json``, ``calibration.json`` in each OUT_DIR, as ``bash benchmarks/gpu_check.sh`` leaves
them) as the rows of docs/PERFORMANCE.md's "Measured on a GPU": the card, driver, date and every
figure with the command that measured it, and each proof's verdict. Several OUT_DIRs are the runs of
one lease in the order they ran (``--core``, then ``--rest`` or ``--only=...``): each figure is the
last run's that measured it, and every run's verdicts get a column of their own, so a proof that
failed in one run and passed in the next shows both. Printed; with ``--write`` also put into
docs/PERFORMANCE.md (a run's rows replace those of the same card and date) and the calibration
stored as ``benchmarks/calibration/<card>-<date>.json`` (the card's spaces as ``_``), where the
timeline model finds it by name.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from dpqlab.timeline.calibration import Calibration, issuing_bound

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "PERFORMANCE.md"
CALIBRATIONS = ROOT / "benchmarks" / "calibration"
SECTION = "## Measured on a GPU"
NONE_YET = "No GPU has run the check yet.\n\n"  # the section's line until a first run
COMMAND = "bash benchmarks/gpu_check.sh"


def _fmt(x, unit: str = "") -> str:
    return "—" if x is None else f"{x:g}{unit}"


def _part(summary: dict) -> str:
    part = summary.get("part") or ("core" if summary.get("core_only") else "all")
    return {"all": "", "core": " --core", "rest": " --rest"}.get(part, f" --only={part}")


def merged(cals: list[dict]) -> dict:
    """One calibration from the runs' (in run order): each key the last run's that measured it
    (null and empty values measure nothing), the paths per path and batch."""
    out: dict = {}
    for cal in cals:
        for key, value in cal.items():
            if key == "paths":
                for path, batches in (value or {}).items():
                    out.setdefault("paths", {}).setdefault(path, {}).update(batches)
            elif key == "compile_s":
                have = out.setdefault("compile_s", {})
                have.update({k: v for k, v in (value or {}).items() if v is not None or k not in have})
            elif value not in (None, {}, "unknown", "") or key not in out:
                out[key] = value
    return out


def rows(summaries: list[dict], cal: Calibration) -> list[str]:
    """The markdown of one lease's runs: a line naming them, a table of the figures, a table of the
    proofs with a column per run."""
    lanes: dict = {}
    for summary in summaries:
        lanes = ((summary.get("steps") or {}).get("lanes") or {}).get("result") or lanes
    commands = "; ".join(f"`{COMMAND}{_part(s)}` ({s.get('date_utc', cal.date)}, "
                         f"{'passed' if s.get('passed') else 'not all passed'})" for s in summaries)
    out = [f"<!-- gpu_report: {cal.label} -->",
           f"**{cal.card}**, driver {cal.extra.get('driver')}, torch {cal.extra.get('torch')}, auto-round "
           f"{cal.extra.get('auto_round')}: {commands} (calibration `benchmarks/calibration/{cal.label}.json`)", "",
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
    out += issuing_rows(cal)
    out.append(f"| bf16 8192³ matmul, TFLOP/s; device copy, GB/s | {_fmt(cal.extra.get('gemm_8192_tflops'))}; "
               f"{_fmt(cal.extra.get('copy_GBps'))} | paths |")
    names = list(dict.fromkeys(n for s in summaries for n in s.get("proofs", {})))
    out += ["", "| proof | " + " | ".join(f"run {i + 1}" for i in range(len(summaries))) + " |",
            "|---|" + "---|" * len(summaries)]
    for name in names:
        cells = [(s.get("proofs", {}).get(name) or "—").splitlines()[0][:300].replace("|", "/") for s in summaries]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def issuing_rows(cal: Calibration) -> list[str]:
    """Per world of lanes on one GPU: the issuing thread's CPU ms per unprofiled iteration, the wall
    and the GPU's busy ms (``dpq_issuing``); and whence the timeline model's host figure comes."""
    got = cal.extra.get("dpq_issuing") or {}
    thread = got.get("thread_cpu_ms_per_iteration") or {}
    walls, busy = got.get("wall_ms_per_iteration") or {}, got.get("gpu_busy_ms_per_iteration") or {}
    out = [f"| world {w} on one GPU: issuing thread's CPU ms / iteration (time.thread_time, unprofiled); wall; GPU "
           f"busy | {_fmt(ms)}; {_fmt(walls.get(w))}; {_fmt(busy.get(w))} | lanes |"
           for w, ms in sorted(thread.items(), key=lambda kv: int(kv[0]))]
    if got:
        ms, whence = issuing_bound(got)
        out.append(f"| the timeline model's host: issuing thread ms per lane-iteration ({cal.host_source}: "
                   f"{whence.replace('|', '/')}) | {_fmt(None if ms is None else round(ms, 3))} | lanes |")
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
    p.add_argument("out_dirs", type=Path, nargs="+",
                   help="a GPU check's $OUT (summary.json, calibration.json); several: one lease's runs, in order")
    p.add_argument("--write", action="store_true", help="put the rows into the docs and store the calibration")
    p.add_argument("--docs", type=Path, default=DOCS)
    p.add_argument("--calibration-dir", type=Path, default=CALIBRATIONS)
    args = p.parse_args(argv)
    summaries = [json.loads((d / "summary.json").read_text()) for d in args.out_dirs]
    if any(s.get("dry_run") for s in summaries):
        print("a dry run measured no GPU: nothing to report", file=sys.stderr)
        return 1
    data = merged([json.loads((d / "calibration.json").read_text()) for d in args.out_dirs])
    cal = Calibration.from_dict(data, source=", ".join(str(d) for d in args.out_dirs))
    block = rows(summaries, cal)
    print("\n".join(block))
    if args.write:
        args.docs.write_text(insert(args.docs.read_text(), block, cal.label))
        args.calibration_dir.mkdir(parents=True, exist_ok=True)
        stored = args.calibration_dir / f"{cal.label}.json"
        stored.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.docs} and {stored}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
