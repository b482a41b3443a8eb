"""What a torch profiler trace (Chrome trace JSON, as ``profile.export_chrome_trace`` writes it) says
about each tuning iteration: host syncs on every thread, kernel launches, the issuing thread's host
time, GPU time per phase, the GPU's busy time, and each lane's forward on the GPU. Pure functions of the trace's events,
so the verdicts built on them are unit-tested on CPU with recorded traces.

The run marks its own sections with ``torch.profiler.record_function`` (the ``MARK`` names below, on
the issuing thread): ``START`` once when the profiler starts, ``STEP`` around each optimizer step
(an iteration ends where its step ends), ``BACKWARD`` around the backward call, ``WAIT`` around dpq's
readback wait, ``FORWARD`` around each lane's forward and loss (dpq's lane loss), ``QDQ`` around each
weight quantize-dequantize (eager runs only: under torch.compile it is fused into the block's graph
and the mark would break that graph).

Which events are which (Kineto's categories): ``cuda_runtime`` and ``cuda_driver`` events are API
calls on the host, on the thread that made them, carrying a ``correlation`` id; ``kernel``,
``gpu_memcpy`` and ``gpu_memset`` events ran on the GPU, with the correlation id of the call that
launched them and their ``stream``; ``user_annotation`` events are the marks; ``cpu_op`` events are
operators, with autograd's ``Sequence number`` linking a backward op to its forward op.

Host syncs: the calls in :data:`BLOCKING` (each makes the calling thread wait for the device),
counted on every thread, and dpq's readback waits (``WAIT``: a polled ``cudaEventQuery``, not a
blocking call). Phases (GPU time of each iteration's kernels, classified in this order): ``readback``
(device-to-host copies), ``optimizer_step`` (launched inside ``STEP``), ``qdq_forward`` /
``qdq_backward`` (eager: launched inside ``QDQ``, or by a backward op whose sequence number is a
forward op's inside ``QDQ``; compiled: inductor's fused kernels whose names hold ``round``, the
rounding only the quantize-dequantize does, forward when the issuing thread launched them, else
backward: an approximation, said so in the results), ``attention`` then ``matmul`` (kernel names),
``elementwise`` (everything else: norms, activations, copies, the loss, reductions).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

MARK = "gpu_check/"
START, STEP, BACKWARD, WAIT, QDQ, FORWARD = (MARK + n for n in ("start", "step", "backward", "readback_wait", "qdq",
                                                                "lane_forward"))
HOST_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# API calls that block the calling thread until the device has done work (cudaFree and
# cudaFreeHost synchronize the device implicitly; a blocking cudaMemcpy waits for its copy)
BLOCKING = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMemcpyFromSymbol", "cudaMemset", "cudaFree", "cudaFreeHost", "cuCtxSynchronize", "cuStreamSynchronize",
    "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuMemFree_v2", "cuMemFreeHost"})
MATMUL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|wgmma|cublas|splitk|matmul|_mm_", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa", re.I)
QDQ_COMPILED = re.compile(r"triton_.*round", re.I)
PHASES = ("matmul", "attention", "qdq_forward", "qdq_backward", "elementwise", "optimizer_step", "readback")


@dataclass(frozen=True)
class Event:
    name: str
    cat: str
    tid: object
    ts: float  # microseconds
    dur: float
    args: dict

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class LaneForward:
    """One lane's forward in an iteration (the kernels launched inside its ``FORWARD`` mark, the
    k-th mark being lane k's): when the host issued it and when the GPU finished it."""

    first_launch: float
    last_launch: float
    gpu_end: float


@dataclass
class Iteration:
    start: float
    end: float
    launches: int = 0
    blocking_syncs: list[str] = field(default_factory=list)  # "<call> on thread <tid>"
    readback_waits: int = 0
    host_ms: float = 0.0  # the issuing thread's wall time not in a blocking call or dpq's readback wait
    own_ms: float = 0.0  # host_ms without the backward call (the thread waits there for autograd's threads)
    # the issuing thread's outermost aten ops outside the backward call: those that only make views, the others
    # (counted when analyze() is given a view test: the timeline model prices the two apart)
    view_ops: int = 0
    other_ops: int = 0
    phases_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    busy_ms: float = 0.0  # the GPU busy: the union of its events' intervals (lanes' kernels overlap; the phases add)
    lane_forwards: list[LaneForward] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ms": round((self.end - self.start) / 1e3, 3), "launches": self.launches,
                "blocking_syncs": self.blocking_syncs, "readback_waits": self.readback_waits,
                "host_ms": round(self.host_ms, 3), "busy_ms": round(self.busy_ms, 3),
                "phases_ms": {k: round(v, 4) for k, v in self.phases_ms.items()},
                "lane_forwards": [vars(f) for f in self.lane_forwards]}


def load(path: str | Path) -> list[Event]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``) with a duration."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return events_of(json.load(f))


def events_of(trace: dict) -> list[Event]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "ts" in e:
            out.append(Event(str(e.get("name", "")), str(e.get("cat", "")), e.get("tid"), float(e["ts"]),
                             float(e.get("dur", 0.0)), dict(e.get("args") or {})))
    return sorted(out, key=lambda e: e.ts)


def marks(events: list[Event], name: str) -> list[Event]:
    return [e for e in events if e.cat == "user_annotation" and e.name == name]


def iterations(events: list[Event]) -> list[Iteration]:
    """The profiled iterations: from the profiler's start mark (else the first event) to the end of
    the first step, then from each step's end to the next one's."""
    steps = marks(events, STEP)
    if not steps:
        return []
    start = marks(events, START)
    t = start[0].end if start else events[0].ts
    out = []
    for s in steps:
        out.append(Iteration(t, s.end))
        t = s.end
    return out


def _within(spans: list[Event], tid: object, ts: float) -> Event | None:
    """The innermost span of ``spans`` on thread ``tid`` that contains ``ts``."""
    best = None
    for s in spans:
        if s.tid == tid and s.ts <= ts <= s.end and (best is None or s.dur < best.dur):
            best = s
    return best


def classify(kernel: Event, launch: Event | None, issuing_tid: object, marks_by_name: dict[str, list[Event]],
             qdq_backward_ops: list[Event]) -> str:
    """The phase of one GPU event (the module docstring's rules, in order)."""
    if kernel.cat == "gpu_memcpy" and "dtoh" in kernel.name.lower().replace(" ", ""):
        return "readback"
    if launch is not None and _within(marks_by_name[STEP], launch.tid, launch.ts):
        return "optimizer_step"
    if launch is not None:
        if _within(marks_by_name[QDQ], launch.tid, launch.ts):
            return "qdq_forward"
        if _within(qdq_backward_ops, launch.tid, launch.ts):
            return "qdq_backward"
    if kernel.cat != "kernel":
        return "elementwise"
    if ATTENTION.search(kernel.name):  # first: cuDNN's attention kernels name their wgmma (an H200 run's trace)
        return "attention"
    if MATMUL.search(kernel.name):
        return "matmul"
    if QDQ_COMPILED.search(kernel.name):
        return "qdq_forward" if launch is None or launch.tid == issuing_tid else "qdq_backward"
    return "elementwise"


def _qdq_backward_ops(events: list[Event], qdq_marks: list[Event]) -> list[Event]:
    """Backward ops (on autograd's threads) of forward ops that ran inside a ``QDQ`` mark."""
    forward = {e.args.get("Sequence number") for e in events if e.cat == "cpu_op" and "Sequence number" in e.args
               and any(m.tid == e.tid and m.ts <= e.ts <= m.end for m in qdq_marks)}
    forward.discard(None)
    issuing = next((m.tid for m in qdq_marks), None)
    return [e for e in events if e.cat == "cpu_op" and e.tid != issuing and e.args.get("Sequence number") in forward]


def busy_us(gpu: list[Event]) -> float:
    """Microseconds of the union of the events' intervals: the time the GPU ran any of them."""
    total, end = 0.0, float("-inf")
    for e in sorted(gpu, key=lambda e: e.ts):
        if e.end > end:
            total += e.end - max(e.ts, end)
            end = e.end
    return total


def outermost(ops: list[Event]) -> list[Event]:
    """The events of one thread not inside another of them (the ops its code called, not their parts)."""
    out, end = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e.ts, -e.dur)):
        if e.ts >= end:
            out.append(e)
            end = e.end
    return out


def analyze(events: list[Event], is_view=None) -> list[Iteration]:
    """Every profiled iteration with its launches, host syncs, readback waits, host time, phases
    and lanes' forwards; with ``is_view`` (an aten op name -> whether it only makes views:
    ``dpqlab.timeline.work.is_view``) also the issuing thread's view and other ops."""
    iters = iterations(events)
    if not iters:
        return []
    by_name = {name: marks(events, name) for name in (STEP, BACKWARD, WAIT, QDQ, FORWARD)}
    issuing = by_name[STEP][0].tid
    qdq_back = _qdq_backward_ops(events, by_name[QDQ])
    host = [e for e in events if e.cat in HOST_CATS]
    launch_of = {}
    for e in host:
        corr = e.args.get("correlation")
        if corr is not None:
            launch_of.setdefault(corr, e)
    starts = [it.start for it in iters]

    def which(ts: float) -> Iteration | None:
        k = bisect.bisect_right(starts, ts) - 1
        return iters[k] if k >= 0 and ts < iters[k].end else None

    for e in host:
        it = which(e.ts)
        if it is not None and e.name in BLOCKING:
            it.blocking_syncs.append(f"{e.name} on thread {e.tid}")
    for w in by_name[WAIT]:
        it = which(w.ts)
        if it is not None:
            it.readback_waits += 1
    forwards: dict[int, LaneForward] = {}  # id(FORWARD mark) -> the lane's forward
    on_gpu: dict[int, list[Event]] = {}  # id(iteration) -> its GPU events
    for k in (e for e in events if e.cat in GPU_CATS):
        launch = launch_of.get(k.args.get("correlation"))
        it = which(launch.ts if launch is not None else k.ts)
        if it is None:
            continue
        on_gpu.setdefault(id(it), []).append(k)
        if k.cat == "kernel":
            it.launches += 1
        it.phases_ms[classify(k, launch, issuing, by_name, qdq_back)] += k.dur / 1e3
        lane = _within(by_name[FORWARD], launch.tid, launch.ts) if launch is not None and k.cat == "kernel" else None
        if lane is not None:
            f = forwards.setdefault(id(lane), LaneForward(launch.ts, launch.ts, k.end))
            f.first_launch, f.last_launch = min(f.first_launch, launch.ts), max(f.last_launch, launch.ts)
            f.gpu_end = max(f.gpu_end, k.end)
    for it in iters:
        it.busy_ms = busy_us(on_gpu.get(id(it), [])) / 1e3
        it.lane_forwards = [forwards[id(m)] for m in by_name[FORWARD]
                            if it.start <= m.ts < it.end and id(m) in forwards]
        waited = sum(e.dur for e in host if e.tid == issuing and e.name in BLOCKING and it.start <= e.ts < it.end)
        waited += sum(w.dur for w in by_name[WAIT] if it.start <= w.ts < it.end)
        it.host_ms = max(0.0, (it.end - it.start - waited) / 1e3)
        backward = sum(m.dur for m in by_name[BACKWARD] if m.tid == issuing and it.start <= m.ts < it.end)
        it.own_ms = max(0.0, it.host_ms - backward / 1e3)
    if is_view is not None:
        _count_ops(events, iters, issuing, [m for m in by_name[BACKWARD] if m.tid == issuing], is_view)
    return iters


def _count_ops(events: list[Event], iters: list[Iteration], issuing: object, backwards: list[Event], is_view) -> None:
    """Each iteration's outermost aten ops on the issuing thread outside the backward call, views and
    the rest (``aten::to`` that did nothing, no op inside it, is a view: it returned its input)."""
    ops = [e for e in events if e.tid == issuing and e.cat == "cpu_op"]
    inner = {id(e) for e in ops} - {id(e) for e in outermost(ops)}
    starts = sorted(e.ts for e in ops if id(e) in inner)
    for it in iters:
        for e in outermost(ops):
            if not (it.start <= e.ts < it.end) or not e.name.startswith("aten::") or \
                    any(b.ts <= e.ts < b.end for b in backwards):
                continue
            empty = bisect.bisect_left(starts, e.ts) == bisect.bisect_left(starts, e.end)
            if is_view(e.name) and (e.name != "aten::to" or empty):
                it.view_ops += 1
            else:
                it.other_ops += 1


def summarize(iters: list[Iteration]) -> dict:
    """Per-iteration means of what :func:`analyze` found (phases, host time, launches)."""
    if not iters:
        return {"iterations": 0}
    return {"iterations": len(iters),
            "phases_ms": {p: round(statistics.fmean(it.phases_ms[p] for it in iters), 4) for p in PHASES},
            "host_ms_per_iteration": round(statistics.fmean(it.host_ms for it in iters), 3),
            "gpu_busy_ms_per_iteration": round(statistics.fmean(it.busy_ms for it in iters), 3),
            "issuing_own_ms_per_iteration": round(statistics.fmean(it.own_ms for it in iters), 3),
            "launches_per_iteration": round(statistics.fmean(it.launches for it in iters), 1),
            "issuing_ops_per_iteration": {"views": statistics.fmean(it.view_ops for it in iters),
                                          "other": statistics.fmean(it.other_ops for it in iters)},
            "per_iteration": [it.as_dict() for it in iters]}
