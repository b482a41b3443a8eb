"""Device backends and lanes, and the stream-ordering rules every crossing between them follows.

A :class:`Lane` is one replica's device plus the stream its work is issued on.
Everything above this module asks the lane (or :func:`backend`) for streams, events,
synchronisation, free memory and peer access; nothing above it branches on the device
type. On CPU streams are no-ops, so every code path in dpq runs on a laptop, and several
lanes may share the CPU device (or one GPU: each lane then has its own stream).

Backends: cuda, xpu (torch.xpu), hpu (habana_frameworks, imported only when asked for),
cpu. Invariant kept here: a lane's stream belongs to the lane's device, and work issued
under :meth:`Lane.issue` runs on that stream, in issue order.

Stream-ordering rules (contract 4 of DESIGN.md). "Current" below is the device's current
stream where the caller stands, outside every lane's :meth:`Lane.issue` (in practice the
default stream: where auto-round caches the pool, wraps, snapshots, unwraps and packs).

R0  Lane 0 issues on the current stream. :func:`make_lanes` gives it no private stream:
    its ``stream`` *is* the current stream of its device when the lanes are made. So lane 0
    is ordered with everything the caller queues before and after the block (pool caching,
    ``wrapper_block``, the best-parameter snapshot, ``unwrapper_block``) by stream order,
    with no wait at all. Lanes 1.. get a fresh stream each.
R1  Into a lane: a lane reads anything produced outside it (wrapped parameters, the pool,
    reference outputs, optimizer state built at home) only after
    :meth:`Lane.wait_for_current`, called *before* the first op that reads it is queued
    (mirror build, ``copy_to_lane``, every sharded forward and per-item job). Before home
    writes again what a lane read from it, the current stream waits for that lane (the mirror
    build does so right after its copies: auto-round's wrappers clamp the home block's
    min/max scales in place in its forward; the teardown, R5, covers everything else).
R2  Out of a lane: before anything outside the lane reads, frees, snapshots or packs a
    lane's tensors, the current stream waits for the lane: :meth:`Lane.current_waits_for_me`
    for everything the lane queued, or :meth:`Lane.mark` + :meth:`Lane.current_waits` for
    one point of it (the per-iteration losses: the readback waits for the losses only, not
    for backward or the exchange).
R3  Memory that crosses: a tensor allocated on one stream and used on another is either
    copied after a wait, or recorded on its consumer (:meth:`Lane.record_on_current`,
    ``record_stream``), so the caching allocator does not hand its block to new work on the
    owner's stream while the consumer may still read it. :meth:`Lane.hand_home` does both
    cases: across devices it copies on the lane's stream (torch orders the destination's
    current stream after the copy); on the same device it waits (R2) and records (R3).
R4  Between lanes (communicators): a lane reads or writes another lane's buffer only
    between two joins of the lanes involved (:meth:`Lane.wait_for` both ways); see
    ``dpq.fallback_p2p``.
R5  Teardown, also on the failure path (``finally``): the current stream and every lane
    join both ways (:meth:`ReplicaSet.close <dpq.mirror.ReplicaSet.close>`) before any
    mirror is dropped or the home block is unwrapped, restored or packed: lane work that
    read home's tensors is done before home frees them, and home's reads of lane tensors are
    done before the lanes' allocators reuse them.
R6  Host syncs: one per iteration, the loss readback (:class:`HostCopy`: each lane's losses
    copied to pinned host memory on the lane's own stream right after they are computed, read
    after the rest of the iteration is issued). Sample selection indexes the pool with host-side
    ints. Nothing in an iteration copies from pageable host memory (a pageable host-to-device
    copy waits for the destination stream), calls ``.item()``/``.tolist()``/``.cpu()`` on device
    tensors, or synchronizes a stream.
R7  Lane-local data (:meth:`Lane.bring`): a lane's samples, masks and every per-iteration input
    reach it without a copy queued on another lane's stream. torch runs a device-to-device copy
    on the *source* device's current stream and makes it wait for the destination's current
    stream (and the destination wait for it): issued from a lane with the source device's
    default stream current, it would queue on lane 0's stream between lane 0's kernels, and
    lane 0 and the lane would wait for each other. So a copy from another device runs on a
    side stream of that device, one per (lane, source device), made current for the copy: the
    two-way barrier is then between the lane and its own side stream. Host memory is pinned
    once per block and copied ``non_blocking`` on the lane's stream.
R8  Every host wait has a deadline (:func:`wait_events`): the host polls the events it waits for
    (``event.query()``, which does not block) and, between polls, a health check (the
    communicator's asynchronous NCCL error state); past the deadline it raises
    :class:`WaitExpired` naming what had not finished, instead of blocking in
    ``event.synchronize()`` on a kernel that may never end. The polls are host reads of event
    state only: they queue nothing, so R6's one sync per iteration stays one.

Lane methods whose name says "current" must be called outside every :meth:`Lane.issue`
context: inside one, the current stream would be that lane's. ``dpqlab/stream_checker.py``
checks all of this on CPU lanes with logical streams and vector clocks; ``dpqlab/timeline/``
replays an iteration on logical devices with CUDA's copy and host-sync semantics (R6, R7).

Streams are the run's (:meth:`Backend.run_stream`): every lane, communication lane and side
stream takes its stream from a fixed set per device, made on first use and reused by every later
block. torch hands out pool streams round robin (32 per device and priority) and cuBLAS keeps a
workspace per (handle, stream) for the process's life, so fresh streams per block would leave up
to 32 workspaces per device behind; reused ones keep them to the few streams a block uses.
:func:`release_run_streams` (``disable()``) forgets them.

Every branch between host-CPU lanes and accelerator lanes asks the backend
(:attr:`Backend.accelerator`, :meth:`Backend.host_memory`), never ``device.type``: a backend with
logical accelerators on the CPU (the timeline model's) then runs exactly the accelerator path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Backend", "HostCopy", "Lane", "WaitExpired", "backend", "copy_between", "device_key", "install_backend",
           "join", "make_lanes", "map_tensors", "release_run_streams", "unique_lanes", "wait_events"]


class Backend:
    """Stream, event and memory queries for one device type (the cpu variant: no-ops)."""

    type = "cpu"
    has_streams = False
    # Device memory apart from the host's: copies to and from the host are transfers (pinned
    # memory keeps them asynchronous) and reading a device value on the host is a sync.
    accelerator = False

    def host_memory(self, device: torch.device) -> bool:
        """True when tensors on ``device`` are in host memory (nothing to copy to the host)."""
        return True

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (host memory) in pinned memory, so that copies from it to a device of this
        backend run asynchronously (a copy once: call it once per block, not per iteration)."""
        return tensor

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer a device of this backend copies into asynchronously."""
        return torch.empty(shape, dtype=dtype)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def new_stream(self, device: torch.device):
        return None

    def communicator_for(self, devices: Sequence[torch.device]) -> tuple[str, str] | None:
        """(communicator name, reason) where this backend names the communicator for several lanes on
        ``devices`` (all of its type), before ``dpq.comm.communicators.choose_communicator``'s own rules;
        None (every real backend): those rules decide. A simulated backend (the timeline model's) names its own."""
        return None

    def run_stream(self, device: torch.device, role: tuple):
        """The run's stream for ``role`` (e.g. ("lane", 0): the first non-home lane on ``device``) on
        ``device``: made by :meth:`new_stream` on first use, the same object for every later block
        (module docstring: streams are the run's)."""
        streams = self.__dict__.setdefault("_run_streams", {})
        key = (*device_key(torch.device(device)), *role)
        if key not in streams:
            streams[key] = self.new_stream(device)
        return streams[key]

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self, device: torch.device):
        return None

    def synchronize(self, device: torch.device) -> None:
        return None

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor`` (rule R3); CPU: nothing to tell."""
        return None

    def empty_cache(self) -> None:
        """Hand the caching allocator's free blocks back to the device (CPU: no cache)."""
        return None

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes. CPU: available and total system memory."""
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
        except (OSError, KeyError, ValueError):
            return 2**40, 2**40

    def can_access_peer(self, a: torch.device, b: torch.device) -> bool:
        return a == b


class _TorchAcceleratorBackend(Backend):
    """cuda and xpu share torch's stream API under ``torch.<type>``."""

    has_streams = True
    accelerator = True

    def host_memory(self, device: torch.device) -> bool:
        return False

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def __init__(self, type_: str) -> None:
        self.type = type_

    @property
    def mod(self):
        return getattr(torch, self.type)

    def is_available(self) -> bool:
        mod = getattr(torch, self.type, None)
        return bool(mod is not None and mod.is_available())

    def device_count(self) -> int:
        return self.mod.device_count() if self.is_available() else 0

    def new_stream(self, device: torch.device):
        return self.mod.Stream(device=device)

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return self.mod.stream(stream)

    def current_stream(self, device: torch.device):
        return self.mod.current_stream(device)

    def synchronize(self, device: torch.device) -> None:
        self.mod.synchronize(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if tensor.device.type == self.type:  # host tensors (results already moved home) have no stream
            tensor.record_stream(stream)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.mod.mem_get_info(device)

    def empty_cache(self) -> None:
        empty = getattr(self.mod, "empty_cache", None) if self.is_available() else None
        if empty is not None:
            empty()  # torch.cuda: every device's cached blocks

    def can_access_peer(self, a: torch.device, b: torch.device) -> bool:
        if a == b:
            return True
        if self.type == "cuda":
            return bool(torch.cuda.can_device_access_peer(a.index, b.index))
        return False  # xpu: no peer query in torch; copies go through the runtime


class _HpuBackend(_TorchAcceleratorBackend):
    """Gaudi. Imported lazily: habana_frameworks is absent everywhere but Gaudi hosts."""

    def __init__(self) -> None:
        super().__init__("hpu")

    @property
    def mod(self):
        from habana_frameworks.torch import hpu

        return hpu

    def is_available(self) -> bool:
        try:
            return bool(self.mod.is_available())
        except ImportError:
            return False

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        stats = self.mod.memory_stats(device)
        total = int(stats.get("Limit", 0))
        return total - int(stats.get("InUse", 0)), total


_BACKENDS: dict[str, Backend] = {
    "cpu": Backend(),
    "cuda": _TorchAcceleratorBackend("cuda"),
    "xpu": _TorchAcceleratorBackend("xpu"),
    "hpu": _HpuBackend(),
}


def install_backend(type_: str, be: Backend) -> Backend | None:
    """``be`` answers for device type ``type_`` from now on; returns the backend it replaces (install
    that again to undo). The declared seam through which a simulated device (the timeline model's
    logical accelerators, the stream checker's CPU lanes with logical streams) takes the runtime's
    accelerator path (Note [observers, not patches] in ``dpq.engine.phases``)."""
    before = _BACKENDS.get(type_)
    _BACKENDS[type_] = be
    return before


def backend(device: torch.device | str) -> Backend:
    """The backend of ``device``'s type; unknown types are refused by name."""
    type_ = torch.device(device).type
    if type_ not in _BACKENDS:
        raise ValueError(f"dpq: device type {type_!r} is not supported (supported: {', '.join(_BACKENDS)})")
    return _BACKENDS[type_]


@dataclass(eq=False)
class Lane:
    """One replica's device and stream. Lane 0 is home (the caller's module, no copy) and
    issues on the current stream (rule R0); ``stream`` is None where streams are no-ops (CPU).

    Every cross-stream step of dpq goes through the methods below (module docstring, R0-R6).
    """

    index: int
    device: torch.device
    stream: object | None = field(default=None, repr=False)
    # R7: per source device, the side stream this lane's copies from that device run on
    _sides: dict = field(default_factory=dict, repr=False)

    @property
    def backend(self) -> Backend:
        return backend(self.device)

    @property
    def accelerator(self) -> bool:
        """The lane's memory is apart from the host's (``Backend.accelerator``)."""
        return self.backend.accelerator

    @property
    def stream_handle(self) -> int:
        """The raw stream pointer as an int (what NCCL takes); 0 = the default stream."""
        return int(getattr(self.stream, "cuda_stream", 0) or 0)

    def issue(self) -> contextlib.AbstractContextManager:
        """Context under which work is queued on this lane's stream."""
        return self.backend.stream_context(self.stream)

    def _current(self):
        """The device's current stream, or None when it is this lane's own (nothing to order)."""
        if self.stream is None:
            return None
        current = self.backend.current_stream(self.device)
        return None if current is None or current == self.stream else current

    def wait_for_current(self) -> None:
        """R1: this lane's later work runs after everything already queued on the device's current stream.

        Call before the lane reads data produced outside it (the pool, the home block's state,
        optimizer state built at home). No-op for lane 0 (it is the current stream) and on CPU.
        """
        current = self._current()
        if current is not None:
            self.stream.wait_stream(current)

    def current_waits_for_me(self) -> None:
        """R2: the device's current stream's later work runs after everything this lane queued so far."""
        current = self._current()
        if current is not None:
            current.wait_stream(self.stream)

    def wait_for(self, other: Lane) -> None:
        """R4: this lane's later work runs after everything ``other`` queued so far."""
        if self.stream is not None and other.stream is not None and self.stream != other.stream:
            self.stream.wait_stream(other.stream)

    def mark(self):
        """An event recorded now on this lane's stream (None where there is nothing to order)."""
        return self.stream.record_event() if self.stream is not None else None

    def mark_current(self):
        """An event recorded now on this device's current stream (inside an autograd node: the stream
        autograd runs it on, its forward's); None where there is nothing to order."""
        if self.stream is None:
            return None
        current = self.backend.current_stream(self.device)
        return current.record_event() if current is not None else None

    def waits(self, mark) -> None:
        """R4 for one point of another stream: this lane's later work runs after ``mark`` (an event
        from :meth:`mark` of another lane of this device)."""
        if self.stream is not None and mark is not None:
            self.stream.wait_event(mark)

    def current_waits(self, mark) -> None:
        """R2 for one point of the lane: the current stream waits for ``mark`` (from :meth:`mark`) only."""
        current = self._current()
        if current is not None and mark is not None:
            current.wait_event(mark)

    def record_on_current(self, tensor: torch.Tensor) -> None:
        """R3: ``tensor`` (allocated for this lane's stream) is used, and may be freed, on the current stream.

        The caching allocator then does not reuse its memory for this lane's later work until
        the current stream's uses queued before the free have run.
        """
        current = self._current()
        if current is not None:
            self.backend.record_stream(tensor, current)

    def hand_home(self, value, device: torch.device | str | None = None, *, mark=None):
        """R2 + R3: ``value`` (a tensor, or lists/tuples/dicts of them, produced on this lane)
        made safe to use, and free, on ``device``'s current stream (default: this lane's device).

        Same device: the current stream waits (for ``mark`` when given, else for everything the
        lane queued) and every tensor is recorded on it; the tensors themselves are returned.
        Another device: each tensor is copied on this lane's stream; torch makes the destination's
        current stream wait for the copy, and the source is only read on its own stream.
        Call outside every ``issue()`` context.
        """
        dest = torch.device(device) if device is not None else None
        if dest is not None and device_key(dest) != device_key(self.device):
            # To the host: a blocking copy (the host may read the result at once; an async copy
            # into pageable memory gives no event to wait for). Device to device: async.
            blocking = backend(dest).host_memory(dest)
            with self.issue():
                return map_tensors(value, lambda t: t.to(dest, non_blocking=not blocking))
        if mark is not None:
            self.current_waits(mark)
        else:
            self.current_waits_for_me()

        def record(t: torch.Tensor) -> torch.Tensor:
            self.record_on_current(t)
            return t

        return map_tensors(value, record)

    def bring(self, tensor: torch.Tensor) -> torch.Tensor:
        """R7: ``tensor`` readable on this lane's stream, without a copy queued on another lane's
        stream and without the host waiting. Call inside :meth:`issue`.

        On this lane's device: the tensor itself (its producer is ordered before the lane by R1
        at the block's start). In host memory: copied ``non_blocking`` on this lane's stream (the
        tensor must be pinned, :meth:`Backend.pin`, or the copy waits for the stream). On another
        device: copied on this lane's side stream of that device (made current for the copy, so
        torch's two-way barrier joins the lane and its own side stream only); the side stream
        waited for that device's current stream when it was made (R1), the source is recorded
        on it (R3), and :meth:`join_sides` orders that device's current stream after it (R5).
        The copy lands in memory of this lane's stream.
        """
        src = tensor.device
        if device_key(src) == device_key(self.device):
            return tensor
        src_backend = backend(src)
        if src_backend.host_memory(src):
            return tensor.to(self.device, non_blocking=True)
        side = self._side(src)
        with src_backend.stream_context(side):
            src_backend.record_stream(tensor, side)
            return tensor.to(self.device, non_blocking=True)

    def _side(self, device: torch.device):
        key = device_key(device)
        if key not in self._sides:
            be = backend(device)
            side = be.run_stream(device, ("side", *device_key(self.device), self.index))
            current = be.current_stream(device)
            if side is not None and current is not None:
                side.wait_stream(current)  # R1: after what produced the source (the pool)
            self._sides[key] = (device, side)
        return self._sides[key][1]

    def join_sides(self) -> None:
        """R5 for :meth:`bring`: each source device's current stream waits for this lane's side
        stream there, so what the side streams read is not freed or rewritten under them. The
        side streams are dropped from the lane (the next block's lane takes the run's same ones). Call
        outside every ``issue()``."""
        sides, self._sides = self._sides, {}
        for device, side in sides.values():
            current = backend(device).current_stream(device)
            if side is not None and current is not None:
                current.wait_stream(side)

    def synchronize(self) -> None:
        """Host waits for this lane's queued work (the host-staged communicator's one sync)."""
        if self.stream is not None:
            self.stream.synchronize()


def device_key(device: torch.device) -> tuple[str, int]:
    """(type, index) with a missing index as 0: ``cuda`` and ``cuda:0`` are one device."""
    return device.type, 0 if device.index is None else device.index


def join(lanes: Sequence[Lane]) -> None:
    """Device-side barrier (R4): work queued afterwards on any of ``lanes`` runs after all work
    queued on all of them. Hub and spokes through the first lane: 2*(len-1) event waits, no host sync."""
    hub, *rest = lanes
    for lane in rest:
        hub.wait_for(lane)
    for lane in rest:
        lane.wait_for(hub)


def unique_lanes(lanes) -> list[Lane]:
    """``lanes`` without repeats (the same Lane object once), in first-seen order."""
    return list({id(lane): lane for lane in lanes}.values())


def copy_between(moves: Sequence[tuple[Tensor, Lane, Tensor, Lane]]) -> None:
    """Copies ``(dst, dst_lane, src, src_lane)`` between lanes' memory, joined before and after
    (:func:`join` of the lanes involved), each inside both lanes' stream contexts: a buffer is
    read only after the work its owner queued before, the destination's later work runs after
    the data arrived, and torch's cross-device copy (which barriers on both devices' *current*
    streams) sees the lanes' streams as current."""
    if not moves:
        return
    involved = unique_lanes(lane for _, dst_lane, _, src_lane in moves for lane in (dst_lane, src_lane))
    join(involved)
    for dst, dst_lane, src, src_lane in moves:
        with dst_lane.issue(), src_lane.issue():  # src entered last: same-device copies run on its stream
            dst.copy_(src, non_blocking=True)
    join(involved)


def map_tensors(value, fn):
    """``fn`` on every tensor of ``value`` (a tensor, or lists/tuples/dicts of them); the rest as is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


# R8: how the host polls. The first polls come quickly (most waits end within microseconds of the
# host finishing its issuing), later ones back off to POLL_MAX_S, which bounds the latency a poll
# adds to a wait; the health check runs at most every CHECK_EVERY_S (it is a library call per handle).
POLL_FIRST_S = 20e-6
POLL_MAX_S = 500e-6
CHECK_EVERY_S = 0.05


class WaitExpired(RuntimeError):
    """A host wait passed its deadline (R8); ``pending``: the positions of the events not yet complete."""

    def __init__(self, pending: Sequence[int], waited_s: float) -> None:
        self.pending, self.waited_s = list(pending), waited_s
        super().__init__(f"events {self.pending} not complete after {waited_s:.1f} s")


def wait_events(events: Sequence, timeout_s: float | None = None, check: Callable[[], None] | None = None,
                *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """R8: the host waits until every event (None: nothing to wait for) has completed.

    Polls ``event.query()`` (CUDA: ``cudaEventQuery``, which returns at once) with a growing pause
    between rounds, and calls ``check()`` (e.g. the communicator's asynchronous-error check; its
    exception propagates) before the first pause and every :data:`CHECK_EVERY_S` after it. With
    ``timeout_s`` set, raises :class:`WaitExpired` once that many seconds have passed with events
    still pending; without it, waits as long as it takes (still polling and checking). This is the
    loop NCCL's documentation gives for waiting on work that may depend on a failed peer
    (``cudaStreamQuery`` + ``ncclCommGetAsyncError``, then ``ncclCommAbort``: "Error handling and
    communicator abort", https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/communicators.html).
    """
    pending = [k for k, e in enumerate(events) if e is not None]
    if not pending:
        return
    start = clock()
    pause, checked = POLL_FIRST_S, None
    while True:
        pending = [k for k in pending if not events[k].query()]
        if not pending:
            return
        now = clock()
        if check is not None and (checked is None or now - checked >= CHECK_EVERY_S):
            check()
            checked = now
        if timeout_s is not None and now - start >= timeout_s:
            raise WaitExpired(pending, now - start)
        sleep(pause)
        pause = min(POLL_MAX_S, pause * 2)


class HostCopy:
    """R6: a small tensor's values copied to host memory on the current stream, read later.

    Queue it right after the values are produced (inside a lane's :meth:`Lane.issue` the copy
    runs on that lane's stream); :meth:`tolist` then waits for that copy only (an event), not
    for the work issued after it (backward, exchange, step). On an accelerator the copy goes
    into pinned memory, asynchronously; host memory is read as it is.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        device = tensor.device
        be = backend(device)
        stream = be.current_stream(device)
        if be.host_memory(device):
            self._host = tensor
        else:  # pinned: the copy runs async; torch's host allocator keeps the buffer alive until it ran
            self._host = be.pinned_empty(tensor.shape, tensor.dtype)
            self._host.copy_(tensor, non_blocking=True)
        self._event = stream.record_event() if stream is not None else None

    @property
    def event(self):
        """The event the copy completes at (None: nothing to wait for)."""
        return self._event

    def wait(self, timeout_s: float | None = None, check: Callable[[], None] | None = None) -> None:
        """The host waits for the copy (R8: polled, with ``timeout_s`` and ``check`` as in :func:`wait_events`)."""
        wait_events([self._event], timeout_s, check)

    def tolist(self) -> list:
        self.wait()  # the one host sync of an iteration
        return self._host.tolist()

    @property
    def host(self) -> torch.Tensor:
        """The values in host memory; read them only after :meth:`wait`."""
        return self._host


def default_accelerator_type() -> str:
    for type_ in ("cuda", "xpu", "hpu"):
        if _BACKENDS[type_].is_available():
            return type_
    return "cpu"


def check_device_exists(device: torch.device) -> str | None:
    """None if ``device`` can be used, else a sentence saying why not."""
    be = _BACKENDS.get(device.type)
    if be is None:
        return f"device {device} has an unsupported type {device.type!r} (use cuda, xpu, hpu or cpu)"
    if device.type == "cpu":
        return None
    if not be.is_available():
        return f"device {device} does not exist: no {device.type} runtime is available on this machine"
    count = be.device_count()
    if device.index is not None and device.index >= count:
        return f"device {device} does not exist: this machine has {count} {device.type} device(s) (0..{count - 1})"
    return None


def make_lanes(devices: Sequence[torch.device | str]) -> list[Lane]:
    """One lane per entry. Lane 0 issues on its device's current stream (rule R0: ordered with
    the caller's work before and after the block without a wait); every other lane gets its own
    stream (also when it shares a device): the run's n-th lane stream of that device
    (:meth:`Backend.run_stream`), the same one every block. Make the lanes where they are used:
    lane 0 holds the stream that is current at this call."""
    lanes, seen = [], {}
    for i, dev in enumerate(devices):
        dev = torch.device(dev)
        if dev.type != "cpu" and dev.index is None:
            dev = torch.device(dev.type, 0)
        be = backend(dev)
        if i == 0:
            stream = be.current_stream(dev)
        else:
            n = seen[device_key(dev)] = seen.get(device_key(dev), -1) + 1
            stream = be.run_stream(dev, ("lane", n))
        lanes.append(Lane(index=i, device=dev, stream=stream))
    return lanes


def release_run_streams() -> None:
    """Forget every backend's run streams (``disable()``: the next run makes its own)."""
    for be in _BACKENDS.values():
        be.__dict__.pop("_run_streams", None)

