"""Host time of the issuing thread per lane-iteration, split by part, and the lanes one thread can feed.

    .venv/bin/python -m benchmarks.issue_cost

A launch-bound block: a tiny Llama decoder layer (hidden 128, intermediate 256, 8 samples x 8
tokens) tuned by ``dpq.parallel_tune`` (auto-round's wrapper, SignSGD, the sign exchange) on 1,
2, 4, 8 CPU lanes with one intra-op thread, so the time is Python and dispatch, not arithmetic.
Every part of each iteration is timed where it runs (wrappers around the engine's calls):

- ``forward+loss``: every lane's ``lane_loss`` (auto-round's wrapped forward, the loss);
- ``backward``: ``torch.autograd.backward`` minus the exchange issued inside it (on CPU this is
  the whole backward, arithmetic included; on GPUs autograd's per-device threads traverse each
  lane's graph, in parallel, while the issuing thread waits for the slowest);
- ``exchange``: issuing every bucket's collectives (``exchange_bucket``; on CPU the sums too);
- ``step``: every lane's optimizer step, zero_grad and lr schedule (``TuneEngine.step``);
- ``other``: the rest of the engine's iteration (its phases split, readback queue and readback; the grad views).

Per lane-iteration = per iteration / W. The issuing thread's share on a GPU machine is
``issue = forward+loss + exchange + step + other`` per lane (the backward runs on the device
threads). "Lanes one thread can feed" for a block class on a GPU class: with W lanes an
iteration needs ``W * issue + backward_lane`` of host time and ``compute / W`` of device time,
``compute = FLOPs / achievable throughput``; the thread keeps the GPUs busy while
``W * issue + backward_lane <= compute / W``. FLOPs per iteration (``dpq.planning.cost_model.block_flops``):
6 x tokens x linear params + 12 x samples x seqlen^2 x hidden, for a batch of 8 x 2048 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dpq import tune_loop  # noqa: E402
from dpq.engine import phases  # noqa: E402
from dpq.planning.cost_model import CostInputs, block_flops, predict  # noqa: E402

# (name, hidden, intermediate, kv dim): Llama-3-8B, Qwen2.5-32B, Llama-3-70B blocks
BLOCKS = [("8B-class", 4096, 14336, 1024), ("32B-class", 5120, 27648, 1024), ("70B-class", 8192, 28672, 1024)]
# achievable bf16 throughput for auto-round's block (assumed, not measured here)
GPUS = [("H100-class", 400e12), ("3090-class", 25e12)]
SAMPLES, SEQLEN = 8, 2048
# (machine, lanes, GPU throughput, per-lane bus bandwidth, latency per collective): stated, not measured here
MACHINES = [("4 x RTX 3090, PCIe, no P2P", 4, 25e12, 10e9, 50e-6), ("8 x H100 SXM, NVLink", 8, 400e12, 350e9, 20e-6)]
ITERS = 200  # auto-round's default
BUCKET_CAP = 2**22  # dpq.engine.exchange.GradBuckets' default


def speedup_table(issue_s: float, overlap: float) -> list[str]:
    """Modeled block-time speedup over one lane (dpq.planning.cost_model.predict), sign exchange."""
    out = ["| machine | block | tuned values | compute ms/iter (1 lane) | issue ms/lane-iter | W | exchange ms/iter "
           "| exposed ms/iter | speedup vs 1 lane | best W (speedup) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for mname, lanes, tput, bw, lat in MACHINES:
        for bname, h, inter, kv in BLOCKS:
            n = linear_params(h, inter, kv)
            tuned = n + n // 64  # rounding values + min/max scales (group 128)
            c = CostInputs(compute_s=block_flops(n, SAMPLES * SEQLEN, hidden=h, seqlen=SEQLEN, samples=SAMPLES) / tput,
                           issue_s=issue_s, tuned_elems=tuned, bandwidth_Bps=bw, latency_s=lat, policy="sign",
                           buckets=-(-tuned // BUCKET_CAP), overlap=overlap,
                           setup_per_mirror_s=2 * n / bw)  # bf16 weights copied once per mirror
            one = predict(1, ITERS, c).seconds
            preds = {w: predict(w, ITERS, c) for w in range(1, lanes + 1)}
            best = min(preds.values(), key=lambda p: p.seconds)
            p = preds[lanes]
            out.append(f"| {mname} | {bname} | {tuned / 1e6:.0f} M | {c.compute_s * 1e3:.0f} | {issue_s * 1e3:.2f} "
                       f"| {lanes} | {p.parts['exchange_s'] * 1e3:.0f} | {p.parts['exposed_s'] * 1e3:.0f} "
                       f"| {one / p.seconds:.2f}x | {best.world} ({one / best.seconds:.2f}x) |")
    return out


def linear_params(hidden: int, intermediate: int, kv: int) -> int:
    return 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate


# the engine's phases that make its iteration but the step (dpq.engine.phases)
ITERATION_PHASES = ("split", "forward", "readback queue", "backward", "exchange", "readback")


class _PhaseTimes(phases.Observer):
    """The engine's phases timed into ``parts`` (Note [observers, not patches] in ``dpq.engine.phases``): each
    lane's forward and loss, each bucket's exchange, the step, and the iteration's other phases."""

    def __init__(self, parts: dict) -> None:
        self.parts, self.started = parts, {}

    def phase_begin(self, name, owner, lane):
        self.started[(name, lane)] = time.perf_counter()

    def phase_end(self, name, owner, lane, error):
        took = time.perf_counter() - self.started.pop((name, lane))
        if not isinstance(owner, tune_loop.TuneEngine):
            return
        if name == "forward" and lane is not None:
            self.parts["forward+loss"] += took
        elif name == "step":
            self.parts["step"] += took
            self.parts["iterations"] += 1
        elif name in ITERATION_PHASES and lane is None:
            self.parts["engine_iteration"] += took

    def exchange_begin(self, policy, bucket, numel):
        self.started[("bucket", bucket)] = time.perf_counter()

    def exchange_end(self, policy, bucket, numel, error):
        self.parts["exchange"] += time.perf_counter() - self.started.pop(("bucket", bucket))


@contextlib.contextmanager
def instrument(parts: dict):
    """Time the engine's parts (module docstring) into ``parts[name]`` (seconds, summed): the engine's
    phases through an observer, autograd's backward calls (torch's, less the exchange they ran) by a
    wrapper."""
    real_backward = torch.autograd.backward

    def backward(*a, **k):
        t0, ex0 = time.perf_counter(), parts["exchange"]
        try:
            real_backward(*a, **k)
        finally:
            parts["backward"] += time.perf_counter() - t0 - (parts["exchange"] - ex0)

    torch.autograd.backward = backward
    try:
        with phases.observing(_PhaseTimes(parts)):
            yield
    finally:
        torch.autograd.backward = real_backward


@contextlib.contextmanager
def step_kind(one_op: bool):
    """``one_op=False``: every lane runs auto-round's ``SignSGD.step`` (the adapter does not ask for
    dpq.engine.sign_step's one-op step), for the A/B of ``--step-ab``."""
    from dpq.autoround import tune

    real = tune.one_op_sign_step
    if not one_op:
        tune.one_op_sign_step = lambda *a: False
    try:
        yield
    finally:
        tune.one_op_sign_step = real


def measure(block, inputs, others, world: int, iters: int, one_op: bool = True) -> dict:
    import copy

    import dpq

    parts: dict = defaultdict(float)
    with instrument(parts), step_kind(one_op):
        dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, world=world,
                          devices=",".join(["cpu"] * world), iters=iters, batch_size=len(inputs), seed=0)
    n = parts.pop("iterations")
    ebwd = parts.pop("engine_iteration")
    out = {k: v / n for k, v in parts.items()}
    out["other"] = ebwd / n - out["forward+loss"] - out["backward"] - out["exchange"]
    out["iteration"] = ebwd / n + out["step"]
    return out


def profile_forward(block, inputs, others, calls: int = 20) -> list[str]:
    """Where one lane's forward+loss spends the issuing thread's time (world 1): aten ops per call
    (torch.profiler) and, per call, the time in auto-round's wrapped Linear forward, of it the
    weight quantize-dequantize, and the rest of the lane loss (cProfile over ``calls`` calls)."""
    import copy
    import cProfile
    import pstats

    import dpq

    out: list[str] = []

    def profiled_loss(lane_loss):
        def profiled(lane, module, indices):
            if out:
                return lane_loss(lane, module, indices)
            lane_loss(lane, module, indices)  # warm
            with torch.profiler.profile() as prof:
                lane_loss(lane, module, indices)
            ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(calls):
                lane_loss(lane, module, indices)
            pr.disable()
            stats = pstats.Stats(pr).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
            cum = {}
            for (file, _, name), (_, _, _, ct, _) in stats.items():
                if file.endswith("auto_round/wrapper.py") and name in ("forward", "_qdq_weight"):
                    cum[name] = cum.get(name, 0.0) + ct
            total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "lane_loss")
            wrapped, qdq = cum.get("forward", 0.0), cum.get("_qdq_weight", 0.0)
            out.append(f"forward+loss of one lane (world 1, one call): {ops} aten ops; per call "
                       f"{total / calls * 1e3:.2f} ms under cProfile, of it auto-round's wrapped Linear forwards "
                       f"{wrapped / calls * 1e3:.2f} ms (their weight quantize-dequantize {qdq / calls * 1e3:.2f} ms)")
            return lane_loss(lane, module, indices)
        return profiled

    class Profiles(phases.Observer):
        """The first engine's lane loss profiled (the engine's own attribute, set before its first forward)."""

        def phase_begin(self, name, owner, lane):
            if name == "split" and not getattr(owner, "profiled", False):
                owner.profiled, owner.lane_loss = True, profiled_loss(owner.lane_loss)

    with phases.observing(Profiles()):
        dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, world=1, devices="cpu", iters=2,
                          batch_size=len(inputs), seed=0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4,8")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=8)
    p.add_argument("--model-only", type=float, default=None, metavar="ISSUE_MS",
                   help="skip the measurement: print the modeled speedups for this issue cost (ms per lane-iteration)")
    p.add_argument("--overlap", type=float, default=0.6, help="hidden fraction for the model (benchmarks.overlap)")
    p.add_argument("--step-ab", action="store_true",
                   help="also A/B the step: dpq.engine.sign_step's one-op step vs each lane's SignSGD.step (rounds "
                        "interleaved)")
    p.add_argument("--profile-forward", action="store_true",
                   help="also say where one lane's forward+loss spends its time (aten ops, auto-round's wrapper)")
    args = p.parse_args(argv)
    if args.model_only is not None:
        print("\n".join(speedup_table(args.model_only / 1e3, args.overlap)))
        return 0
    torch.set_num_threads(1)
    from benchmarks.report import _busy_cpu_seconds, _cpu_model
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    model = build_tiny_llama(TinyLlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                             num_hidden_layers=1))
    inputs, others = capture_block_inputs(model, calibration_samples(args.nsamples, args.seqlen))
    block, inputs, others = model.model.layers[0], inputs[0], others[0]
    wall0, mine0, busy0 = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
    rows, ab = {}, {}
    for w in map(int, args.worlds.split(",")):
        measure(block, inputs, others, w, 3)  # warm-up
        runs, per_lane = [], []
        for _ in range(args.rounds):
            runs.append(measure(block, inputs, others, w, args.iters))
            if args.step_ab:
                per_lane.append(measure(block, inputs, others, w, args.iters, one_op=False))
        rows[w] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        if per_lane:
            ab[w] = {k: statistics.median(r[k] for r in per_lane) for k in per_lane[0]}
    busy1 = _busy_cpu_seconds()
    profile = profile_forward(block, inputs, others) if args.profile_forward else []
    keys = ["forward+loss", "backward", "exchange", "step", "other"]
    print(f"{_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 intra-op thread; tiny Llama layer "
          f"hidden {args.hidden}, intermediate {args.intermediate}, {args.nsamples} x {args.seqlen} tokens; "
          f"dpq.parallel_tune, {args.iters} iters, median of {args.rounds}")
    print("\nms per lane-iteration (per iteration / W):\n")
    print("| W | " + " | ".join(keys) + " | issue (all but backward) | iteration / W |")
    print("|---:|" + "---:|" * (len(keys) + 2))
    for w, r in rows.items():
        issue = sum(r[k] for k in keys if k != "backward")
        print(f"| {w} | " + " | ".join(f"{r[k] / w * 1e3:.2f}" for k in keys) +
              f" | {issue / w * 1e3:.2f} | {r['iteration'] / w * 1e3:.2f} |")
    for line in profile:
        print("\n" + line)
    if ab:
        print("\nThe step A/B, rounds interleaved (ms per lane-iteration, medians; per-lane = each lane's "
              "SignSGD.step, one-op = dpq.engine.sign_step):\n")
        print("| W | step per-lane | step one-op | ratio | issue per-lane | issue one-op | ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for w, old in ab.items():
            new = rows[w]
            i_old, i_new = (sum(r[k] for k in keys if k != "backward") for r in (old, new))
            print(f"| {w} | {old['step'] / w * 1e3:.3f} | {new['step'] / w * 1e3:.3f} "
                  f"| {new['step'] / old['step']:.2f} | {i_old / w * 1e3:.2f} | {i_new / w * 1e3:.2f} "
                  f"| {i_new / i_old:.2f} |")
    if busy0 is not None and busy1 is not None:
        share = max(0.0, (busy1 - busy0) - (time.process_time() - mine0)) / \
            ((time.perf_counter() - wall0) * (os.cpu_count() or 1))
        print(f"\nother processes used {share:.0%} of the machine's CPU during this run")
    wmax = max(rows)
    issue = sum(rows[wmax][k] for k in keys if k != "backward") / wmax
    bwd_lane = rows[wmax]["backward"] / wmax
    print(f"\nissue per lane-iteration (W={wmax}): {issue * 1e3:.2f} ms; backward per lane {bwd_lane * 1e3:.2f} ms "
          "(device threads on GPUs)")
    print("\n| block | GPU | TFLOP/iter | compute ms/iter (1 lane) | (compute / 8) / issue at W=8 "
          "| lanes one thread can feed |")
    print("|---|---|---:|---:|---:|---:|")
    for name, h, inter, kv in BLOCKS:
        flops = block_flops(linear_params(h, inter, kv), SAMPLES * SEQLEN, hidden=h, seqlen=SEQLEN, samples=SAMPLES)
        for gpu, tput in GPUS:
            c = flops / tput
            fed = max((w for w in range(1, 65) if w * issue + bwd_lane <= c / w), default=0)
            print(f"| {name} | {gpu} ({tput / 1e12:.0f} TFLOP/s) | {flops / 1e12:.1f} | {c * 1e3:.0f} "
                  f"| {c / 8 / issue:.1f} | {fed} |")
    for share in (1.0, 1 / 3):
        print(f"\nModeled speedup (dpq.planning.cost_model, sign exchange, {ITERS} iters, overlap {args.overlap}), "
              f"issue = {share:.2g} x the CPU-measured {issue * 1e3:.2f} ms:\n")
        print("\n".join(speedup_table(issue * share, args.overlap)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
