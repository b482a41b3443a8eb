"""How much of the exchange the backward hides: CPU lanes, a tiny-Llama-shaped block, a simulated link.

    .venv/bin/python -m benchmarks.overlap                 # worlds 2 and 4, sign exchange
    .venv/bin/python -m benchmarks.overlap --policy full --worlds 2

For each world W: W CPU lanes (``dpq.streams.make_lanes``), one replica of a tiny Llama decoder
layer per lane (``dpq.mirror.ReplicaSet``), dpq's engine (``dpq.tune_loop.TuneEngine``) doing
whole iterations (forward on every lane, one backward, exchange, step). The tuned values are
the layer's seven Linear weights in fp32 (the shapes of auto-round's rounding values), the
loss the MSE against the layer's fp32 outputs, under bf16 autocast where auto-round would use
it on this CPU (``--amp``), as auto-round's.

The exchange goes over :class:`dpqlab.simulated_link.SimulatedLink` around the local
communicator: the real sums, then each collective completes after ``latency + bytes /
bandwidth``. The bandwidth is set so that one iteration's exchange takes about one lane's
backward time (``--exchange-vs-backward``, default 1.0). One lane's backward is measured as
the engine's backward time over W: on CPU the lanes' backwards run one after another on the
calling thread (on GPUs each lane's backward runs on its own device, at the same time as the
others), and a bucket is complete only once lane 0, whose graph autograd runs last, has
produced it. So on CPU the exchange can hide under lane 0's backward only, the part that
corresponds to a GPU lane's whole backward.

The default batch is auto-round's own default, 8 samples x 2048 tokens (``--nsamples``,
``--seqlen``): the tokens of one iteration of the 8B-class block the cost model prices. The
token count matters on CPU only: there every lane's share of the exchange's sums and sign
packing runs on the one core that also runs the backward (on GPUs it is kernels on each lane's
own device), W lanes' worth of it, so it cannot hide; it grows with W x tuned values while one
lane's backward grows with tokens x tuned values / W. Fewer tokens make that CPU-only share a
larger part of the exposed time (``--seqlen 512``: see docs/PERFORMANCE.md for both).

Three timings per world, interleaved over ``--rounds`` rounds, median seconds per iteration:

- ``T_none``: no exchange at all (lanes diverge; timing only);
- ``T_after``: every bucket exchanged after the backward (``overlap=False``);
- ``T_overlap``: buckets exchanged as the backward fills them (``overlap=True``).

hidden fraction = 1 - (T_overlap - T_none) / (T_after - T_none). The last line printed is
``hidden_fraction=<x> world=<w> link_GBps=<b>`` for the world with the smallest x.

Time budget: the default run fits ``--budget-s`` (270 s from its start: within 5 minutes on a 2-core CPU). It
times one iteration first and chooses the sizes not given on the command line: fewer iterations
per round and rounds first (the same quantity, noisier), then, only if even those do not fit,
fewer tokens per sample (halved, not below 256), and prints what it chose on its first line. One
8 x 2048-token iteration took ~3 s under bf16 autocast on an AVX512-BF16 Xeon and ~6 s in fp32 (a
CPU without AVX512-BF16, where auto-round, and so this benchmark by default, runs fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dpq.engine import phases  # noqa: E402
from dpq.engine.exchange import (  # noqa: E402
    OVERLAP_BUCKET_CAP,
    ExchangePlan,
    FullSumExchange,
    GradBuckets,
    SignExchange,
)
from dpq.fallback_p2p import LocalCommunicator  # noqa: E402
from dpq.mirror import ReplicaSet  # noqa: E402
from dpq.streams import make_lanes  # noqa: E402
from dpq.tune_loop import TuneEngine, iteration  # noqa: E402
from dpqlab.simulated_link import SimulatedLink  # noqa: E402

TUNED = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


@dataclass
class Case:
    """A tiny Llama decoder layer, its cached inputs / kwargs and fp32 reference outputs."""

    layer: torch.nn.Module
    inputs: list[torch.Tensor]
    others: dict
    outputs: list[torch.Tensor]
    amp: bool = True  # the lanes' forward under bf16 autocast (auto-round's CPU choice), else fp32

    @property
    def tuned_numel(self) -> int:
        params = dict(self.layer.named_parameters())
        return sum(params[n].numel() for n in TUNED)


def make_case(hidden: int = 256, intermediate: int = 512, nsamples: int = 8, seqlen: int = 128,
              heads: int = 4, kv_heads: int = 2, amp: bool = True) -> Case:
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    cfg = TinyLlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=max(512, seqlen))
    model = build_tiny_llama(cfg)
    inputs, others = capture_block_inputs(model, calibration_samples(nsamples, seqlen))
    layer = model.model.layers[0]
    for p in layer.parameters():
        p.requires_grad_(False)
    params = dict(layer.named_parameters())
    for n in TUNED:
        params[n].requires_grad_(True)
    case = Case(layer, inputs[0], others[0], [], amp)
    with torch.no_grad():
        case.outputs = [_out(layer(x, **_kwargs(case.others, [i]))) for i, x in enumerate(case.inputs)]
    return case


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _kwargs(others: dict, indices: list[int]) -> dict:
    kw = {}
    for k, v in others.items():
        if k == "cache":
            continue
        if isinstance(v, list):
            items = [v[i] for i in indices]
            kw[k] = tuple(torch.cat(parts) for parts in zip(*items, strict=True)) if isinstance(items[0], tuple) \
                else torch.cat(items)
        else:
            kw[k] = v
    return kw


def lane_loss_for(case: Case):
    def lane_loss(lane, module, indices):
        x = torch.cat([case.inputs[i] for i in indices])
        y = torch.cat([case.outputs[i] for i in indices])
        with torch.autocast(device_type=lane.device.type, dtype=torch.bfloat16, enabled=case.amp):
            out = _out(module(x, **_kwargs(case.others, indices)))
        return torch.nn.functional.mse_loss(out.float(), y)

    return lane_loss


def autoround_cpu_amp() -> bool:
    """Whether auto-round runs a CPU block under bf16 autocast here: only with AVX512-BF16 (its
    CPUID probe, ``auto_round.utils.device.CpuInfo``); otherwise in fp32. The tests' switch
    (``PYTHONPATH=tests/site_hooks DPQ_TEST_CPU_BF16=off|on``) forces it, as on another CPU."""
    from auto_round.utils.device_manager import get_ar_device

    return bool(get_ar_device("cpu").supports_bf16())


def make_optimizer(module: torch.nn.Module):
    params = dict(module.named_parameters())
    return torch.optim.SGD([params[n] for n in TUNED], lr=1e-4), None


class NoExchange:
    """T_none: nothing exchanged (the lanes drift apart; for timing only)."""

    name = "none"
    overlap = False
    exact_signs = False
    plan = ExchangePlan(overlap=False, buckets=OVERLAP_BUCKET_CAP)  # the buckets the overlapped modes use

    def __init__(self, comm) -> None:
        self.comm = comm

    def exchange(self, buckets) -> None:
        return None

    def keep_signs_apart(self) -> bool:
        return False

    def signs_apart(self, buckets) -> None:
        return None

    def during_backward(self, buckets, lanes=None):
        return _NoBackwardExchange()


class _NoBackwardExchange(contextlib.nullcontext):
    """No exchange during the backward, and no roots of its own."""

    roots = seeds = ()


def make_engine(case: Case, world: int, exchange_factory, bucket_cap: int | None = None):
    """(engine, lanes, comm) for ``world`` CPU lanes; ``exchange_factory(lanes) -> exchange``."""
    lanes = make_lanes(["cpu"] * world)
    exchange = exchange_factory(lanes)
    replicas = ReplicaSet(case.layer, lanes, TUNED)
    numel = case.outputs[0].numel()
    engine = TuneEngine(replicas, lane_loss_for(case), make_optimizer, exchange, reduction="mean",
                        sample_numel=lambda i: numel)
    if bucket_cap is not None:
        engine.buckets = GradBuckets([replicas.tuned_params(k) for k in range(world)],
                                     bucket_cap_elems=bucket_cap, lanes=lanes)
    return engine, replicas


def iterate(engine: TuneEngine, batches: list[list[int]], times: list[float] | None = None) -> None:
    for idx in batches:  # the engine's backward itself overlaps when the exchange has overlap on
        t0 = time.perf_counter()
        iteration(engine, idx)
        engine.step()
        if times is not None:
            times.append(time.perf_counter() - t0)


@contextlib.contextmanager
def timed_backward(into: list[float]):
    real = torch.autograd.backward

    def backward(*a, **k):
        t0 = time.perf_counter()
        real(*a, **k)
        into.append(time.perf_counter() - t0)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = real


def policy_class(name: str):
    return {"sign": SignExchange, "full": FullSumExchange}[name]


def planned_seconds(per_iter: float, worlds: list[int], iters: int, rounds: int, args) -> float:
    """Seconds :func:`measure_world` (and ``--breakdown``) take for ``worlds`` at ``per_iter`` seconds
    per iteration without exchange: the iterations over a simulated link also wait for it (at most
    ``--exchange-vs-backward`` x one lane's backward, which is under an iteration / W)."""
    total = 0.0
    for w in worlds:
        plain = (2 + iters) + 1 + (2 + rounds * iters)  # backward timing, the wire probe, T_none
        linked = 2 * (2 + rounds * iters) + (2 * (2 + iters * rounds) if args.breakdown else 0)
        total += per_iter * (plain + linked * (1 + args.exchange_vs_backward / w))
    return total


def seconds_per_iteration(case: Case, world: int) -> float:
    """One whole iteration (forward on every lane, the backward, the step; no exchange) after a
    warm-up one: what the run is sized by. On CPU the lanes share the cores, so it hardly depends
    on the world."""
    engine, replicas = make_engine(case, world, lambda lanes: NoExchange(LocalCommunicator(lanes)))
    batch = [list(range(len(case.inputs)))]
    times: list[float] = []
    iterate(engine, batch)
    iterate(engine, batch, times)
    replicas.close()
    return times[0]


# (iters, rounds) tried in order until the run fits the budget: the defaults first, then fewer
# iterations per round, then fewer rounds (medians over rounds x iters per mode: never below 4)
SIZES = ((4, 3), (3, 3), (2, 3), (2, 2))
MIN_SEQLEN = 256


def size_run(args, worlds: list[int], make, t0: float) -> tuple[Case, str]:
    """Measure one iteration and choose --iters / --rounds / --seqlen (those not given) so that the
    run fits ``--budget-s``: fewer iterations first (the same quantity, noisier), then, only if the
    smallest sizes do not fit, fewer tokens per sample (halved: the exchange-vs-backward ratio the
    goal is stated at is kept, the link being set from the measured backward; the CPU-only share of
    the exchange grows, see the module docstring). ``t0``: when the run started (the budget's
    clock). Returns the case and what was chosen, in words."""
    seqlen = args.seqlen or 2048
    sizes = [(args.iters or i, args.rounds or r) for i, r in SIZES] if not (args.iters and args.rounds) \
        else [(args.iters, args.rounds)]
    probes = []
    while True:
        case = make(seqlen)
        if args.budget_s <= 0:
            iters, rounds = sizes[0]
            break
        per_iter = seconds_per_iteration(case, max(worlds))
        probes.append(f"{per_iter:.2f} s at {args.nsamples} x {seqlen} tokens")
        left = args.budget_s - (time.perf_counter() - t0)
        fits = [(i, r) for i, r in dict.fromkeys(sizes) if planned_seconds(per_iter, worlds, i, r, args) <= left]
        if fits or args.seqlen or seqlen // 2 < MIN_SEQLEN:
            iters, rounds = fits[0] if fits else sizes[-1]
            break
        seqlen //= 2
    args.iters, args.rounds, args.seqlen = iters, rounds, seqlen
    if args.budget_s <= 0:
        return case, f"iters {iters}, rounds {rounds}, seqlen {seqlen} (no time budget)"
    planned = planned_seconds(per_iter, worlds, iters, rounds, args)
    return case, (f"sized to a {args.budget_s:.0f} s budget: one iteration {', '.join(probes)}; chose iters {iters}, "
                  f"rounds {rounds}, seqlen {seqlen}: ~{planned:.0f} s planned"
                  + ("" if fits else " (over budget even at the smallest sizes)"))


def measure_world(case: Case, world: int, args) -> dict:
    policy = policy_class(args.policy)
    nb = max(1, args.buckets)
    cap = -(-case.tuned_numel // nb)
    batches = [list(range(len(case.inputs)))] * args.iters

    # 1. one lane's backward time, with no exchange
    bw_times: list[float] = []
    engine, replicas = make_engine(case, world, lambda lanes: NoExchange(LocalCommunicator(lanes)), cap)
    iterate(engine, batches[:2])
    with timed_backward(bw_times):
        iterate(engine, batches)
    replicas.close()
    backward_lane = statistics.median(bw_times) / world

    # 2. wire bytes and collectives of one iteration's exchange (an infinitely fast link)
    probe_link = SimulatedLink(LocalCommunicator(make_lanes(["cpu"] * world)), bandwidth_GBps=1e9)
    after = ExchangePlan.overlapped(policy.name, False)
    engine, replicas = make_engine(case, world, lambda lanes: policy(probe_link, after), cap)
    iterate(engine, batches[:1])
    wire, collectives = probe_link.wire_bytes, probe_link.collectives
    replicas.close()
    probe_link.close()
    latency = args.latency_us * 1e-6
    target = args.exchange_vs_backward * backward_lane
    bandwidth = wire / max(target - collectives * latency, 1e-6) / 1e9

    # 3. the three modes, interleaved
    links = []

    def link_factory(overlap):
        def make(lanes):
            link = SimulatedLink(LocalCommunicator(lanes), bandwidth_GBps=bandwidth, latency_s=latency)
            links.append(link)
            return policy(link, ExchangePlan.overlapped(policy.name, overlap))
        return make

    modes = {
        "none": make_engine(case, world, lambda lanes: NoExchange(LocalCommunicator(lanes)), cap),
        "after": make_engine(case, world, link_factory(False), cap),
        "overlap": make_engine(case, world, link_factory(True), cap),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for engine, _ in modes.values():  # warm-up
        iterate(engine, batches[:2])
    for _ in range(args.rounds):
        for m, (engine, _) in modes.items():
            iterate(engine, batches, times[m])
    for _, replicas in modes.values():
        replicas.close()
    for link in links:
        link.close()
    t = {m: statistics.median(v) for m, v in times.items()}
    fraction, failed = hidden_fraction(t["none"], t["after"], t["overlap"])
    return {
        "world": world,
        "bucket_cap": cap,
        "buckets": len(modes["after"][0].buckets.bucket_ranges),
        "tuned_numel": case.tuned_numel,
        "wire_bytes_per_iter": wire,
        "collectives_per_iter": collectives,
        "backward_lane_s": backward_lane,
        "link_s_per_iter": collectives * latency + wire / (bandwidth * 1e9),
        "link_GBps": bandwidth,
        "latency_s": latency,
        "T_none": t["none"],
        "T_after": t["after"],
        "T_overlap": t["overlap"],
        "hidden_fraction": fraction,
        "hidden_failed": failed,
    }


def _shown(row: dict) -> str:
    """A row's hidden fraction as the table says it: the number, or 'failed' where the timings contradict."""
    return "failed" if row["hidden_failed"].startswith("failed") else f"{row['hidden_fraction']:.2f}"


def hidden_fraction(t_none: float, t_after: float, t_overlap: float) -> tuple[float, str]:
    """(1 - (T_overlap - T_none) / (T_after - T_none), "") where that is a measurement; else (nan, why).
    A fraction of the exchange hidden lies in [0, 1]: outside it the timings contradict each other
    (an overlapped iteration faster than one with no exchange at all, or slower than the exchange
    after the backward), which on a CPU means other work moved them more than the exchange did."""
    exposed_after, exposed_overlap = t_after - t_none, t_overlap - t_none
    if exposed_after <= 0:
        return float("nan"), (f"undefined: the exchange added nothing measurable after the backward (T_after "
                              f"{t_after * 1e3:.1f} ms <= T_none {t_none * 1e3:.1f} ms)")
    fraction = 1.0 - exposed_overlap / exposed_after
    if exposed_overlap < 0:
        return float("nan"), (f"failed: T_overlap {t_overlap * 1e3:.1f} ms < T_none {t_none * 1e3:.1f} ms, faster "
                              "than no exchange at all (timing noise larger than the exchange: a loaded machine; "
                              "rerun quiet, or with more --rounds)")
    if fraction < 0:
        return float("nan"), (f"failed: T_overlap {t_overlap * 1e3:.1f} ms > T_after {t_after * 1e3:.1f} ms, slower "
                              "than the exchange after the backward (timing noise, or overlap costing more than it "
                              "hides at this size; rerun quiet, or with more --rounds)")
    return fraction, ""


SIGN_STEPS = {"update_owned": "pack_signs", "gather": "gather"}  # the sign exchange's steps --breakdown times


class Breakdown(phases.Observer):
    """Per-iteration host and wait times of one engine, measured where they run (``--breakdown``), from the
    runtime's observer events (Note [observers, not patches] in ``dpq.engine.phases``): each bucket's
    exchange (``exchange_begin``/``_end``: its whole host work) and its steps (the sign path's pack is
    its ``update_owned`` step, its unpack the ``gather`` step less the all-gather's call), the overlap's
    gradient hooks (``gradient_hook_begin``/``_end``: their bookkeeping = hook time minus the buckets
    they issue; each lane's last hook ends that lane's backward on CPU, autograd running the lanes one
    after another, last lane first) and phase ``exchange wait`` (the step's wait for the link). The
    collectives' calls on the link (the real sums / copies plus the link's bookkeeping) are timed by
    :class:`TimedLink`, ``torch.autograd.backward`` by wrapping torch's while :meth:`watching`."""

    PARTS = ("reduce_scatter", "all_gather", "all_reduce", "pack_signs", "unpack_signs")

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.lane_last: dict[int, float] = {}
        self.lane_spans: dict[int, list[float]] = {}
        self.backward_start = 0.0
        self._began: dict[str, float] = {}

    def add(self, key: str, dt: float) -> None:
        self.t[key] = self.t.get(key, 0.0) + dt

    @contextlib.contextmanager
    def timing(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t0)

    def _begin(self, key: str) -> None:
        self._began[key] = time.perf_counter()

    def _end(self, key: str) -> float:
        t1 = time.perf_counter()
        self.add(key, t1 - self._began.pop(key))
        return t1

    def exchange_begin(self, policy, bucket, numel):
        self._begin("exchange host")

    def exchange_end(self, policy, bucket, numel, error):
        self._end("exchange host")

    def exchange_step_begin(self, policy, bucket, step):
        if isinstance(policy, SignExchange) and step in SIGN_STEPS:
            self._begin(SIGN_STEPS[step])

    def exchange_step_end(self, policy, bucket, step, error):
        if isinstance(policy, SignExchange) and step in SIGN_STEPS:
            self._end(SIGN_STEPS[step])

    def gradient_hook_begin(self, exchange, lane, param):
        self._begin("hooks")

    def gradient_hook_end(self, exchange, lane, param, error):
        self.lane_last[lane] = self._end("hooks")

    def phase_begin(self, name, owner, lane):
        if name == "exchange wait":
            self._begin("link wait at step")

    def phase_end(self, name, owner, lane, error):
        if name == "exchange wait":
            self._end("link wait at step")

    @contextlib.contextmanager
    def watching(self):
        """The events observed and torch's ``autograd.backward`` timed, while entered (the times so far dropped)."""
        self.t.clear()
        real_backward = torch.autograd.backward

        def backward(*a, **k):
            self.backward_start = time.perf_counter()
            real_backward(*a, **k)
            self.add("backward call", time.perf_counter() - self.backward_start)

        torch.autograd.backward = backward
        try:
            with phases.observing(self):
                yield
        finally:
            torch.autograd.backward = real_backward

    def unpack_seconds(self) -> float:
        """The sign path's unpack (and the copy of its signs to where they go): its gather steps less their
        all-gathers."""
        return self.t.get("gather", 0.0) - self.t.get("all_gather", 0.0) if "gather" in self.t else 0.0

    def iteration(self, engine: TuneEngine, idx: list[int]) -> None:
        self.lane_last.clear()
        t0 = time.perf_counter()
        iteration(engine, idx)
        engine.step()
        self.add("iteration", time.perf_counter() - t0)
        prev = self.backward_start  # lane k's backward: from the previous lane's last hook to its own
        for k in sorted(self.lane_last, reverse=True):
            self.lane_spans.setdefault(k, []).append(self.lane_last[k] - prev)
            prev = self.lane_last[k]


class TimedLink(SimulatedLink):
    """The simulated link, each collective's call timed into ``breakdown`` (under the collective's name)."""

    def __init__(self, inner, breakdown: Breakdown, **kw) -> None:
        super().__init__(inner, **kw)
        self.breakdown = breakdown

    def all_reduce(self, bufs) -> None:
        with self.breakdown.timing("all_reduce"):
            super().all_reduce(bufs)

    def reduce_scatter(self, send, recv) -> None:
        with self.breakdown.timing("reduce_scatter"):
            super().reduce_scatter(send, recv)

    def all_gather(self, send, recv) -> None:
        with self.breakdown.timing("all_gather"):
            super().all_gather(send, recv)


def breakdown(case: Case, world: int, args, row: dict, cap: int) -> list[str]:
    """Markdown rows: per-iteration times of the after and overlapped engines at the row's link."""
    policy = policy_class(args.policy)
    batch = list(range(len(case.inputs)))
    out = []
    for overlap in (False, True):
        link = None
        bd = Breakdown()

        def make(lanes, overlap=overlap, bd=bd):
            nonlocal link
            link = TimedLink(LocalCommunicator(lanes), bd, bandwidth_GBps=row["link_GBps"], latency_s=row["latency_s"])
            return policy(link, ExchangePlan.overlapped(policy.name, overlap))

        engine, replicas = make_engine(case, world, make, cap)
        iterate(engine, [batch] * 2)
        with bd.watching():
            for _ in range(args.iters * args.rounds):
                bd.iteration(engine, batch)
        replicas.close()
        link.close()
        n = args.iters * args.rounds
        ms = {k: v / n * 1e3 for k, v in bd.t.items()}
        ms["unpack_signs"] = bd.unpack_seconds() / n * 1e3
        parts = [f"{ms.get(p, 0.0):.2f}" for p in Breakdown.PARTS]
        sign_parts = ms.get("pack_signs", 0.0) + ms.get("unpack_signs", 0.0)
        rest = ms.get("exchange host", 0.0) - sum(ms.get(p, 0.0) for p in Breakdown.PARTS[:3]) - sign_parts
        spans = " / ".join(f"{statistics.median(v) * 1e3:.1f}" for _, v in sorted(bd.lane_spans.items(),
                                                                                    reverse=True)) or "-"
        hooks = ms.get("hooks", 0.0) - (ms.get("exchange host", 0.0) if overlap else 0.0)
        # The parts the exchange adds on the issuing thread: its host work, the hooks, the step's wait.
        # Not the whole exposed time (cache effects on the backward, the timer thread are not in it).
        row[f"direct_{'overlap' if overlap else 'after'}_ms"] = \
            ms.get("exchange host", 0.0) + hooks + ms.get("link wait at step", 0.0)
        out.append(f"| {world} | {'overlap' if overlap else 'after'} | {ms['iteration']:.1f} "
                   f"| {ms.get('backward call', 0.0):.1f} | {spans} | {ms.get('exchange host', 0.0):.2f} "
                   f"| {' | '.join(parts)} | {rest:.2f} | {hooks:.2f} | {ms.get('link wait at step', 0.0):.2f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--policy", choices=["sign", "full"], default="sign")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--nsamples", type=int, default=8, help="samples per iteration (the global batch)")
    p.add_argument("--seqlen", type=int, default=None,
                   help="tokens per sample (default 2048: auto-round's default seqlen; with --nsamples 8, its "
                        "default batch of 8 x 2048 tokens; halved while the run does not fit --budget-s)")
    p.add_argument("--buckets", type=int, default=8, help="bucket cap = tuned values / this (default 8)")
    p.add_argument("--iters", type=int, default=None, help="iterations per mode per round (default 4, fewer to "
                                                            "fit --budget-s)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (2 to fit --budget-s)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="time budget of the run from its start (default 270: the default run within 5 minutes on a "
                        "2-core CPU, interpreter start included); one iteration is timed first and the sizes not "
                        "given are chosen to fit; 0: no budget (the defaults)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the lanes' forward under bf16 autocast or in fp32; auto (default): as auto-round runs a "
                        "CPU block here (bf16 only with AVX512-BF16)")
    p.add_argument("--latency-us", type=float, default=20.0, help="per-collective link latency (default 20 us)")
    p.add_argument("--exchange-vs-backward", type=float, default=1.0,
                   help="link time of one iteration's exchange / one lane's backward time (default 1.0)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each part of an iteration (after and overlapped engines, --iters x --rounds "
                        "iterations each, at the measured link): where the exposed time goes")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    amp = autoround_cpu_amp() if args.amp == "auto" else args.amp == "bf16"
    worlds = [int(w) for w in args.worlds.split(",")]

    def make(seqlen: int) -> Case:
        torch.manual_seed(0)
        return make_case(args.hidden, args.intermediate, args.nsamples, seqlen, amp=amp)

    case, sizing = size_run(args, worlds, make, t0)
    print(f"{'bf16 autocast' if amp else 'fp32'} forward ({args.amp}); {sizing}", flush=True)
    from benchmarks.report import _busy_cpu_seconds, _cpu_model

    wall0, mine0, busy0 = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
    rows = [measure_world(case, w, args) for w in worlds]
    busy1 = _busy_cpu_seconds()
    others = None
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (time.process_time() - mine0)) / \
            ((time.perf_counter() - wall0) * (os.cpu_count() or 1))
    print(f"{_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} intra-op thread(s); "
          f"tiny Llama layer hidden {args.hidden}, intermediate {args.intermediate}, {args.nsamples} x "
          f"{args.seqlen} tokens ({'bf16 autocast' if amp else 'fp32'}); {args.policy} exchange; overlap in "
          f"the engine's iteration; iters {args.iters} x rounds {args.rounds} per mode")
    print()
    print("| world | buckets | wire MB/iter | collectives | one lane's backward ms | link ms/iter | link GB/s "
          "| T_none ms | T_after ms | T_overlap ms | hidden |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['world']} | {r['buckets']} | {r['wire_bytes_per_iter'] / 1e6:.3f} | {r['collectives_per_iter']} "
              f"| {r['backward_lane_s'] * 1e3:.1f} | {r['link_s_per_iter'] * 1e3:.1f} | {r['link_GBps']:.4f} "
              f"| {r['T_none'] * 1e3:.1f} | {r['T_after'] * 1e3:.1f} | {r['T_overlap'] * 1e3:.1f} "
              f"| {_shown(r)} |")
    if args.breakdown:
        print("\nms per iteration (mean); lane backward: from the previous lane's last gradient hook to its own, "
              "last lane first (lane 0's includes the exchange host work its hooks issue); exchange host: every "
              "bucket's exchange on the issuing thread, of which the collectives' calls (the real sums and copies "
              "and the link's bookkeeping), pack and unpack (sign path: its update-owned step, and its gather step "
              "less the all-gather, the signs' copy to the grads included) and the rest (padding, views); hooks: "
              "their own bookkeeping; link wait: the step's wait for the last collective\n")
        print("| world | mode | iteration | backward call | lane backward W-1 .. 0 | exchange host | reduce_scatter "
              "| all_gather | all_reduce | pack | unpack | rest | hooks | link wait at step |")
        print("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            for line in breakdown(case, r["world"], args, r, r["bucket_cap"]):
                print(line)
        print("\nAdded by the exchange, counted directly (exchange host + hooks + link wait at step), a check on "
              "the timing differences that is less sensitive to other processes:")
        for r in rows:
            after, over = r["direct_after_ms"], r["direct_overlap_ms"]
            print(f"world {r['world']}: after {after:.1f} ms, overlapped {over:.1f} ms per iteration: "
                  f"1 - overlapped / after = {1 - over / after if after > 0 else float('nan'):.2f}")
    if others is not None:
        print(f"\nother processes used {others:.0%} of the machine's CPU during this run")
    # nan where no fraction was measured (hidden_fraction: undefined, or timings that contradict each
    # other): said why, never the worst of the measured ones
    for r in rows:
        if r["hidden_failed"]:
            print(f"world {r['world']}: hidden fraction {r['hidden_failed']}")
    defined = [r for r in rows if r["hidden_fraction"] == r["hidden_fraction"]]
    worst = min(defined or rows, key=lambda r: r["hidden_fraction"])
    print(f"hidden_fraction={worst['hidden_fraction']:.2f} world={worst['world']} link_GBps={worst['link_GBps']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
