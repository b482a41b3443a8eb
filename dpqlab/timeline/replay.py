"""The replay: a record (:mod:`dpqlab.timeline.record`) timed with CUDA's semantics on a GPU class.

Semantics (what :func:`simulate` holds to): each host thread issues its ops in record order, each
op costing the host what :class:`dpqlab.timeline.devices.HostCosts` says for its kind; ops that
hold Python's GIL (everything the issuing thread does, and the compiled backward's Python on
autograd's device threads) take it in turn, autograd's C++ nodes do not; a kernel starts when its
stream is free, its issuing thread has issued it, every op it waits for has ended and its device
runs no other kernel (the block's kernels each fill the GPU, so two streams' kernels share it rather
than run side by side: a kernel takes the earliest gap the device's others leave); collectives
(NCCL's few channels) and copies (the copy engines) run beside kernels; members of a collective group
end together, ``latency + wire bytes / link`` after the last one started; a sync stalls the host until
the op it waits for has ended. Durations: a matmul's FLOPs at the class's GEMM
rate, attention's at its attention rate, anything else by its bytes at the memory bandwidth, each
at least the kernel floor; copies by bytes over their link. Sizes are the target block's
(:class:`dpqlab.timeline.shapes.RoleMap`), the exchange laid out per target bucket
(:mod:`dpqlab.timeline.buckets`).

CUDA graphs are priced, not recorded (``Pricing.graphs``; no CPU run can capture one): ``"regions"``
replays every compiled region as a graph through torch.compile's CUDA graph trees (what
``mode="reduce-overhead"`` does): a region call costs the host its call, the trees' checks and one
graph launch, and its kernels none; ``"iteration"`` replays each lane's whole steady iteration but the
loss readback as one captured graph (a design, dpq does not build it): the host pays one launch and two
small copies (the sample indices and the learning rate into the graph's static buffers) per
lane-iteration, and nothing else until the readback. Either way every kernel keeps its device time.

NCCL's kernels take SMs (Note [NCCL takes SMs]): a kernel that runs while one of its device's NCCL
kernels does is longer by ``GpuClass.nccl_sm_share`` of the overlap.

Not modelled: a small kernel sharing the GPU with a large one, copy-engine and link contention, the
caching allocator, a graph's own capture and its memory, clocks and temperature.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

from dpq.engine.exchange import Buckets
from dpqlab.timeline.buckets import expand, target_buckets
from dpqlab.timeline.devices import GpuClass, HostCosts
from dpqlab.timeline.record import Op, TimelineModel
from dpqlab.timeline.shapes import BlockShape, RoleMap

__all__ = ["BREAKDOWN", "GRAPHS", "IterationSummary", "Pricing", "Sync", "Timeline", "op_class", "simulate"]

# The classes of an iteration's device time a row of the table breaks down (op_class)
BREAKDOWN = ("matmul", "attention", "qdq_forward", "qdq_backward", "activations", "grads", "step",
             "exchange_kernels", "copies", "readback")


GRAPHS = (None, "regions", "iteration")  # Pricing.graphs


@dataclass
class Pricing:
    """What a record is replayed as: the target block, the GPU class and the host."""

    recorded: BlockShape
    target: BlockShape
    gpu: GpuClass
    host: HostCosts
    # the target's gradient buckets where the record exchanged after the backward in one bucket: None as
    # recorded, "largest" where the plan would not find the memory for one bucket on the target's card
    # (Note [one bucket where it fits] in dpq.planning.plan; benchmarks/timeline.py decides it per card and world)
    buckets: str | None = None
    # CUDA graphs (module docstring): None as recorded, "regions" (compiled regions through CUDA graph
    # trees) or "iteration" (each lane's steady iteration as one captured graph; a design, not built)
    graphs: str | None = None
    # torchrun's P processes x L lanes (Note [P processes x 1 lane]): each process's lanes' ops issued by
    # threads of its own, each process with its own GIL; 1: one process issues every lane (as recorded)
    processes: int = 1
    roles: RoleMap = field(init=False)

    def __post_init__(self) -> None:
        if self.graphs not in GRAPHS:
            raise ValueError(f"graphs={self.graphs!r}: one of {GRAPHS}")
        self.roles = RoleMap(self.recorded, self.target)

    def scaled_bytes(self, op: Op) -> float:
        if op.fixed_scale is not None:
            return _fixed(op.tensors, op.fixed_scale)
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
            return _fixed(first, op.fixed_scale) * op.wire_factor
        return self.roles.scaled_bytes(first) * op.wire_factor

    def host_s(self, op: Op) -> float:
        host = self.host
        if op.kind == "wait":
            return host.wait_s
        if op.kind == "call":  # a compiled region's graph call; replayed through CUDA graph trees, also their
            # checks and one launch, its kernels none (below)
            graphed = host.graph_tree_s + host.graph_launch_s if self.graphs == "regions" else 0.0
            return host.region_call_s + graphed
        if op.kind == "host":
            return host.eager_op_s + self.scaled_bytes(op) / host.host_copy_bw
        if op.kind == "view":
            return host.view_op_s
        if op.kind == "nccl_call":
            return host.nccl_call_s
        if op.kind == "kernel" and op.region:
            if self.graphs == "regions":
                return 0.0
            return host.compiled_extern_s if op.work != "elementwise" else host.compiled_kernel_s
        if op.kind in ("kernel", "copy", "collective"):
            return host.eager_op_s
        return 0.0


def _fixed(tensors, scale: float) -> float:
    """Bytes of a target bucket's copy of an exchange op: every tensor scaled alike, constants not."""
    return sum(b * (1.0 if lead < 0 else scale) for _, b, lead in tensors)


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
    buckets: list[int] | None  # the target's buckets' element counts

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
    """Replay the record with CUDA's semantics (module docstring) as ``pricing`` says.

    The host issues in record order; the devices run what was issued in time order (an event-driven
    pass: the earliest op that can start goes first, one kernel at a time per device). The host waits
    at a sync for a device op, and the devices wait for the host's issue, so the two passes repeat
    until every sync's wait stays put."""
    layout = model.bucket_layout
    if pricing.buckets == "largest" and layout is not None and layout[1] is Buckets.BLOCK:
        layout = (layout[0], Buckets.LARGEST)  # dpq.engine.exchange.bucket_cap: as large as the largest tensor
    buckets = target_buckets(layout, pricing.roles)
    ops = expand(model.ops, buckets)
    device_ops = [op for op in ops if op.stream is not None and op.kind in ("kernel", "copy", "collective", "wait")]
    duration = {op.id: pricing.device_s(op) for op in device_ops}
    host_cost = {op.id: pricing.host_s(op) for op in ops}
    if pricing.graphs == "iteration":
        host_cost = _iterations_graphed(ops, host_cost, pricing.host, model)
    threads = (_process_threads(ops, model, pricing.processes) if pricing.processes > 1
               else {op.id: op.thread for op in ops})
    end: dict[int, float] = {}
    waits: list[float] | None = None
    for _ in range(12):
        issue, host_end, syncs, waited = _host_pass(ops, host_cost, end, threads)
        start, end = _device_pass(device_ops, issue, duration, pricing.gpu.nccl_sm_share)
        if waits is not None and all(abs(a - b) <= 1e-12 for a, b in zip(waits, waited, strict=True)):
            break
        waits = waited
    end = {**host_end, **end}
    lane_streams = [{lane.stream.sid} if lane.stream is not None else set() for lane in model.lanes]
    iterations = _summaries(ops, issue, start, end, syncs, lane_streams, threads,
                            host_cost if pricing.processes > 1 else None)
    return Timeline(ops, issue, start, end, iterations, lane_streams, pricing,
                    None if buckets is None else [b.numel for b in buckets])


def _iterations_graphed(ops: list[Op], cost: dict[int, float], host: HostCosts,
                        model: TimelineModel) -> dict[int, float]:
    """Host costs with each lane's steady iteration (every iteration after the first, which stages
    the block's data) replayed as one captured graph up to the loss readback: per lane-iteration one
    launch and two small copies into the graph's static buffers (sample indices, learning rate), on
    the first op the lane's device runs that iteration; every other op of the iteration on any
    thread is in a graph, but the readback's and the syncs."""
    places = {lane.stream.place for lane in model.lanes if lane.stream is not None}
    out = dict(cost)
    launched: set[tuple[int, int]] = set()
    for op in ops:
        if op.iteration < 1 or op.phase == "readback" or op.kind in ("sync", "marker"):
            continue
        place = op.stream.place if op.stream is not None else None
        if place in places and (op.iteration, place) not in launched:
            launched.add((op.iteration, place))
            out[op.id] = host.graph_launch_s + 2 * host.eager_op_s
        else:
            out[op.id] = 0.0
    return out


def _process_threads(ops: list[Op], model: TimelineModel, processes: int) -> dict[int, str]:
    """Note [P processes x 1 lane]: under torchrun with one lane per process, each process issues its own
    lane's ops on its own main thread (and autograd's thread for its device), under its own GIL. The
    record is one process issuing every lane, so each op goes to the process of its lane: a device op's
    by its stream's device, an autograd thread's by its device, a sync by the op it waits for, and a
    host-only op (a view, a graph call, a host call into NCCL) to the lane of the next device op its
    thread issues (the op it prepares), else the one before. Thread names get ``#k`` (process k).
    What one process does for every lane at once (the readback's host work) goes to one of them: a
    slight undercount of each process's own copy of it; the exchange is the recorded communicator's (one
    process's), not the process group's. With ``processes`` < lanes, process k has lanes k*L .. k*L+L-1."""
    lane_of_place = {lane.stream.place: k for k, lane in enumerate(model.lanes) if lane.stream is not None}
    by_id = {op.id: op for op in ops}

    def lane_of(op: Op) -> int | None:
        if op.stream is not None:
            return lane_of_place.get(op.stream.place)
        if op.thread.startswith("autograd dev"):
            return lane_of_place.get(int(op.thread.removeprefix("autograd dev")))
        if op.kind == "sync" and op.wait_for is not None and op.wait_for in by_id:
            target = by_id[op.wait_for]
            return lane_of_place.get(target.stream.place) if target.stream is not None else None
        return None

    known = {op.id: lane_of(op) for op in ops}
    following: dict[str, int | None] = {}
    for op in reversed(ops):  # a host-only op: the lane of the next device op of its thread
        if known[op.id] is None:
            known[op.id] = following.get(op.thread)
        else:
            following[op.thread] = known[op.id]
    before: dict[str, int] = {}
    out = {}
    for op in ops:
        lane = known[op.id] if known[op.id] is not None else before.get(op.thread, 0)
        before[op.thread] = lane
        out[op.id] = f"{op.thread}#{lane * processes // max(1, len(model.lanes))}"
    return out


def _process(thread: str) -> str:
    """The process a thread key belongs to ("" where one process issues every lane)."""
    return thread.partition("#")[2]


def _host_pass(ops: list[Op], cost: dict[int, float], device_end: dict[int, float], threads: dict[int, str]):
    """Every op's issue time, host ops' ends, the sync points and what each waited for, with the
    devices' end times of the last device pass (none yet: no host wait). ``threads``: each op's issuing
    thread (``name#k`` for process k's under Note [P processes x 1 lane]); every process has its own GIL
    and its own ``main``, each joined at a backward's end by its own autograd threads."""
    host: dict[str, float] = defaultdict(float)
    gils: dict[str, Busy] = defaultdict(Busy)  # Python's GIL per process: one holder at a time
    issue: dict[int, float] = {}
    host_end: dict[int, float] = {}
    issued_end: dict[str, float] = defaultdict(float)  # per process: the latest device end of the ops issued so far
    mains = sorted({t for t in threads.values() if t.partition("#")[0] == "main"}) or ["main"]
    bw_begin: dict[str, float] | None = None
    bw_threads: set[str] = set()
    syncs: list[Sync] = []
    waited_for: list[float] = []
    last_op_since_sync = True
    for op in ops:
        th = threads[op.id]
        proc = _process(th)
        if op.kind == "marker":
            if op.name == "bw_begin":
                bw_begin, bw_threads = {_process(m): host[m] for m in mains}, set()
            elif op.name == "bw_end":
                for m in mains:
                    host[m] = max([host[m], *(host[t] for t in bw_threads if _process(t) == _process(m))])
                bw_begin = None
            issue[op.id] = host_end[op.id] = host[mains[0]]
            for m in mains:  # where each process's main stands at the boundary (_main_issue)
                host_end[(op.id, m)] = host[m]
            continue
        if not th.startswith("main") and bw_begin is not None and th not in bw_threads:
            bw_threads.add(th)
            host[th] = max(host[th], bw_begin.get(proc, 0.0))
        if op.host_after is not None:
            host[th] = max(host[th], issue.get(op.host_after, 0.0))
        if op.kind == "sync":
            waited = device_end.get(op.wait_for, 0.0) if op.wait_for is not None else issued_end[proc]
            waited_for.append(waited)
            stall = max(0.0, waited - host[th])
            if proc == _process(mains[0]):  # one process's sync points (each process has its own)
                if last_op_since_sync:
                    syncs.append(Sync(op.iteration, op.site, op.name, stall))
                elif syncs:
                    syncs[-1].stall_s += stall
                last_op_since_sync = False
            host[th] = max(host[th], waited)
            issue[op.id] = host_end[op.id] = host[th]
            continue
        if proc == _process(mains[0]):
            last_op_since_sync = True
        begin = gils[proc].place(host[th], cost[op.id]) if op.gil else host[th]
        host[th] = begin + cost[op.id]
        issue[op.id] = host[th]
        if op.kind in ("host", "call", "view", "nccl_call"):
            host_end[op.id] = host[th]
        else:
            issued_end[proc] = max(issued_end[proc], device_end.get(op.id, 0.0))
    return issue, host_end, syncs, waited_for


def _device_pass(ops: list[Op], issue: dict[int, float], duration: dict[int, float], nccl_share: float = 0.0):
    """Start and end of every device op: each stream in order, an op once issued and once every op it
    waits for ended, a collective's members together, a kernel when its device runs no other; the
    earliest op that can start goes first."""
    queues: dict[int, deque[Op]] = defaultdict(deque)
    for op in ops:
        queues[op.stream.sid].append(op)
    known = {op.id for op in ops}
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    stream_free: dict[int, float] = defaultdict(float)
    device_free: dict[int, float] = defaultdict(float)
    nccl_busy: dict[int, list[tuple[float, float]]] = defaultdict(list)  # device -> its NCCL kernels' spans
    waiting: dict[int, list[int]] = defaultdict(list)  # op -> the streams whose head waits for it
    groups: dict[int, dict[int, tuple[float, int]]] = defaultdict(dict)  # group -> member -> (ready, stream)
    # (start, ready, op, stream); a group: (start, start, -1 - group, -1). Of kernels that could start at
    # once the one ready longest goes first (a device takes pending work from its streams in turn).
    heap: list[tuple[float, float, int, int]] = []

    def consider(sid: int) -> None:
        if not queues[sid]:
            return
        op = queues[sid][0]
        missing = [d for d in op.deps if d in known and d not in end]
        if missing:
            waiting[missing[0]].append(sid)
            return
        ready = max([issue[op.id], stream_free[sid], *(end.get(d, issue.get(d, 0.0)) for d in op.deps)])
        if op.group is not None:
            members = groups[op.group]
            members[op.id] = (ready, sid)
            if len(members) == op.group_size:
                t0 = max(r for r, _ in members.values())
                heapq.heappush(heap, (t0, t0, -1 - op.group, -1))
            return
        at = max(ready, device_free[op.stream.place]) if op.kind == "kernel" else ready
        heapq.heappush(heap, (at, ready, op.id, sid))

    def finished(op: Op, sid: int) -> None:
        queues[sid].popleft()
        stream_free[sid] = end[op.id]
        consider(sid)
        for other in waiting.pop(op.id, []):
            consider(other)

    for sid in list(queues):
        consider(sid)
    while heap:
        at, ready, oid, sid = heapq.heappop(heap)
        if sid == -1:  # a collective group: every member ready, they end together
            members = groups.pop(-1 - oid)
            by_id = {queues[s][0].id: queues[s][0] for _, s in members.values()}
            for mid, (ready, _) in members.items():
                start[mid], end[mid] = ready, at + duration[mid]
                nccl_busy[by_id[mid].stream.place].append((ready, end[mid]))
            for mid, (_, msid) in members.items():
                finished(by_id[mid], msid)
            continue
        op = queues[sid][0]
        if op.kind == "kernel":
            if device_free[op.stream.place] > at:  # another kernel took the device meanwhile
                heapq.heappush(heap, (device_free[op.stream.place], ready, oid, sid))
                continue
            # Note [NCCL takes SMs]: while an NCCL kernel runs on the device (its channels' blocks), a
            # kernel beside it has the rest of the SMs: it runs longer by that share of the overlap
            d = duration[oid]
            if nccl_share > 0 and nccl_busy[op.stream.place]:
                d += nccl_share * sum(max(0.0, min(at + d, e) - max(at, s)) for s, e in nccl_busy[op.stream.place])
            device_free[op.stream.place] = at + d
            start[oid], end[oid] = at, at + d
            finished(op, sid)
            continue
        start[oid], end[oid] = at, at + duration[oid]
        finished(op, sid)
    return start, end


class Busy:
    """A resource one user holds at a time (the GIL, a device's SMs): its busy intervals, in time order.
    Ops arrive in record order, not in time order (autograd's threads and the lanes' streams run side
    by side), so a later op may take a gap an earlier one left."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def place(self, t: float, duration: float) -> float:
        """Book ``duration`` at the earliest time >= ``t`` the resource is free that long; its start."""
        if duration <= 0:
            return t
        i = max(0, bisect.bisect_right(self.starts, t) - 1)
        while i < len(self.starts):
            if self.ends[i] <= t:
                i += 1
                continue
            if self.starts[i] >= t + duration:
                break
            t = self.ends[i]
            i += 1
        self.starts.insert(i, t)
        self.ends.insert(i, t + duration)
        return t


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


def _summaries(ops, issue, start, end, syncs, lane_streams, threads, costs=None) -> list[IterationSummary]:
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
            # lane 0's device work on any of its streams (the exchange's on its communication stream too)
            if cls is not None and (op.stream.sid in lane0_streams or op.stream.place == lane0_place):
                lane0[cls] += end[op.id] - start[op.id]
        total, union = sum(busy), _union(all_intervals)
        ideal = total - max(busy, default=0.0)
        overlap = (total - union) / ideal if ideal > 0 else 1.0
        # device time: from the previous iteration's last op to this one's (the host runs ahead of the devices)
        seconds = done[i] - (done[i - 1] if i > 0 else marks.get(0, 0.0))
        wire = sum(b - a for a, b in coll)
        out.append(IterationSummary(i, seconds, [s for s in syncs if s.iteration == i], busy, overlap,
                                    _main_issue(it_ops, issue, end, threads, costs), dict(lane0), wire,
                                    _uncovered(coll, all_intervals)))
    return out


def _main_issue(ops, issue, end, threads, costs=None) -> float:
    """The main thread's own host time in these ops (issue costs, not the time it waited). With one
    process per lane (Note [P processes x 1 lane]; ``costs``: each op's host cost) every process's main
    thread's issue costs, summed: its GIL is its own lane's autograd thread's while the backward runs,
    a wait of the main thread (blocked in ``backward()`` then) that is not issue time."""
    if costs is not None:
        return sum(costs[op.id] for op in ops if op.thread == "main" and op.kind not in ("marker", "sync"))
    total, prev = 0.0, {}
    for op in ops:
        th = threads[op.id]
        if op.thread != "main":
            continue
        if op.kind == "marker":  # every process's main stands at the boundary
            prev.update({k[1]: v for k, v in end.items() if isinstance(k, tuple) and k[0] == op.id})
            prev[th] = end[op.id]
            continue
        if op.kind == "sync":
            prev[th] = end[op.id]
            continue
        if th in prev:
            total += max(0.0, issue[op.id] - prev[th])
        prev[th] = issue[op.id]
    return total
