"""The replay: a record (:mod:`dpq.testing.timeline.record`) timed with CUDA's semantics on a GPU class.

Semantics (what :func:`simulate` holds to): each host thread issues its ops in record order, each
op costing the host what :class:`dpq.testing.timeline.devices.HostCosts` says for its kind; ops that
hold Python's GIL (everything the issuing thread does, and the compiled backward's Python on
autograd's device threads) take it in turn, autograd's C++ nodes do not; a kernel starts when its
stream is free, its issuing thread has issued it and every op it waits for has ended; members of a
collective group end together, ``latency + wire bytes / link`` after the last one started; a sync
stalls the host until the op it waits for has ended. Durations: a matmul's FLOPs at the class's GEMM
rate, attention's at its attention rate, anything else by its bytes at the memory bandwidth, each
at least the kernel floor; copies by bytes over their link. Sizes are the target block's
(:class:`dpq.testing.timeline.shapes.RoleMap`), the exchange laid out per target bucket
(:mod:`dpq.testing.timeline.buckets`).

Not modelled: kernel concurrency limits on one device, copy-engine and link contention, the
caching allocator, NCCL's internal channels, CUDA graphs, clocks and temperature.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dpq.testing.timeline.buckets import expand, target_buckets
from dpq.testing.timeline.devices import GpuClass, HostCosts
from dpq.testing.timeline.record import Op, TimelineModel
from dpq.testing.timeline.shapes import BlockShape, RoleMap

__all__ = ["BREAKDOWN", "IterationSummary", "Pricing", "Sync", "Timeline", "op_class", "simulate"]

# The classes of an iteration's device time a row of the table breaks down (op_class)
BREAKDOWN = ("matmul", "attention", "qdq_forward", "qdq_backward", "activations", "grads", "step",
             "exchange_kernels", "copies", "readback")


@dataclass
class Pricing:
    """What a record is replayed as: the target block, the GPU class and the host."""

    recorded: BlockShape
    target: BlockShape
    gpu: GpuClass
    host: HostCosts
    roles: RoleMap = field(init=False)

    def __post_init__(self) -> None:
        self.roles = RoleMap(self.recorded, self.target)

    def scaled_bytes(self, op: Op) -> float:
        if op.fixed_scale is not None:
            return sum(b for _, b, _ in op.tensors) * op.fixed_scale
        return self.roles.scaled_bytes(op.tensors)

    def flops(self, op: Op) -> float:
        if op.work == "matmul":
            return op.flops * self.roles.matmul_scale(op.tensors)
        if op.work == "attention":
            return op.flops * self.roles.attention_scale()
        return 0.0

    def device_s(self, op: Op) -> float:
        gpu = self.gpu
        if op.kind == "kernel":
            if op.work == "matmul":
                compute = self.flops(op) / gpu.matmul_flops
            elif op.work == "attention":
                compute = self.flops(op) / gpu.attention_flops
            else:
                compute = 0.0
            return gpu.kernel_floor_s + max(compute, self.scaled_bytes(op) / gpu.mem_bw)
        if op.kind == "copy":
            bw = gpu.d2d if op.link == "d2d" else gpu.h2d
            return gpu.copy_latency_s + self.scaled_bytes(op) / bw
        if op.kind == "collective":
            return gpu.link_latency_s + self.wire_bytes(op) / gpu.link
        return 0.0

    def wire_bytes(self, op: Op) -> float:
        first = op.tensors[:1]
        if op.fixed_scale is not None:
            return sum(b for _, b, _ in first) * op.fixed_scale * op.wire_factor
        return self.roles.scaled_bytes(first) * op.wire_factor

    def host_s(self, op: Op) -> float:
        host = self.host
        if op.kind == "wait":
            return host.wait_s
        if op.kind == "call":
            return host.region_call_s
        if op.kind == "host":
            return host.eager_op_s + self.scaled_bytes(op) / host.host_copy_bw
        if op.kind == "kernel" and op.region:
            return host.compiled_extern_s if op.work != "elementwise" else host.compiled_kernel_s
        if op.kind in ("kernel", "copy", "collective"):
            return host.eager_op_s
        return 0.0


def op_class(op: Op) -> str | None:
    """Which part of an iteration a device op is (BREAKDOWN), None for what is not device work."""
    if op.kind == "copy":
        return "readback" if op.phase == "readback" else "copies"
    if op.kind == "collective":
        return "exchange"
    if op.kind != "kernel":
        return None
    if op.phase == "readback":
        return "readback"
    if op.work in ("matmul", "attention"):
        return op.work
    if op.phase == "exchange" or op.bucket is not None:
        return "exchange_kernels"
    if op.phase in ("step", "grads"):
        return op.phase
    if any(lead for _, _, lead in op.tensors):
        return "activations"
    if op.phase == "forward":
        return "qdq_forward"
    if op.phase == "backward":
        return "qdq_backward"
    return "step"


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
    lane0: dict[str, float]  # lane 0's device seconds per BREAKDOWN class
    wire_s: float  # lane 0's collectives, each from its start to its end
    exposed_exchange_s: float  # of the iteration, the time collectives run while no lane computes


@dataclass
class Timeline:
    """The replay: per-op (issue, start, end) times and the per-iteration summaries."""

    ops: list[Op]
    issue: dict[int, float]
    start: dict[int, float]
    end: dict[int, float]
    iterations: list[IterationSummary]
    lane_streams: list[set[int]]
    pricing: Pricing
    buckets: list[int] | None

    def steady(self) -> list[IterationSummary]:
        """The iterations after the first (which also brings each lane's per-block constants)."""
        return self.iterations[1:] if len(self.iterations) > 1 else self.iterations

    def seconds_per_iteration(self) -> float:
        steady = self.steady()
        return sum(it.seconds for it in steady) / len(steady)

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

    def breakdown(self) -> dict[str, float]:
        """Per steady iteration (seconds): lane 0's device time per class, the exchange's wire time
        and exposed part, the issuing thread's host time per lane-iteration, the iteration."""
        steady = self.steady()
        n, world = len(steady), len(self.lane_streams)
        out = {k: sum(it.lane0.get(k, 0.0) for it in steady) / n for k in BREAKDOWN}
        out["exchange_wire"] = sum(it.wire_s for it in steady) / n
        out["exchange_exposed"] = sum(it.exposed_exchange_s for it in steady) / n
        out["host_per_lane_iteration"] = sum(it.issue_s for it in steady) / n / world
        out["iteration"] = self.seconds_per_iteration()
        return out


def simulate(model: TimelineModel, pricing: Pricing) -> Timeline:
    """Replay the record with CUDA's semantics (module docstring) as ``pricing`` says."""
    buckets = target_buckets(model.bucket_layout, pricing.roles)
    ops = expand(model.ops, buckets)
    host: dict[str, float] = defaultdict(float)
    gil_free = 0.0
    issue: dict[int, float] = {}
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    stream_end: dict[int, float] = defaultdict(float)
    pending: dict[int, list[tuple[Op, float]]] = defaultdict(list)
    bw_begin = None
    bw_threads: set[str] = set()
    syncs: list[Sync] = []
    last_op_since_sync = True
    for op in ops:
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
        begin = max(host[th], gil_free) if op.gil else host[th]
        host[th] = begin + pricing.host_s(op)
        if op.gil:
            gil_free = host[th]
        issue[op.id] = host[th]
        if op.kind in ("host", "call"):
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
                start[member.id], end[member.id] = r, t0 + pricing.device_s(member)
                stream_end[member.stream.sid] = end[member.id]
            continue
        start[op.id] = ready
        end[op.id] = ready + pricing.device_s(op)
        stream_end[sid] = end[op.id]  # a blocking copy's host wait is the sync op recorded after it
    lane_streams = [{lane.stream.sid} if lane.stream is not None else set() for lane in model.lanes]
    iterations = _summaries(ops, issue, start, end, syncs, lane_streams)
    return Timeline(ops, issue, start, end, iterations, lane_streams, pricing, buckets)


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merged(intervals))


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _uncovered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Time within ``intervals`` not inside ``cover``."""
    total = 0.0
    cover = _merged(cover)
    for a, b in _merged(intervals):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover)
        total += (b - a) - covered
    return total


def _summaries(ops, issue, start, end, syncs, lane_streams) -> list[IterationSummary]:
    n = max((op.iteration for op in ops), default=-1) + 1
    marks = {op.iteration: issue[op.id] for op in ops if op.kind == "marker" and op.name.startswith("iteration")}
    by_iter: dict[int, list[Op]] = defaultdict(list)
    for op in ops:
        by_iter[op.iteration].append(op)
    done = {i: max((end.get(op.id, 0.0) for op in by_iter[i]), default=0.0) for i in range(n)}
    out = []
    for i in range(n):
        it_ops = by_iter[i]
        busy, all_intervals, lane0 = [], [], defaultdict(float)
        for streams in lane_streams:
            iv = [(start[op.id], end[op.id]) for op in it_ops
                  if op.kind == "kernel" and op.stream is not None and op.stream.sid in streams and op.id in start]
            busy.append(_union(iv))
            all_intervals += iv
        lane0_streams = lane_streams[0] if lane_streams else set()
        lane0_place = next((op.stream.place for op in it_ops if op.stream is not None
                            and op.stream.sid in lane0_streams), None)
        coll = []
        for op in it_ops:
            if op.id not in start or op.stream is None:
                continue
            cls = op_class(op)
            if cls == "exchange":  # lane 0's collectives, on its stream or its communication stream
                if op.stream.place == lane0_place:
                    coll.append((start[op.id], end[op.id]))
                continue
            if cls is not None and op.stream.sid in lane0_streams:
                lane0[cls] += end[op.id] - start[op.id]
        total, union = sum(busy), _union(all_intervals)
        ideal = total - max(busy, default=0.0)
        overlap = (total - union) / ideal if ideal > 0 else 1.0
        # device time: from the previous iteration's last op to this one's (the host runs ahead of the devices)
        seconds = done[i] - (done[i - 1] if i > 0 else marks.get(0, 0.0))
        wire = sum(b - a for a, b in coll)
        out.append(IterationSummary(i, seconds, [s for s in syncs if s.iteration == i], busy, overlap,
                                    _main_issue(it_ops, issue, end), dict(lane0), wire,
                                    _uncovered(coll, all_intervals)))
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
