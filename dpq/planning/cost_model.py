"""Predicted block time per world, and ``auto``'s choice of the world by it.

For a block tuned ``iters`` iterations on W lanes::

    T(W) = setup(W) + iters * (max(W * issue, compute / W) + exposed(W))

* ``setup(W)``: building the W-1 mirrors (``setup_per_mirror_s`` each; 0 at W = 1).
* ``issue``: host time of the one issuing thread per lane-iteration (forward, loss, backward
  launch, exchange launch, step: ``benchmarks/issue_cost.py`` measures it). The thread issues
  W lanes one after another while the devices run, so an iteration takes at least ``W * issue``.
* ``compute``: device time of one whole iteration (the global batch) on one lane; each lane
  computes 1/W of it, all lanes at once.
* ``exposed(W)``: the exchange time the backward does not hide. The exchange of one
  iteration takes ``E = collectives * latency + wire_bytes(W) / bandwidth`` with
  ``wire_bytes(W) = (W-1)/W * bytes_per_elem * tuned_elems`` (sign path 2.25: bf16 sums and 2-bit
  signs; full path 8 bytes per element: ``dpq.engine.exchange``) and ``bandwidth`` the per-lane bus bandwidth. With
  overlap, bucket i is exchanged while the backward fills the later buckets, so up to
  ``overlap * backward(W)`` of it is hidden (``backward(W) = backward_share * compute / W``,
  ``overlap`` the hidden fraction measured by ``benchmarks/overlap.py``), but never the last
  bucket's share ``E / buckets``: ``exposed = E - min(E - E / buckets, overlap * backward(W))``.

Inputs come from measurements: :func:`probe_link` times a few all_reduces on the real lanes
(once per run), compute from FLOPs (:func:`block_flops` at a stated throughput) or from the
first timed iterations (:func:`compute_from_iteration`). :func:`choose_world` picks the W with
the smallest predicted T and says why; ties go to fewer lanes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["AutoWorld", "Choice", "CostInputs", "Prediction", "block_flops", "choose_world", "compute_from_iteration",
           "exchange_seconds", "predict", "probe_link", "wire_bytes"]

log = logging.getLogger("dpq.planning.cost_model")

BYTES_PER_ELEM = {"sign": 2.25, "full": 8.0}  # Note [the summed gradient in bf16 on the wire] (dpq.engine.exchange)
COLLECTIVES_PER_BUCKET = {"sign": 2, "full": 1}  # reduce-scatter + all-gather, or one all-reduce


@dataclass
class CostInputs:
    """What the prediction needs (module docstring); seconds and bytes per second."""

    compute_s: float  # device time of one iteration's whole batch on one lane
    issue_s: float  # issuing thread's host time per lane-iteration
    tuned_elems: int  # values exchanged per iteration
    bandwidth_Bps: float  # per-lane bus bandwidth of the link
    latency_s: float = 0.0  # per collective
    policy: str = "sign"  # 'sign' or 'full'
    buckets: int = 1
    overlap: float = 0.0  # fraction of the backward the exchange can hide under (0: none)
    backward_share: float = 2 / 3  # backward's share of compute (2 of 6 FLOPs per weight-token are forward)
    setup_per_mirror_s: float = 0.0


@dataclass
class Prediction:
    world: int
    seconds: float  # the whole block
    per_iter_s: float
    parts: dict = field(default_factory=dict)  # issue, compute, exchange, exposed, setup


@dataclass
class Choice:
    world: int
    predictions: list[Prediction]
    reason: str


def wire_bytes(world: int, tuned_elems: int, policy: str = "sign") -> float:
    """Bytes one lane puts on the wire per iteration: (W-1)/W x 2.25 (sign) or 8 (full) per element."""
    return (world - 1) / world * BYTES_PER_ELEM[policy] * tuned_elems


def exchange_seconds(world: int, c: CostInputs) -> float:
    if world <= 1:
        return 0.0
    return COLLECTIVES_PER_BUCKET[c.policy] * c.buckets * c.latency_s + wire_bytes(world, c.tuned_elems,
                                                                                   c.policy) / c.bandwidth_Bps


# The issuing thread's host time per lane-iteration of auto-round's compiled block on a GPU, before a run
# measured it: the H200 lease (benchmarks/calibration/NVIDIA_H200-2026-12-04.json, dpq_issuing): world 4's
# unprofiled 48.9 ms iteration on one GPU / 4 lanes. An upper bound (those lanes were likely GPU-bound), so
# what it says about P processes x 1 lane is an upper bound on the gain too.
GPU_ISSUE_S_PER_LANE_ITERATION = 48.863e-3 / 4


def predict(world: int, iters: int, c: CostInputs, devices: int | None = None, processes: int = 1) -> Prediction:
    """T(world) for a block of ``iters`` iterations (module docstring). ``devices``: the distinct
    devices the ``world`` lanes are on (None: one each). Lanes sharing a device take turns on it, so
    compute divides by the devices, not the lanes (CPU lanes sharing one CPU: no speedup at all).
    ``processes``: the lanes spread over that many processes (torchrun), each issuing its own lanes
    on its own thread under its own GIL: the issuing time is one process's lanes'."""
    issue = -(-world // max(1, processes)) * c.issue_s
    compute = c.compute_s / max(1, min(world, devices if devices is not None else world))
    e = exchange_seconds(world, c)
    backward = c.backward_share * compute
    exposed = e - min(e - e / max(1, c.buckets), max(0.0, c.overlap) * backward) if e > 0 else 0.0
    setup = (world - 1) * c.setup_per_mirror_s
    per_iter = max(issue, compute) + exposed
    return Prediction(world, setup + iters * per_iter, per_iter,
                      {"issue_s": issue, "compute_s": compute, "exchange_s": e, "exposed_s": exposed,
                       "setup_s": setup})


def choose_world(worlds: Iterable[int], iters: int, c: CostInputs, *, label: str = "block") -> Choice:
    """The world with the smallest predicted block time (fewer lanes on a tie), logged."""
    preds = [predict(w, iters, c) for w in sorted(set(worlds))]
    if not preds:
        raise ValueError("dpq: choose_world needs at least one candidate world")
    best = min(preds, key=lambda p: (round(p.seconds, 12), p.world))
    table = ", ".join(f"W={p.world}: {p.seconds:.3g} s" for p in preds)
    p = best.parts
    reason = (f"predicted {label} time {table}; world {best.world} is fastest (per iteration: issue "
              f"{p['issue_s'] * 1e3:.3g} ms, compute {p['compute_s'] * 1e3:.3g} ms, exchange "
              f"{p['exchange_s'] * 1e3:.3g} ms of which {p['exposed_s'] * 1e3:.3g} ms exposed)")
    reason += spread_note(max(p.world for p in preds), iters, c, best.seconds)
    log.info("dpq auto: %s", reason)
    return Choice(best.world, preds, reason)


SPREAD_GAIN = 1.10  # P x 1 predicted faster than the best in one process by more than this: say how to get it


def spread_note(world: int, iters: int, c: CostInputs, best_s: float) -> str:
    """What ``world`` processes x 1 lane (torchrun; each its own issuing thread) would take beside the best
    world in one process, where the issuing thread's time is known (``c.issue_s``, measured on the block
    before); where it is more than 10% faster, the torchrun command's shape (``auto`` cannot re-launch itself)."""
    if world < 2 or c.issue_s <= 0:
        return ""
    spread = predict(world, iters, c, processes=world)
    note = f"; {world} processes x 1 lane (torchrun) {spread.seconds:.3g} s"
    if best_s > SPREAD_GAIN * spread.seconds:
        note += (f", {best_s / spread.seconds:.2f}x faster predicted: torchrun --nproc-per-node {world} "
                 f"-m dpq.autoround.cli <this command> --parallel_quantization 1")
    return note


# -- inputs ------------------------------------------------------------------------------------


def block_flops(linear_params: int, tokens: int, *, layers_attn: int = 1, hidden: int = 0, seqlen: int = 0,
                samples: int = 0) -> float:
    """FLOPs of one tuning iteration of a block: forward + backward of its linear layers
    (6 x tokens x linear params: 2 forward, 4 backward for the input and weight gradients) plus
    attention scores and values (forward 4 x samples x seqlen^2 x hidden, times 3 with backward).
    The quantize-dequantize of the weights is elementwise and left out."""
    attn = 12.0 * samples * seqlen * seqlen * hidden * layers_attn
    return 6.0 * tokens * linear_params + attn


def compute_from_iteration(seconds_per_iter: float, world: int, c: CostInputs) -> float | None:
    """compute_s that makes ``predict(world)`` give a measured iteration time (the first timed
    iterations of a block), assuming the devices, not the issuing thread, bound the iteration.
    None when the issuing thread did (``world * c.issue_s`` is most of the iteration): the devices'
    time is then hidden behind it and cannot be read off the iteration."""
    if world * c.issue_s >= 0.9 * seconds_per_iter:
        return None
    e = exchange_seconds(world, c)
    last = e / max(1, c.buckets)
    hide = max(0.0, c.overlap) * c.backward_share
    compute = world * max(0.0, seconds_per_iter - last)  # the exposed part is the last bucket alone
    if e - hide * compute / world > last:  # ... unless the backward is too short to hide the rest
        compute = world * max(0.0, seconds_per_iter - e) / max(1e-9, 1.0 - hide)
    return compute


def probe_link(comm, sizes: Sequence[int] = (2**12, 2**20), reps: int = 3) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of ``comm`` from timed all_reduces of two sizes on its real lanes
    (fp32 zeros, one buffer per lane; the median of ``reps`` each), fitted to t = latency + bytes / bw
    with bytes the ring wire bytes. Waits for each call: the lanes synchronize, and a communicator
    that completes later (``dpqlab.simulated_link``) is waited for."""
    from dpq.comm.comm_base import ring_wire_bytes

    lanes = comm.lanes
    world = comm.world
    if world < 2:
        return 0.0, float("inf")

    def done():
        comm.wait()
        for lane in lanes:
            lane.synchronize()

    points = []
    for n in sizes:
        bufs = []
        for lane in lanes:
            with lane.issue():
                bufs.append(torch.zeros(n, dtype=torch.float32, device=lane.device))
        comm.all_reduce(bufs)  # warm-up
        done()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            comm.all_reduce(bufs)
            done()
            times.append(time.perf_counter() - t0)
        times.sort()
        points.append((ring_wire_bytes("all_reduce", world, n, 4), times[len(times) // 2]))
    (b0, t0), (b1, t1) = points[0], points[-1]
    if b1 <= b0 or t1 <= t0:
        return max(t1, 0.0), float("inf")
    bw = (b1 - b0) / (t1 - t0)
    return max(0.0, t0 - b0 / bw), bw


# Achievable dense throughput per device type (FLOP/s) for the first block's compute estimate,
# before any iteration is measured: stated guesses (bf16 on an H100-class GPU at ~40% of peak;
# a few CPU cores); from the second block on the previous block's measured iteration time is used.
ACHIEVABLE_FLOPS = {"cuda": 300e12, "xpu": 150e12, "hpu": 300e12, "cpu": 5e10}


class AutoWorld:
    """``auto``'s choice of the world, for one run: the link probed once per lane set (on the real
    lanes, through the run's communicator), each block's world chosen by :func:`choose_world`,
    and predicted vs measured block times kept for the run report (:attr:`records`).

    Compute per iteration: ``compute_s`` when given (tests, benchmarks), else from the previous
    block's measured iteration time (:meth:`measured`; not when the issuing thread bounded it),
    else from the block's FLOPs at :data:`ACHIEVABLE_FLOPS`. Issue cost per lane-iteration:
    ``issue_s`` when given, else the previous block's measured one (``measured(issue_s=...)``: the
    session passes the engine's for accelerator lanes; on CPU lanes the forward's host time is the
    compute itself), else 0. ``wrap``: the run's communicator as the choice and the lanes see it
    (tests and benchmarks put ``dpqlab.simulated_link.SimulatedLink`` around it)."""

    def __init__(self, *, issue_s: float | None = None, overlap: float = 0.0, setup_per_mirror_s: float = 0.0,
                 policy: str = "sign", buckets: int = 1, probe_sizes: Sequence[int] = (2**12, 2**20),
                 compute_s: float | None = None, wrap=None) -> None:
        self.probe_sizes = tuple(probe_sizes)
        self.issue_s, self.overlap, self.setup_per_mirror_s = issue_s, overlap, setup_per_mirror_s
        self.policy, self.buckets = policy, buckets
        self.compute_s, self.wrap = compute_s, wrap
        self.links: dict[tuple, tuple[float, float]] = {}  # lane devices -> (latency, bandwidth)
        self.records: list[dict] = []
        self._last: tuple[float, int, CostInputs] | None = None  # previous block: s/iter, world, inputs
        self._issue: float | None = None  # the last measured issue cost (measured(issue_s=...))

    def link(self, comm) -> tuple[float, float]:
        key = tuple(str(lane.device) for lane in comm.lanes)
        if key not in self.links:
            self.links[key] = probe_link(comm, self.probe_sizes)
        return self.links[key]

    def inputs(self, comm, *, compute_s: float, tuned_elems: int) -> CostInputs:
        latency, bw = self.link(comm)
        return CostInputs(compute_s=compute_s, issue_s=self.issue(), tuned_elems=tuned_elems, bandwidth_Bps=bw,
                          latency_s=latency, policy=self.policy, buckets=self.buckets, overlap=self.overlap,
                          setup_per_mirror_s=self.setup_per_mirror_s)

    def estimate_compute(self, *, flops: float, device_type: str) -> tuple[float, str]:
        """(compute_s, where it came from) for the next block (class docstring)."""
        if self.compute_s is not None:
            return self.compute_s, "compute given"
        bound = ""
        if self._last is not None:
            per_iter, world, c = self._last
            compute = compute_from_iteration(per_iter, world, c)
            if compute is not None:
                return compute, f"compute from the previous block ({per_iter * 1e3:.3g} ms/iter at world {world})"
            bound = f"; the previous block's iterations were bound by the issuing thread at world {world}"
        rate = ACHIEVABLE_FLOPS.get(device_type, ACHIEVABLE_FLOPS["cpu"])
        return flops / rate, f"compute from FLOPs ({flops:.3g} at {rate:.3g} FLOP/s){bound}"

    def issue(self) -> float:
        """Issue cost per lane-iteration for the next prediction (class docstring)."""
        return self.issue_s if self.issue_s is not None else (self._issue or 0.0)

    def choose(self, comm, *, iters: int, compute_s: float, tuned_elems: int, label: str = "block") -> Choice:
        """World 1 .. len(comm.lanes) by predicted time; the lanes kept are the first W."""
        c = self.inputs(comm, compute_s=compute_s, tuned_elems=tuned_elems)
        choice = choose_world(range(1, len(comm.lanes) + 1), iters, c, label=label)
        self.records.append({"block": label, "world": choice.world,
                             "predicted_s": {p.world: p.seconds for p in choice.predictions},
                             "measured_s": None, "reason": choice.reason, "_inputs": c})
        return choice

    def measured(self, label: str, seconds: float, *, iters: int = 0, world: int = 1,
                 issue_s: float | None = None) -> None:
        """The block's measured time, next to its prediction in :attr:`records`; its time per
        iteration becomes the next block's compute estimate, and ``issue_s`` (its issuing thread's
        host time per lane-iteration) the next block's issue cost unless one was given."""
        if issue_s is not None:
            self._issue = issue_s
        for rec in reversed(self.records):
            if rec["block"] == label and rec["measured_s"] is None:
                rec["measured_s"] = seconds
                if issue_s is not None:
                    rec["issue_s"] = issue_s
                c = rec.pop("_inputs", None)
                if c is not None and iters > 0:
                    if issue_s is not None and self.issue_s is None:
                        c = CostInputs(**{**c.__dict__, "issue_s": issue_s})  # the issue this block had
                    self._last = (seconds / iters, world, c)
                return

    def report(self) -> list[dict]:
        """Predicted vs measured per block (JSON-ready)."""
        return [{k: v for k, v in rec.items() if not k.startswith("_")} for rec in self.records]
