"""The replay: a record (:mod:`dpq.testing.timeline.record`) timed with CUDA's semantics on a GPU class."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dpq.testing.timeline.record import Op, TimelineModel

__all__ = ["BLOCKS", "GPUS", "BlockClass", "GpuClass", "IterationSummary", "Sync", "Timeline", "simulate"]




@dataclass(frozen=True)
class BlockClass:
    """A target block: what the recorded block's sizes are scaled to."""

    name: str
    hidden: int
    intermediate: int
    kv_dim: int
    seqlen: int = 2048
    batch: int = 8  # samples per iteration

    @property
    def linear_params(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate


@dataclass(frozen=True)
class GpuClass:
    """A GPU and its links (stated figures: achievable rates, not peaks; not measured here)."""

    name: str
    flops: float  # achievable bf16 matmul FLOP/s
    mem_bw: float  # achievable memory bandwidth, B/s
    kernel_floor_s: float  # shortest kernel
    launch_s: float  # the host's launch cost per kernel (driver + PyTorch's CUDA path), added to host_per_op
    h2d: float  # pinned host<->device B/s
    d2d: float  # device-to-device copy B/s
    link: float  # collective bus bandwidth per lane, B/s
    link_latency_s: float  # per collective
    copy_latency_s: float = 10e-6


BLOCKS = {
    "70b": BlockClass("70B-class (Llama-3-70B block)", 8192, 28672, 1024),
    "32b": BlockClass("32B-class (Qwen2.5-32B block)", 5120, 27648, 1024),
    "8b": BlockClass("8B-class (Llama-3-8B block)", 4096, 14336, 1024),
}
# The figures of benchmarks/issue_cost.py's MACHINES (4 x RTX 3090 over PCIe without P2P; 8 x H100 SXM, NVLink)
GPUS = {
    "3090": GpuClass("3090-class, PCIe 4.0, no P2P", flops=25e12, mem_bw=800e9, kernel_floor_s=4e-6, launch_s=5e-6,
                     h2d=12e9, d2d=10e9, link=10e9, link_latency_s=50e-6),
    "h100": GpuClass("H100-class, NVLink", flops=400e12, mem_bw=2.8e12, kernel_floor_s=3e-6, launch_s=5e-6,
                     h2d=40e9, d2d=300e9, link=350e9, link_latency_s=20e-6),
}


@dataclass(frozen=True)
class Scale:
    """Recorded sizes -> target sizes (module docstring: durations)."""

    act: float  # activation bytes: tokens x hidden
    weight: float  # weight-shaped bytes: linear parameters
    flops: float  # matmul FLOPs: tokens x linear parameters

    @classmethod
    def between(cls, recorded: BlockClass, target: BlockClass) -> Scale:
        tokens = (target.seqlen * target.batch) / (recorded.seqlen * recorded.batch)
        params = target.linear_params / recorded.linear_params
        return cls(act=tokens * target.hidden / recorded.hidden, weight=params, flops=tokens * params)


def _scaled_bytes(op: Op, scale: Scale) -> float:
    return op.bytes * {"act": scale.act, "weight": scale.weight, "matmul": scale.act}.get(op.cls, 1.0)


def duration(op: Op, gpu: GpuClass, scale: Scale) -> float:
    if op.kind == "wait":
        return 0.0
    nbytes = _scaled_bytes(op, scale)
    if op.kind == "kernel":
        compute = op.flops * scale.flops / gpu.flops if op.cls == "matmul" else 0.0
        return gpu.kernel_floor_s + max(compute, nbytes / gpu.mem_bw)
    if op.kind == "copy":
        bw = gpu.d2d if op.link == "d2d" else gpu.h2d
        return gpu.copy_latency_s + nbytes / bw
    if op.kind == "collective":
        return gpu.link_latency_s + nbytes / gpu.link
    return 0.0


@dataclass
class Sync:
    iteration: int
    site: str
    what: str
    stall_s: float  # how long the host waited


@dataclass
class IterationSummary:
    index: int
    seconds: float  # from the previous iteration's last device op to this one's
    syncs: list[Sync]
    lane_busy_s: list[float]
    overlap: float  # (sum of lane busy - union) / (sum - max): 1 = the lanes run together, 0 = one after another
    issue_s: float  # the main thread's host time issuing ops


@dataclass
class Timeline:
    """The replay: per-op (issue, start, end) times and the per-iteration summaries."""

    ops: list[Op]
    issue: dict[int, float]
    start: dict[int, float]
    end: dict[int, float]
    iterations: list[IterationSummary]
    lane_streams: list[set[int]]
    gpu: GpuClass
    block: BlockClass
    host_per_op_s: float

    def steady(self) -> list[IterationSummary]:
        """The iterations after the first (which also brings each lane's per-block constants)."""
        return self.iterations[1:] if len(self.iterations) > 1 else self.iterations

    def syncs_per_iteration(self) -> int:
        return max((len(it.syncs) for it in self.steady()), default=0)

    def lane_overlap(self) -> float:
        steady = self.steady()
        return min(it.overlap for it in steady) if steady else 1.0

    def lanes_per_thread(self) -> float:
        """How many lanes one issuing thread keeps busy: a lane's compute per iteration over the
        main thread's host time per lane-iteration."""
        steady = self.steady()
        world = len(self.lane_streams)
        compute = sum(sum(it.lane_busy_s) / world for it in steady) / len(steady)
        issue = sum(it.issue_s / world for it in steady) / len(steady)
        return compute / issue if issue > 0 else float("inf")


def simulate(model: TimelineModel, recorded: BlockClass, target: BlockClass, gpu: GpuClass,
             host_per_op_s: float) -> Timeline:
    """Replay the record with CUDA's semantics (module docstring) on ``gpu``, sizes scaled to ``target``."""
    scale = Scale.between(recorded, target)
    host: dict[str, float] = defaultdict(float)
    issue: dict[int, float] = {}
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    stream_end: dict[int, float] = defaultdict(float)
    pending: dict[int, list[tuple[Op, float]]] = defaultdict(list)
    bw_begin = None
    bw_threads: set[str] = set()
    syncs: list[Sync] = []
    last_op_since_sync = True
    for op in model.ops:
        th = op.thread
        if op.kind == "marker":
            if op.name == "bw_begin":
                bw_begin, bw_threads = host["main"], set()
            elif op.name == "bw_end":
                host["main"] = max([host["main"], *(host[t] for t in bw_threads)])
                bw_begin = None
            issue[op.id] = end[op.id] = host["main"]
            continue
        if th != "main" and bw_begin is not None and th not in bw_threads:
            bw_threads.add(th)
            host[th] = max(host[th], bw_begin)
        if op.host_after is not None:
            host[th] = max(host[th], issue.get(op.host_after, 0.0))
        if op.kind == "sync":
            waited = end.get(op.wait_for, 0.0) if op.wait_for is not None else max(stream_end.values(), default=0.0)
            stall = max(0.0, waited - host[th])
            if last_op_since_sync:
                syncs.append(Sync(op.iteration, op.site, op.name, stall))
            elif syncs:
                syncs[-1].stall_s += stall
            host[th] = max(host[th], waited)
            issue[op.id] = end[op.id] = host[th]
            last_op_since_sync = False
            continue
        last_op_since_sync = True
        cost = host_per_op_s + (gpu.launch_s if op.kind in ("kernel", "copy", "collective") else 0.0)
        if op.kind == "wait":
            cost = host_per_op_s / 4
        if op.kind == "host":
            cost = host_per_op_s + _scaled_bytes(op, scale) / 10e9  # host memcpy-bound work
        host[th] += cost
        issue[op.id] = host[th]
        if op.kind == "host":
            end[op.id] = host[th]
            continue
        sid = op.stream.sid
        ready = max([host[th], stream_end[sid], *(end.get(d, 0.0) for d in op.deps)])
        if op.group is not None:
            pending[op.group].append((op, ready))
            stream_end[sid] = float("inf")  # nothing after it on this stream can start before the group ends
            if len(pending[op.group]) < op.group_size:
                continue
            members = pending.pop(op.group)
            t0 = max(r for _, r in members)
            for member, r in members:
                start[member.id], end[member.id] = r, t0 + duration(member, gpu, scale)
                stream_end[member.stream.sid] = end[member.id]
            continue
        start[op.id] = ready
        end[op.id] = ready + duration(op, gpu, scale)
        stream_end[sid] = end[op.id]  # a blocking copy's host wait is the sync op recorded after it
    lane_streams = [{lane.stream.sid} if lane.stream is not None else set() for lane in model.lanes]
    iterations = _summaries(model, issue, start, end, syncs, lane_streams)
    return Timeline(model.ops, issue, start, end, iterations, lane_streams, gpu, target, host_per_op_s)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _summaries(model, issue, start, end, syncs, lane_streams) -> list[IterationSummary]:
    n = max((op.iteration for op in model.ops), default=-1) + 1
    marks = {op.iteration: issue[op.id] for op in model.ops if op.kind == "marker" and op.name.startswith("iteration")}
    done = {i: max((end.get(op.id, 0.0) for op in model.ops if op.iteration == i), default=0.0) for i in range(n)}
    out = []
    for i in range(n):
        ops = [op for op in model.ops if op.iteration == i]
        busy = []
        all_intervals = []
        for streams in lane_streams:
            iv = [(start[op.id], end[op.id]) for op in ops
                  if op.kind == "kernel" and op.stream is not None and op.stream.sid in streams and op.id in start]
            busy.append(_union(iv))
            all_intervals += iv
        total, union = sum(busy), _union(all_intervals)
        ideal = total - max(busy, default=0.0)
        overlap = (total - union) / ideal if ideal > 0 else 1.0
        # device time: from the previous iteration's last op to this one's (the host runs ahead of the devices)
        seconds = done[i] - (done[i - 1] if i > 0 else marks.get(0, 0.0))
        out.append(IterationSummary(i, seconds, [s for s in syncs if s.iteration == i], busy,
                                    overlap, _main_issue(ops, issue, end)))
    return out


def _main_issue(ops, issue, end) -> float:
    """The main thread's own host time in these ops (issue costs, not the time it waited)."""
    total, prev = 0.0, None
    for op in ops:
        if op.thread != "main":
            continue
        if op.kind in ("marker", "sync"):
            prev = end[op.id]
            continue
        if prev is not None:
            total += max(0.0, issue[op.id] - prev)
        prev = issue[op.id]
    return total
