"""One iteration of the real tune, replayed with CUDA's semantics on logical GPUs: host syncs, lane overlap.

    .venv/bin/python -m benchmarks.timeline --world 4
    .venv/bin/python -m benchmarks.timeline --world 8 --preset 8b-h100
    .venv/bin/python -m benchmarks.timeline --world 4 --legacy      # the data path before it was lane-local

What it does (``dpq/testing/timeline/`` says exactly which CUDA semantics are modelled):

1. records the embedded model's first block as auto-round tunes it (``dpq/testing/timeline/scenarios.py``);
2. measures the issuing thread's host cost per op on this machine: dpq's issue time per
   lane-iteration (``TuneEngine.issue_s``) on a launch-bound block (hidden 128, 8 x 8 tokens, one
   intra-op thread), divided by the ops the issuing thread queues per lane-iteration there;
3. runs that block's tune through the auto-round adapter (``dpq.autoround.enable``: auto-round's
   ``block_forward`` and ``_get_loss``) on ``--world`` logical GPUs, recording every op;
4. replays the record with each kernel's FLOPs and bytes scaled to the preset's block class and
   timed on its GPU class (stated figures, ``dpq/testing/timeline/``'s ``BLOCKS``/``GPUS``), and
   prints, per iteration, every host sync with the code that caused it, the lanes' compute
   overlap ((sum of lane busy - union) / (sum - max): 1 = side by side, 0 = one after another) and
   how many lanes one issuing thread keeps busy; writes a PNG of one steady iteration (a row per
   host thread and per stream) and a JSON report.

Presets: ``70b-3090`` (default: a 70B-class block on 3090-class GPUs over PCIe, where the issue cost
is small next to each lane's compute, so a lane waiting for another shows as lost overlap) and
``8b-h100`` (an 8B-class block on H100-class GPUs over NVLink, where the issuing thread's cost
matters: read the lanes-per-thread line). Nothing here ran on a GPU. The last line is
``host_syncs_per_iter=<n> lane_overlap=<x> world=<w>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dpq.testing.timeline.record import TimelineModel  # noqa: E402
from dpq.testing.timeline.replay import BLOCKS, GPUS, Timeline, simulate  # noqa: E402
from dpq.testing.timeline.scenarios import LEGACY, record_block, recorded_class, run_adapter, run_api  # noqa: E402

PRESETS = {"70b-3090": ("70b", "3090"), "8b-h100": ("8b", "h100")}
MACHINES = [("4 x 3090-class, PCIe", "3090", 4), ("8 x H100-class, NVLink", "h100", 8)]  # --table
PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:green", "exchange": "tab:orange", "step": "tab:purple",
                "readback": "tab:red", "pin": "tab:gray", "": "tab:gray"}


def measure_host_per_op(world: int, iters: int = 20) -> tuple[float, dict]:
    """Seconds of the issuing thread per op it queues, on this machine (module docstring, 2)."""
    import copy

    import dpq
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_tiny_llama(TinyLlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1))
        inputs, others = capture_block_inputs(model, calibration_samples(8, 8))
        block, inputs, others = model.model.layers[0], inputs[0], others[0]
        w = min(world, len(inputs))

        def tune(devices, n):
            return dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, world=w, devices=devices,
                                     iters=n, batch_size=len(inputs), seed=0)

        tune(["cpu"] * w, 3)  # warm-up
        issue_s = min(tune(["cpu"] * w, iters).issue_s for _ in range(3))  # per lane-iteration
        with TimelineModel(w, seqlen=1) as rec:
            rec.place(block, "cpu:1")
            rec.place(inputs, "cpu:1")
            rec.place([t for v in others.values() for t in _tensors(v)], "cpu:1")
            tune([f"cpu:{k + 1}" for k in range(w)], 3)
    finally:
        torch.set_num_threads(threads)
    steady = [op for op in rec.ops if op.iteration >= 1 and op.thread == "main"
              and op.kind not in ("marker", "sync") and op.phase not in ("backward",)]
    per_lane_iter = len(steady) / (max(op.iteration for op in rec.ops) * w)
    return issue_s / per_lane_iter, {"issue_s_per_lane_iteration": issue_s, "ops_per_lane_iteration": per_lane_iter,
                                     "world": w, "block": "tiny Llama layer, hidden 128, 8 x 8 tokens, 1 thread"}


def _tensors(value) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def summary_lines(tl: Timeline, world: int) -> list[str]:
    lines = []
    for it in tl.iterations:
        busy = ", ".join(f"{b * 1e3:.1f}" for b in it.lane_busy_s)
        lines.append(f"iteration {it.index}: {it.seconds * 1e3:.1f} ms, host syncs {len(it.syncs)}, lane overlap "
                     f"{it.overlap:.3f}, lane busy [{busy}] ms, issuing thread {it.issue_s * 1e3:.2f} ms")
        for s in it.syncs:
            lines.append(f"    sync: {s.what} (host stalled {s.stall_s * 1e3:.2f} ms) at {s.site}")
    lines.append(f"lanes one issuing thread keeps busy: {tl.lanes_per_thread():.1f} (a lane's compute per "
                 f"iteration / the issuing thread's host time per lane-iteration, {world} lanes)")
    return lines


def plot(tl: Timeline, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steady = tl.steady()[0].index
    ops = [op for op in tl.ops if op.iteration == steady and op.kind != "marker"]
    rows: dict[str, list[tuple[float, float, str]]] = {}
    threads = sorted({op.thread for op in ops}, key=lambda t: (t != "main", t))
    for th in threads:
        rows[f"host: {th}"] = []
    lane_of = {sid: k for k, streams in enumerate(tl.lane_streams) for sid in streams}
    t0 = min(tl.issue[op.id] for op in ops)
    prev: dict[str, float] = {}
    for op in ops:
        row = f"host: {op.thread}"
        a = prev.get(op.thread, tl.issue[op.id])
        if op.kind == "sync":
            rows[row].append((a - t0, tl.end[op.id] - a, "sync"))
            prev[op.thread] = tl.end[op.id]
            continue
        rows[row].append((a - t0, tl.issue[op.id] - a, op.phase))
        prev[op.thread] = tl.issue[op.id]
        if op.stream is not None and op.id in tl.start and op.kind in ("kernel", "copy", "collective"):
            name = f"lane {lane_of[op.stream.sid]} ({op.stream.name})" if op.stream.sid in lane_of else \
                f"side/other ({op.stream.name})"
            kind = "copy" if op.kind == "copy" else ("exchange" if op.kind == "collective" else op.phase)
            rows.setdefault(name, []).append((tl.start[op.id] - t0, tl.end[op.id] - tl.start[op.id], kind))
    colors = dict(PHASE_COLORS, copy="gold", sync="black")
    names = list(rows)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.45 * len(names)))
    for y, name in enumerate(reversed(names)):
        for kind in colors:
            bars = [(a * 1e3, max(w * 1e3, 1e-3)) for a, w, k in rows[name] if k == kind and w >= 0]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[kind], label=kind)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("ms (modelled)")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_table(rec, host_per_op: float, iters: int) -> list[str]:
    """Modelled iteration time per world and the speedup over one lane, for every machine and block
    class (the record of each world made once, replayed per class)."""
    worlds = sorted({1, 2, 4, 8})
    models = {w: run_adapter(rec, w, iters=iters) for w in worlds}
    out = ["| machine | block | ms/iter, 1 lane | ms/iter, all lanes | speedup (all lanes) | best W (speedup) "
           "| lane overlap | lanes per thread | host syncs/iter |",
           "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for mname, gpu_key, lanes in MACHINES:
        for bkey in ("8b", "32b", "70b"):
            tls = {w: simulate(models[w], recorded_class(), BLOCKS[bkey], GPUS[gpu_key], host_per_op)
                   for w in worlds if w <= lanes}
            per_iter = {w: sum(it.seconds for it in tl.steady()) / len(tl.steady()) for w, tl in tls.items()}
            best = min(per_iter, key=per_iter.get)
            tl = tls[lanes]
            out.append(f"| {mname} | {BLOCKS[bkey].name} | {per_iter[1] * 1e3:.0f} | {per_iter[lanes] * 1e3:.0f} "
                       f"| {per_iter[1] / per_iter[lanes]:.2f}x | {best} ({per_iter[1] / per_iter[best]:.2f}x) "
                       f"| {tl.lane_overlap():.2f} | {tl.lanes_per_thread():.1f} | {tl.syncs_per_iteration()} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--preset", choices=sorted(PRESETS), default="70b-3090")
    p.add_argument("--block", choices=sorted(BLOCKS), help="the target block class (overrides the preset's)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU class (overrides the preset's)")
    p.add_argument("--pool", choices=("home", "host", "spread"), default="home",
                   help="where the calibration pool lives (scenario docstring in dpq/testing/timeline/scenarios.py)")
    p.add_argument("--path", choices=("adapter", "api"), default="adapter",
                   help="the auto-round adapter (enable()) or dpq.parallel_tune")
    p.add_argument("--iters", type=int, default=3, help="iterations recorded (the first also stages per-block data)")
    p.add_argument("--host-per-op-us", type=float, default=None,
                   help="the issuing thread's host cost per op in microseconds (default: measured here)")
    p.add_argument("--legacy", action="store_true",
                   help="the data path before it was lane-local: host masks copied in _get_loss, samples copied "
                        "on the pool device's current stream")
    p.add_argument("--table", action="store_true",
                   help="instead: the modelled speedup table for 4 x 3090-class and 8 x H100-class machines and "
                        "8B/32B/70B-class blocks (worlds 1, 2, 4, 8 recorded once each)")
    p.add_argument("--out", default=os.environ.get("OUT", "out/timeline"))
    args = p.parse_args(argv)
    if not 1 <= args.world <= 16:
        p.error("--world must be 1..16 (the recorded block has 16 samples, 8 per iteration)")
    block_key, gpu_key = PRESETS[args.preset]
    block, gpu = BLOCKS[args.block or block_key], GPUS[args.gpu or gpu_key]
    from benchmarks.report import _busy_cpu_seconds

    t0, mine0, busy0 = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
    if args.host_per_op_us is None:
        host_per_op, calibration = measure_host_per_op(args.world)
    else:
        host_per_op, calibration = args.host_per_op_us * 1e-6, {"given": True}
    rec = record_block()
    if args.table:
        print(f"modelled (not measured on a GPU); host {host_per_op * 1e6:.2f} us per op measured here "
              f"({calibration}); {args.iters} iterations recorded per world, the steady ones averaged")
        print("\n".join(speedup_table(rec, host_per_op, args.iters)))
        return 0
    run = run_adapter if args.path == "adapter" else run_api
    model = run(rec, args.world, pool=args.pool, iters=args.iters, mutations=LEGACY if args.legacy else ())
    tl = simulate(model, recorded_class(), block, gpu, host_per_op)
    label = (f"{args.path} path, world {args.world}, pool on {args.pool}{', legacy data path' if args.legacy else ''}"
             f"; {block.name} on {gpu.name}; host {host_per_op * 1e6:.2f} us per op")
    print(f"timeline model: {label}")
    if model.violations:
        print(f"{len(model.violations)} device-mix violations (CUDA would raise), first: {model.violations[0]}")
    for line in summary_lines(tl, args.world):
        print(line)
    out = Path(args.out)
    stem = f"timeline_w{args.world}_{args.preset}_{args.pool}{'_legacy' if args.legacy else ''}"
    plot(tl, out / f"{stem}.png", f"timeline model (modelled, not measured on a GPU): {label}")
    report = {
        "world": args.world, "preset": args.preset, "block": block.name, "gpu": gpu.name, "pool": args.pool,
        "path": args.path, "legacy": args.legacy, "host_per_op_s": host_per_op, "calibration": calibration,
        "host_syncs_per_iter": tl.syncs_per_iteration(), "lane_overlap": tl.lane_overlap(),
        "lanes_per_thread": tl.lanes_per_thread(), "violations": model.violations,
        "iterations": [{"index": it.index, "seconds": it.seconds, "overlap": it.overlap, "lane_busy_s": it.lane_busy_s,
                        "issue_s": it.issue_s, "syncs": [{"what": s.what, "site": s.site, "stall_s": s.stall_s}
                                                         for s in it.syncs]} for it in tl.iterations],
    }
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    busy1 = _busy_cpu_seconds()
    if busy0 is not None and busy1 is not None:  # the host cost per op was measured while this ran
        share = max(0.0, (busy1 - busy0) - (time.process_time() - mine0)) / \
            ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        print(f"other processes used {share:.0%} of the machine's CPU during this run")
    print(f"wrote {out / stem}.png and .json ({time.perf_counter() - t0:.0f} s)")
    print(f"host_syncs_per_iter={tl.syncs_per_iteration()} lane_overlap={tl.lane_overlap():.2f} world={args.world}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
