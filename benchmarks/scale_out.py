"""Processes x lanes on one CPU host: the same CLI job as serial, 1 process x 2 lanes, 2 processes x 1 lane.

    .venv/bin/python -m benchmarks.scale_out                # embedded model, 3 layouts, one run each
    .venv/bin/python -m benchmarks.scale_out --iters 20 --rounds 2

The default run keeps a time budget (``--budget-s``, 270 s: within 5 minutes on a 2-core CPU): a
2-iteration serial probe sizes ``--iters`` (at most 50) when it is not given, and says so.

Runs ``auto-round-dp`` (``python -m dpq.autoround.cli``) on the model that ships in ``dpq/data``
with the same arguments in each layout, one after another in one invocation (these machines
are noisy: compare ratios from one run, never across runs):

* ``serial``: ``--parallel_quantization 1`` (auto-round's own serial block tune), 2 intra-op threads;
* ``1x2``: one process, ``--parallel_quantization 2 --parallel_devices cpu,cpu``, 2 intra-op
  threads (the lanes take turns on the one issuing thread, each using both cores);
* ``2x1``: ``torchrun --standalone --nproc-per-node 2`` with ``--parallel_quantization 1
  --parallel_devices cpu``, one intra-op thread per process (what torchrun sets): the first
  layout here where two lanes can run at the same time, on separate cores.

Per layout: the whole command's wall time, and from ``--parallel_report`` (rank 0's) each
block's tune seconds; per iteration = block seconds / iters. Printed as a table with ratios
to serial; written as JSON (``--out``/scale_out.json) and a bar chart (scale_out.png).
The last line is ``scale_out serial=1.00 1x2=<r> 2x1=<r>`` (per-iteration ratio, median over blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name -> (launcher processes, --parallel_quantization, --parallel_devices, intra-op threads)
    "serial": (1, "1", None, 2),
    "1x2": (1, "2", "cpu,cpu", 2),
    "2x1": (2, "1", "cpu", 1),
}


def command(layout: str, args: argparse.Namespace, calib: Path, out: Path) -> tuple[list[str], dict]:
    from dpq.demo.embedded import DATA_DIR

    procs, world, devices, threads = LAYOUTS[layout]
    launcher = [sys.executable, "-m", "dpq.autoround.cli"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
                    "-m", "dpq.autoround.cli"]
    cmd = [*launcher, "--model", str(DATA_DIR), "--dataset", str(calib), "--iters", str(args.iters),
                      "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--batch_size",
                      str(args.batch_size), "--device_map", "cpu", "--disable_torch_compile", "--seed", "42",
                      "--output_dir", str(out), "--parallel_quantization", world,
                      "--parallel_report", str(out / "dpq_report.json")]
    if devices:
        cmd += ["--parallel_devices", devices]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return cmd, env


def run_layout(layout: str, args: argparse.Namespace, calib: Path, out: Path) -> dict:
    cmd, env = command(layout, args, calib, out)
    print(f"$ OMP_NUM_THREADS={env['OMP_NUM_THREADS']} " + " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{layout}: auto-round-dp failed (exit {proc.returncode})")
    report = json.loads((out / "dpq_report.json").read_text())
    blocks = report["blocks"]
    return {"layout": layout, "wall_s": wall, "block_s": [b["seconds"] for b in blocks],
            "worlds": [b["world"] for b in blocks], "iters": args.iters}


PROBE_ITERS = 2


def size_iters(args: argparse.Namespace, layouts: list[str], calib: Path, out: Path, t0: float) -> str:
    """Choose ``--iters`` (when not given) so that the run ends within ``--budget-s`` of ``t0``: a
    probe run of the serial layout at PROBE_ITERS iterations gives the command's fixed seconds and
    the blocks' seconds per iteration, every layout's run is priced like serial's plus 10% (the
    per-iteration ratio the goal is stated at does not depend on the count, only its noise does),
    at most 50 iterations, at least 5. Returns what was chosen, in words."""
    if args.iters is not None or args.budget_s <= 0:
        args.iters = args.iters or 50
        return f"{args.iters} iters (given)" if args.budget_s > 0 else f"{args.iters} iters (no time budget)"
    probe_args = argparse.Namespace(**{**vars(args), "iters": PROBE_ITERS})
    probe = run_layout("serial", probe_args, calib, out / "probe")
    per_iter = sum(probe["block_s"]) / PROBE_ITERS
    fixed = max(0.0, probe["wall_s"] - sum(probe["block_s"]))
    runs = args.rounds * len(layouts)
    left = args.budget_s - (time.perf_counter() - t0)
    args.iters = max(5, min(50, int((left / (1.1 * runs) - fixed) / per_iter)))
    planned = 1.1 * runs * (fixed + per_iter * args.iters)
    return (f"sized to a {args.budget_s:.0f} s budget: a {PROBE_ITERS}-iteration serial probe took "
            f"{probe['wall_s']:.1f} s ({fixed:.1f} s fixed, {per_iter:.2f} s per iteration over the blocks); "
            f"chose {args.iters} iters, ~{planned:.0f} s planned for {runs} runs"
            + (" (over budget)" if planned > left else ""))


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per layout: median over rounds of wall and of each block's seconds; ratios to serial."""
    out = {}
    for layout, rounds in runs.items():
        blocks = [statistics.median(r["block_s"][i] for r in rounds) for i in range(len(rounds[0]["block_s"]))]
        out[layout] = {"wall_s": statistics.median(r["wall_s"] for r in rounds), "block_s": blocks,
                       "per_iter_ms": [1e3 * s / rounds[0]["iters"] for s in blocks],
                       "worlds": rounds[0]["worlds"]}
    base = out["serial"]
    for row in out.values():
        row["wall_ratio"] = row["wall_s"] / base["wall_s"]
        row["per_iter_ratio"] = statistics.median(b / s for b, s in zip(row["block_s"], base["block_s"], strict=True))
    return out


def plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [summary[n]["per_iter_ratio"] for n in names], color=["tab:gray", "tab:blue", "tab:orange"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("block time per iteration / serial")
    ax.set_title("embedded model, 2-core CPU (lower is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=None, help="default 50, fewer to fit --budget-s")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="time budget of the run from its start (default 270: within 5 minutes on a 2-core CPU); "
                         "a short serial probe run sizes --iters when it is not given; 0: no budget (50 iters)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the three layouts, interleaved")
    ap.add_argument("--layouts", default="serial,1x2,2x1")
    ap.add_argument("--out", default="out/scale_out")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    layouts = args.layouts.split(",")
    if "serial" not in layouts or any(name not in LAYOUTS for name in layouts):
        ap.error(f"--layouts: a comma list from {', '.join(LAYOUTS)} that includes serial")

    from dpq.demo.embedded import calibration_jsonl

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calib = calibration_jsonl(out / "calib.jsonl", args.nsamples * 2, args.seqlen)
    load_before = load_average()
    print(size_iters(args, layouts, calib, out, t0), flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name in layouts:
            runs[name].append(run_layout(name, args, calib, out / f"{name}_r{r}"))
    summary = summarize(runs)
    print(f"\nload average before {load_before}, after {load_average()}; {args.iters} iters, "
          f"{args.nsamples} samples x {args.seqlen} tokens, batch {args.batch_size}, rounds {args.rounds}")
    print(f"{'layout':<8} {'world':>5} {'wall s':>8} {'x serial':>9} {'ms/iter per block':>30} {'x serial':>9}")
    for name, row in summary.items():
        per_iter = " ".join(f"{v:.1f}" for v in row["per_iter_ms"])
        print(f"{name:<8} {max(row['worlds']):>5} {row['wall_s']:>8.1f} {row['wall_ratio']:>9.2f} "
              f"{per_iter:>30} {row['per_iter_ratio']:>9.2f}")
    (out / "scale_out.json").write_text(json.dumps({"args": vars(args), "load_before": load_before,
                                                    "runs": runs, "summary": summary}, indent=1))
    plot(summary, out / "scale_out.png")
    print(f"wrote {out / 'scale_out.json'} and {out / 'scale_out.png'}")
    print("scale_out " + " ".join(f"{n}={summary[n]['per_iter_ratio']:.2f}" for n in summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
