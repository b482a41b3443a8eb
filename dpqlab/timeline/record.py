"""The CUDA timeline model's recorder: the real code on CPU, every op booked as a GPU would run it.

On CPU every copy is synchronous and every lane shares one device, so nothing a CPU test sees
says whether, on GPUs, the lanes would run at the same time, or how often the host would stall.
:class:`TimelineModel` runs the real code path on CPU (``dpq.parallel_tune``, or the auto-round
adapter with auto-round's own ``block_forward`` and ``_get_loss``, compiled or not) with the lanes
on *logical accelerators*, and records every op with its logical device, stream and issuing thread,
its FLOPs and the size of every tensor it touches (:mod:`dpqlab.timeline.replay` times the
record). Everything it finds is a property of the op sequence the code issues; nothing in it is a
measurement of a GPU.

How the real code is made to take its accelerator path on CPU:

* Devices. Lanes are on ``cpu:1`` .. ``cpu:N`` (logical devices 1..N); ``cpu`` is host memory.
  dpq's cpu backend (``dpq.streams._BACKENDS["cpu"]``) is replaced by :class:`ModelBackend`:
  ``accelerator`` is True, ``host_memory`` is true for ``cpu`` only, it counts N+1 cpu devices,
  gives logical streams and events, and pins by copying into memory it marks pinned. So every
  branch the runtime takes through the backend (staging, pinning, the readback, the sign
  exchange's unpack) is the accelerator branch.
* Places. Every storage has a place (host or a logical device): tensors made before the model
  are host memory unless :meth:`TimelineModel.place` puts them on a device; an op's outputs live
  where its inputs do; a factory's where its ``device=`` says (one made by a lane's autograd node
  on the real CPU: on that lane). A ``TorchFunctionMode`` makes ``Tensor.device`` report the place
  (``cpu`` or ``cpu:k``), so every device comparison in dpq, auto-round and transformers sees the
  logical devices, and intercepts ``Tensor.to``: a move to the place a tensor already has is a
  no-op (as on CUDA), a move elsewhere is a real copy that the model books as a transfer. An op
  whose tensors live on two devices is recorded as a violation (CUDA raises "Expected all tensors
  to be on the same device"; 0-dim host scalars are allowed, as on CUDA).
* Compiled regions (:mod:`dpqlab.timeline.compiled`). A function auto-round compiles runs for
  real without the recording's modes (and with logical devices shown to it as the real CPU); each
  graph it calls is booked as the kernels inductor generated for it, on the lane's stream in the
  forward and on autograd's thread for the lane in the backward (one autograd node: the lane's
  gradients all appear when it ends), after one *call* op for the host's per-call work.

CUDA semantics recorded (and replayed by :func:`dpqlab.timeline.replay.simulate`):

* each logical device has a current stream (per stream context, as ``torch.cuda.stream`` sets
  it for its stream's device only); a kernel runs on the current stream of the device its tensors
  live on; streams are FIFO; ``wait_stream``/``wait_event``/``record_event`` carry edges;
* autograd's backward runs each op on the stream its forward op ran on (nodes are tagged at
  creation), issued by one host thread per device (autograd's device threads), concurrently with
  each other; the calling thread waits until every node was issued, and each device's stream
  current at the call waits for the leaf streams of that device; a gradient passed between nodes
  on different streams makes the consumer wait for the producer (stream and host); autograd's C++
  nodes run without Python's GIL, a compiled backward's wrapper (Python) with it;
* copies: host-to-device and device-to-host run on the device's current stream; from pageable
  memory, or with ``non_blocking=False``, the host waits until the copy (so everything queued
  before it on that stream) is done (PyTorch's ``memcpy_and_sync``); pinned + ``non_blocking``
  does not. A device-to-device copy runs on the *source* device's current stream, after that
  stream waits for the destination's current stream, and the destination's current stream
  waits for the copy (PyTorch's two-way barrier in ``copy_device_to_device``);
* ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` of a device tensor, ``Event.synchronize``,
  ``Stream.synchronize`` and device synchronize are host syncs; a *sync point* is a maximal run of
  host waits with no op issued between them (the host stalls once, until the last of them);
* the communicator is the one the plan picks for as many distinct GPUs (CuPy's NCCL:
  :class:`ModelCupyNccl`, its own code recorded: staging, folds, host calls into NCCL); a group's
  NCCL calls of one rank are one kernel on that rank's stream, and the members of a group (also
  :class:`ModelNccl`'s collectives) end together, ``latency + wire bytes / link`` after the last started;
  ``torch.distributed`` collectives (under torchrun) are one such kernel on the current stream,
  the other ranks assumed to start at the same time; object collectives are host syncs;
* dpq's gradient buckets are built with one tuned tensor each while recording (so a bucket's
  collectives wait for exactly its tensor's gradients), what the exchange does per bucket is marked
  with it (``Op.bucket``) and the cap dpq asked for is kept (``TimelineModel.bucket_layout``): the
  replay lays the exchange out in the target block's buckets (:mod:`dpqlab.timeline.buckets`).

Sizes: each op keeps, per tensor, its element count, bytes and the samples it spans
(:func:`lead_of`), which :class:`dpqlab.timeline.shapes.RoleMap` turns into the target
block's; matmuls keep torch's FLOPs, attention its own (:mod:`dpqlab.timeline.work`).

Not modelled: kernel concurrency limits on one device (kernels of different streams of one
device are free to overlap), copy-engine and link contention, the caching allocator (its memory
and its ``record_stream`` events; a compiled region's buffers are not booked, only its outputs),
CUDA graphs, NCCL's internal streams and channels, and any real timing of a GPU. Stream
*ordering* (races) is ``dpqlab/stream_checker.py``'s job.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import traceback
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

import dpq.streams as dpq_streams
from dpq.comm.comm_base import CommunicatorBase, ordered_sum
from dpq.comm.nccl_lifecycle import NcclCommSet
from dpq.engine.exchange import BucketCap
from dpq.engine.phases import Observer
from dpq.nccl_comm import CupyNcclCommunicator
from dpqlab.fake_cupy_nccl import ITEMSIZE, FakeNccl
from dpqlab.timeline.shapes import TensorMeta
from dpqlab.timeline.work import attention_flops, is_view_schema, named_args, work_of

__all__ = ["HOST", "ModelCupyNccl", "ModelNccl", "Op", "TimelineModel", "device_of_place", "lead_of", "place_of_device",
           "without_modes"]

HOST = None  # the place of host memory; devices are 1..N
_DEVICE = torch.Tensor.device  # the getset descriptor whose __get__ the function mode answers
_HOST_READS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}
_NODE_KEY = "dpq_timeline_stream"


def place_of_device(device: torch.device | str | None, default: int | None = HOST) -> int | None:
    """``cpu`` -> host, ``cpu:k`` -> logical device k, None -> ``default``."""
    if device is None:
        return default
    device = torch.device(device)
    if device.type != "cpu":
        raise ValueError(f"timeline model: device {device} is not a logical device (use cpu or cpu:k)")
    return device.index if device.index else HOST


def device_of_place(place: int | None) -> torch.device:
    return torch.device("cpu") if place is HOST else torch.device("cpu", place)


# -- the record ---------------------------------------------------------------------------------


@dataclass
class Op:
    """One recorded op, in issue order. ``kind``: kernel (device work), copy (a transfer), collective,
    wait (a stream waiting for an event), sync (the host waiting), host (host work on host memory),
    marker (iteration and backward boundaries), view (an op that only makes views: the issuing
    thread's dispatch, no device work)."""

    id: int
    name: str
    kind: str
    thread: str
    stream: ModelStream | None = None
    deps: list[int] = field(default_factory=list)  # ops this one's start waits for (device side)
    host_after: int | None = None  # the host thread waits until this op was issued (autograd's ready queue)
    wait_for: int | None = None  # sync: the op the host waits for
    flops: float = 0.0  # matmul and attention kernels: their FLOPs at the recorded sizes
    tensors: tuple[TensorMeta, ...] = ()  # what it reads and writes, at the recorded sizes (shapes.RoleMap scales)
    work: str = "elementwise"  # kernels: matmul, attention or elementwise (dpqlab.timeline.work)
    wire_factor: float = 0.0  # collectives: bytes on the wire per byte of tensors[0]
    region: str = ""  # kernels of a compiled region (dpqlab.timeline.compiled): the region's name
    gil: bool = True  # the issuing host thread holds Python's GIL for this op (autograd's C++ nodes do not)
    bucket: int | None = None  # an op of the exchange of this gradient bucket (dpqlab.timeline.buckets)
    bucket_numel: int = 0  # that bucket's elements
    fixed_scale: float | None = None  # a target bucket's copy of such an op: every size scales by this
    link: str = ""  # copies and collectives: h2d, d2h, d2d, nccl
    blocking: bool = False  # the host waits for this op to finish (a pageable or blocking copy)
    site: str = ""
    iteration: int = -1
    phase: str = ""
    group: int | None = None  # collective: members of one group end together
    group_size: int = 1
    in_communicator: bool = False  # issued by the communicator's own code (ModelCupyNccl: staging, folds, calls)


def lead_of(shape: tuple[int, ...], seqlen: int) -> int:
    """The samples an activation spans, from its shape: ``[lead, seq, ...]``, ``[lead, heads, seq, ...]``
    or flattened ``[lead x seq, ...]``; 0 when no dimension is a multiple of ``seqlen`` (not an activation)."""
    if not shape or not any(d and d % seqlen == 0 for d in shape):
        return 0
    return shape[0] // seqlen if shape[0] % seqlen == 0 else shape[0]


@contextlib.contextmanager
def without_modes() -> Iterator[None]:
    """No torch function or dispatch mode active (the recording's), restored afterwards."""
    fmodes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in reversed(fmodes):
            torch._C._push_on_torch_function_stack(mode)


def _accumulating_grad() -> bool:
    """Autograd is adding a gradient into a leaf's ``.grad`` (its AccumulateGrad node runs)."""
    node = torch._C._current_autograd_node()
    return node is not None and "AccumulateGrad" in node.name()


def _issued_from_python() -> bool:
    """Inside a backward, the op comes from Python code autograd called (a hook, a Python Function's
    backward), not from one of its C++ nodes: a frame outside torch and this model lies between the
    dispatch and the engine's entry (``torch.autograd.graph._engine_run_backward``, where the backward
    call left Python).

    Note [Python on autograd's threads holds the GIL]: autograd's device threads run C++ nodes without
    the GIL, but a Python hook or Function is Python code, which CPython runs only under the GIL
    (``torch/csrc/autograd/python_hook.cpp`` acquires it to call each hook), so its ops queue on the
    GIL with every other thread's Python (the replay's ``Busy``)."""
    frame = sys._getframe(1)
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if name == "_engine_run_backward" and path.endswith("autograd/graph.py"):
            return False
        if "/torch/" not in path and "/dpqlab/timeline/" not in path:
            return True
        frame = frame.f_back
    return False


def _real_device(value):
    """A logical device (``cpu:k``, as a device or a string) as the real one, anything else as it is."""
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cpu:"):
        return "cpu"
    return value


@contextlib.contextmanager
def _modules_on_real_devices(values) -> Iterator[None]:
    """Every attribute of a module in ``values`` (or of a submodule) naming a logical device names the
    real one while a compiled region runs: dynamo would make a fake tensor on ``cpu:k`` of
    ``x.to(self.device)`` (auto-round's wrappers keep ``device`` and ``output_device``), unlike the real CPU."""
    saved = []
    for value in values:
        if isinstance(value, torch.nn.Module):
            for m in value.modules():
                for name, was in list(m.__dict__.items()):
                    now = _real_device(was)
                    if now is not was:
                        saved.append((m, name, was))
                        m.__dict__[name] = now
    try:
        yield
    finally:
        for m, name, was in saved:
            m.__dict__[name] = was


def _flops(func, work: str, args, kwargs, out) -> float:
    """A matmul's FLOPs by torch's formula; attention's by :func:`dpqlab.timeline.work.attention_flops`."""
    if work == "attention":
        named = named_args(func._schema, args, kwargs)
        order = ("query", "key", "value") if "grad_out" not in named else ("grad_out", "query", "key", "value")
        return attention_flops(func._schema.name, [tuple(named[k].shape) for k in order], bool(named.get("is_causal")))
    if work != "matmul":
        return 0.0
    rule = flop_registry.get(func._overloadpacket)
    return float(rule(*args, **kwargs, out_val=out)) if rule is not None else 0.0


class ModelEvent:
    def __init__(self, model: TimelineModel) -> None:
        self.model, self.op = model, None

    def record(self, stream: ModelStream | None = None) -> None:
        stream = stream if stream is not None else self.model.current_stream(self.model.current_place())
        self.op = stream.last

    def wait(self, stream: ModelStream | None = None) -> None:
        stream = stream if stream is not None else self.model.current_stream(self.model.current_place())
        self.model.stream_wait(stream, self.op, "wait_event")

    def synchronize(self) -> None:
        self.model.host_sync(self.op, "event.synchronize()")

    def query(self) -> bool:
        """Complete, as the replay will have it when the host asks again: a polling loop (dpq.streams R8)
        is a host wait for the event."""
        self.model.host_sync(self.op, "event.query() (polled)")
        return True


class ModelStream:
    """A logical stream of one logical device; the API dpq uses of ``torch.cuda.Stream``."""

    def __init__(self, model: TimelineModel, sid: int, place: int, name: str) -> None:
        self.model, self.sid, self.place, self.name = model, sid, place, name
        self.last: int | None = None  # the last op queued on it
        self.cuda_stream = 0

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def wait_stream(self, other: ModelStream) -> None:
        if other is not self:
            self.model.stream_wait(self, other.last, "wait_stream")

    def record_event(self, event: ModelEvent | None = None) -> ModelEvent:
        event = event if event is not None else ModelEvent(self.model)
        event.record(self)
        return event

    def wait_event(self, event: ModelEvent) -> None:
        event.wait(self)

    def synchronize(self) -> None:
        self.model.host_sync(self.last, f"{self.name}.synchronize()")

    def query(self) -> bool:
        self.model.host_sync(self.last, f"{self.name}.query() (polled)")
        return True


class ModelBackend(dpq_streams.Backend):
    """dpq's cpu backend on logical accelerators (installed by :class:`TimelineModel`)."""

    has_streams = True
    accelerator = True

    def __init__(self, model: TimelineModel) -> None:
        self.model = model

    def host_memory(self, device: torch.device) -> bool:
        return place_of_device(device) is HOST

    def device_count(self) -> int:
        return self.model.devices + 1

    def new_stream(self, device: torch.device):
        place = place_of_device(device)
        return None if place is HOST else self.model.new_stream(place)

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if stream is None else self.model.stream_context(stream)

    def current_stream(self, device: torch.device):
        place = place_of_device(device)
        return None if place is HOST else self.model.current_stream(place)

    def synchronize(self, device: torch.device) -> None:
        for s in self.model.streams:
            self.model.host_sync(s.last, "device synchronize()")

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        return None  # the allocator is not modelled

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return 2**40, 2**40

    def can_access_peer(self, a: torch.device, b: torch.device) -> bool:
        return True

    def communicator_for(self, devices: Sequence[torch.device]) -> tuple[str, str] | None:
        places = [place_of_device(d) for d in devices]
        if len(places) > 1 and len(set(places)) == len(places) and HOST not in places:
            # the plan's choice for as many distinct GPUs (whose NCCL kinds are the model's: TimelineModel)
            from dpq.comm.communicators import choose_communicator

            return choose_communicator([torch.device("cuda", p) for p in places])
        return None

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.model.is_pinned(tensor):
            return tensor
        with self.model.phase_of("pin"):
            pinned = tensor.clone()  # a host memcpy, booked as host work
        self.model.mark_pinned(pinned)
        return pinned

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.model.mark_pinned(t)
        return t


class ModelNccl(CommunicatorBase):
    """NCCL's semantics for lanes on distinct logical devices: each collective is one kernel per
    lane on the lane's stream, ending together (module docstring); the sums are the canonical
    ordered sums, computed on the host while the record is paused."""

    name = "model-nccl"

    def __init__(self, lanes, model: TimelineModel | None = None) -> None:
        super().__init__(lanes)
        self.model = model if model is not None else TimelineModel.active
        self.model.communicators.append(self.name)

    def _group(self, op: str, bufs_per_lane: list[list[torch.Tensor]], wire_factor: float,
               compute: Callable[[], None]) -> None:
        """``wire_factor``: a ring's bytes on the wire per lane, per byte of each lane's first buffer."""
        with self.model.paused():
            compute()
        self.model.collective(op, [(lane, bufs) for lane, bufs in zip(self.lanes, bufs_per_lane, strict=True)],
                              wire_factor)

    def _all_reduce(self, bufs):
        self._group("all_reduce", [[b] for b in bufs], 2 * (self.world - 1) / self.world,
                    lambda: [b.copy_(s) for s in [ordered_sum(list(bufs), torch.empty_like(bufs[0]))] for b in bufs])

    def _reduce_scatter(self, send, recv):
        n = recv[0].numel()

        def compute():
            for k, out in enumerate(recv):
                ordered_sum([s[k * n:(k + 1) * n] for s in send], out)

        self._group("reduce_scatter", [[s, r] for s, r in zip(send, recv, strict=True)],
                    (self.world - 1) / self.world, compute)  # of the send buffer

    def _all_gather(self, send, recv):
        n = send[0].numel()

        def compute():
            for r in recv:
                for j, s in enumerate(send):
                    r[j * n:(j + 1) * n].copy_(s)

        self._group("all_gather", [[s, r] for s, r in zip(send, recv, strict=True)],
                    self.world - 1, compute)  # of the send buffer (one lane's chunk)

    def _broadcast(self, bufs, root):
        self._group("broadcast", [[b] for b in bufs], 1.0,
                    lambda: [b.copy_(bufs[root]) for k, b in enumerate(bufs) if k != root])

    def _reduce(self, bufs, root):
        self._group("reduce", [[b] for b in bufs], 1.0,
                    lambda: ordered_sum(list(bufs), bufs[root]))


class _ModelNcclLibrary(FakeNccl):
    """``cupy.cuda.nccl`` for :class:`ModelCupyNccl`: the fake's data movement (:mod:`dpqlab.fake_cupy_nccl`)
    and, per call, the host's call into NCCL; at ``groupEnd`` each rank's calls of the group as one NCCL
    kernel on the stream it named (NCCL runs a group's work of one rank as one kernel launch), every
    member of the group ending together, the rank's wire bytes its sends (a collective's: its ring's)."""

    def __init__(self, model: TimelineModel, lanes) -> None:
        super().__init__()
        self.model, self.lanes = model, lanes

    def groupEnd(self):
        pending = list(self.pending)
        with self.model.paused(), without_modes():  # the fake's sums (native order) are NCCL's, not the lanes' ops
            super().groupEnd()
        self.model.nccl_group(pending, self.lanes)


class ModelCupyNccl(CupyNcclCommunicator):
    """dpq's CuPy NCCL communicator (what the plan picks for distinct GPUs where CuPy's NCCL imports, as
    ``auto-round-dp[cuda12]`` installs it) running its own code on the logical devices: its staging
    allocations, ``ordered_sum`` folds and host calls are recorded as they are issued, its NCCL calls by
    :class:`_ModelNcclLibrary`. ``available`` answers True: the machine presets the model prices have it."""

    @classmethod
    def available(cls) -> bool:
        return True

    def __init__(self, lanes, *, shared: bool = False, allow_shared_gpu: bool | None = None,
                 order: str = "canonical") -> None:
        CommunicatorBase.__init__(self, lanes)
        self._set_order(order)
        self.model = TimelineModel.active
        self.model.communicators.append(self.name if order == "canonical" else f"{self.name} ({order})")
        places = [place_of_device(lane.device) for lane in self.lanes]
        self._nccl = _ModelNcclLibrary(self.model, self.lanes)
        self.shared = False
        self._set = NcclCommSet(self.name, places, self._nccl.NcclCommunicator.initAll(places), self._nccl)

    def _stream(self, k: int) -> int:
        return k  # the handle NCCL is given: the model maps it back to lane k's stream

    def _issue(self, collective: Callable, *args) -> None:
        with self.model.communicator_code():
            collective(self, *args)

    def _all_reduce(self, bufs) -> None:
        self._issue(CupyNcclCommunicator._all_reduce, bufs)

    def _reduce_scatter(self, send, recv) -> None:
        self._issue(CupyNcclCommunicator._reduce_scatter, send, recv)

    def _all_gather(self, send, recv) -> None:
        self._issue(CupyNcclCommunicator._all_gather, send, recv)

    def _broadcast(self, bufs, root) -> None:
        self._issue(CupyNcclCommunicator._broadcast, bufs, root)

    def _reduce(self, bufs, root) -> None:
        self._issue(CupyNcclCommunicator._reduce, bufs, root)


_WRITE_ONLY = {"aten::copy_", "aten::fill_", "aten::zero_"}  # their destination is written, not read


def _traffic(schema, args, kwargs, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an elementwise kernel moves, each tensor once per direction: every input read, every output
    written; an argument it writes in place (``Tensor(a!)``) written once, also where the op returns
    nothing (``_foreach_add_``), and not read where the op only writes it (``copy_``'s destination, an
    ``out=`` argument)."""
    written, write_only = [], set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        targets = _tensors(args[i] if i < len(args) else kwargs.get(a.name))
        written += targets
        if a.kwarg_only or schema.name in _WRITE_ONLY:
            write_only |= {t._cdata for t in targets}
    seen = {t._cdata for t in written}
    reads = [t for t in ins if t._cdata not in write_only]
    return reads + [t for t in outs if t._cdata not in seen] + written


def _wire_elems(call, world: int) -> float:
    """Elements one rank's NCCL call puts on the wire: a send its count, a receive none, a collective
    its ring's (an all-gather sends every other rank's chunk on, a reduce-scatter (W-1)/W of its input)."""
    ring = {"send": 1.0, "recv": 0.0, "broadcast": 1.0, "allGather": world - 1.0, "reduceScatter": world - 1.0,
            "allReduce": 2 * (world - 1) / world, "reduce": (world - 1) / world}
    return call.count * ring[call.op]


# -- the recorder ---------------------------------------------------------------------------------


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


# dpq.streams' polled host wait (R8): the site of a sync is who waits, not the polling loop
_WAIT_HELPERS = {"wait_events", "<listcomp>", "wait", "tolist"}


def _site() -> str:
    """The innermost two frames of dpq, auto-round or a test (what caused a sync or a copy)."""
    frames = [f for f in traceback.extract_stack()[:-1]
              if "/torch/" not in f.filename and "/dpqlab/timeline/" not in f.filename
              and not (f.filename.endswith("dpq/streams.py") and f.name in _WAIT_HELPERS)]
    keep = [f for f in frames if "/dpq/" in f.filename or "auto_round" in f.filename or "/tests/" in f.filename]
    keep = keep[-2:] if keep else frames[-2:]
    return " <- ".join(f"{f.filename.split('/site-packages/')[-1].split('/work/main/')[-1]}:{f.lineno} {f.name}"
                       for f in reversed(keep))


class _Places(TorchFunctionMode):
    """``Tensor.device`` reports the place; ``Tensor.to``/``.cpu()`` move between places as CUDA would;
    host reads (``tolist``) of device tensors are syncs; new autograd nodes are tagged with their stream."""

    def __init__(self, model: TimelineModel) -> None:
        super().__init__()
        self.model = model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.model
        if getattr(func, "__self__", None) is _DEVICE:
            return device_of_place(m.place_of(args[0]))
        if func is torch.Tensor.is_pinned:
            return m.is_pinned(args[0])
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            return m.move(func, args, kwargs)
        if func is torch.Tensor.tolist and m.place_of(args[0]) is not HOST:
            m.device_read(args[0], "tolist()")
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() and not m.paused_now:
            roots = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
            if roots:
                m.tag_nodes(roots, _tensors(out)[0])
        return out


class _Record(TorchDispatchMode):
    def __init__(self, model: TimelineModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.model.paused_now:
            with torch._C.DisableTorchFunction():
                self.model.on_op(func, args, kwargs, out)
        return out


class TimelineModel:
    """Context manager: record the real code on ``devices`` logical accelerators (module docstring).

    ``ops`` is the record; ``violations`` lists device mixes (an op reading tensors of two devices);
    ``lanes`` the lanes the session made (captured from ``dpq.session.make_lanes``).

    Memory: ``live[place]`` is the bytes of every live storage that has that place (booked: made by
    an op, a transfer or a factory under the model, or given a place by :meth:`place`), ``peak[place]``
    its maximum since :meth:`reset_peaks` (every storage is counted once, whatever views it has; one
    an op writes in place is not counted again). What the accelerator runtime allocates beside the
    tensors (workspaces, NCCL's buffers, the caching allocator's rounding) is not in it."""

    active: TimelineModel | None = None

    def __init__(self, devices: int, *, seqlen: int) -> None:
        self.devices = devices
        self.seqlen = seqlen  # the recording's sequence length: an activation's numel is a multiple of it
        self.ops: list[Op] = []
        self.streams: list[ModelStream] = []
        self.violations: list[str] = []
        self.lanes: list = []
        self.communicators: list[str] = []  # the name of every communicator the run made, in order
        self._in_communicator = 0
        self._places: dict[int, int | None] = {}
        self._sizes: dict[int, tuple[int | None, int]] = {}  # storage -> (place, bytes) counted in live
        self.live: dict[int | None, int] = defaultdict(int)
        self.peak: dict[int | None, int] = defaultdict(int)
        self._pinned: set[int] = set()
        self._constants: set[int] = set()  # storages of fixed size whatever the block (mark_constant)
        self._default: dict[int, ModelStream] = {}
        self._tls = threading.local()
        self._iteration = -1
        self._phase = ""
        self._window: int | None = None  # the running backward call
        self._window_writes: dict[int, Op] = {}  # storage -> last backward op that wrote it (this window)
        self._window_streams: dict[int, dict[int, ModelStream]] = {}
        self._paused = 0
        self._groups = itertools.count()
        self._restore: list[Callable[[], None]] = []
        # compiled regions (dpqlab.timeline.compiled): the region being run (name, place), graph calls
        # so far, and per region call the forward graphs it ran (1 unless it graph-broke)
        self._regions: list[tuple[str, int | None]] = []
        self._graph_calls = 0
        self.region_graphs: list[tuple[str, int]] = []
        self.region_calls: list[tuple[str, int | None, int]] = []  # every region call: (name, place, lead samples)
        self.compiles: list[tuple[str, float]] = []  # every dynamo compile while recording: (compile id, host s)
        self.bucket_layout: tuple[list[int], BucketCap] | None = None  # the gradient buckets dpq built: sizes, cap
        self._bucket: tuple[int, int] | None = None  # the bucket being exchanged: (index, elements)

    # -- places ----------------------------------------------------------------------------------

    @staticmethod
    def _key(t: torch.Tensor) -> int | None:
        try:
            with torch._C.DisableTorchFunction():
                s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return id(s)

    def _book(self, t: torch.Tensor, place: int | None) -> None:
        key = self._key(t)
        if key is None or key in self._places:
            return
        self._places[key] = place
        with torch._C.DisableTorchFunction():
            storage = t.untyped_storage()
            weakref.finalize(storage, self._forget, key).atexit = False
            nbytes = storage.nbytes()
        was = self._sizes.get(key)
        if was is not None:  # booked again (a new place for the same storage): moved, not allocated
            self.live[was[0]] -= was[1]
        self._sizes[key] = (place, nbytes)
        self.live[place] += nbytes
        self.peak[place] = max(self.peak[place], self.live[place])

    def reset_peaks(self) -> None:
        """Every place's peak back to what lives there now."""
        self.peak.clear()
        self.peak.update(self.live)

    def _forget(self, key: int) -> None:
        gone = self._sizes.pop(key, None)
        if gone is not None:
            self.live[gone[0]] -= gone[1]
        self._places.pop(key, None)
        self._pinned.discard(key)
        self._constants.discard(key)
        self._window_writes.pop(key, None)

    def place_of(self, t: torch.Tensor) -> int | None:
        key = self._key(t)
        return self._places.get(key, HOST) if key is not None else HOST

    def place(self, value, device: torch.device | str) -> None:
        """Every tensor in ``value`` (tensors, lists/tuples/dicts, modules) lives on ``device`` from
        now on (no copy: what a pool cached on that device, or a block moved there, would be)."""
        place = place_of_device(device)
        if isinstance(value, torch.nn.Module):
            value = [*value.parameters(), *value.buffers(),
                     *(t for m in value.modules() for t in _tensors(list(m.__dict__.values())))]
        for t in _tensors(value):
            key = self._key(t)
            if key is not None:
                self._places.pop(key, None)
                self._book(t, place)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self._key(t) in self._pinned

    def mark_pinned(self, t: torch.Tensor) -> None:
        self._book(t, HOST)
        self._pinned.add(self._key(t))

    # -- streams -----------------------------------------------------------------------------------

    def new_stream(self, place: int, name: str | None = None) -> ModelStream:
        n = sum(x.place == place and x not in self._default.values() for x in self.streams)
        s = ModelStream(self, len(self.streams), place, name or f"dev{place}.s{n + 1}")
        self.streams.append(s)
        return s

    def default_stream(self, place: int) -> ModelStream:
        if place not in self._default:
            self._default[place] = self.new_stream(place, f"dev{place}.default")
        return self._default[place]

    def _stack(self) -> list:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def current_stream(self, place: int) -> ModelStream:
        for s in reversed(self._stack()):
            if s.place == place:
                return s
        node_stream = self._node_stream()
        if node_stream is not None and node_stream.place == place:
            return node_stream
        return self.default_stream(place)

    def current_place(self) -> int:
        stack = self._stack()
        return stack[-1].place if stack else 1

    @contextlib.contextmanager
    def stream_context(self, stream: ModelStream):
        self._stack().append(stream)
        try:
            yield
        finally:
            self._stack().pop()

    def _node_stream(self) -> ModelStream | None:
        if self._window is None:
            return None
        node = torch._C._current_autograd_node()
        return node.metadata.get(_NODE_KEY) if node is not None else None

    def tag_nodes(self, roots, out: torch.Tensor) -> None:
        place = self.place_of(out)
        if place is HOST:
            return
        stream = self.current_stream(place)
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None or _NODE_KEY in node.metadata:
                continue
            node.metadata[_NODE_KEY] = stream
            todo.extend(n for n, _ in node.next_functions)

    # -- recording ---------------------------------------------------------------------------------

    @property
    def paused_now(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def phase_of(self, phase: str):
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    def _thread(self) -> str:
        s = self._node_stream()
        return f"autograd dev{s.place}" if s is not None else "main"

    @contextlib.contextmanager
    def communicator_code(self):
        """Ops recorded meanwhile are the communicator's own (``Op.in_communicator``)."""
        self._in_communicator += 1
        try:
            yield
        finally:
            self._in_communicator -= 1

    def _add(self, op: Op) -> Op:
        op.in_communicator = self._in_communicator > 0
        if self._bucket is not None and op.kind != "marker":
            op.bucket, op.bucket_numel = self._bucket
        phase = op.phase or self._phase
        if self._window is not None and phase in ("", "forward"):
            phase = "backward"
        op.iteration, op.phase = self._iteration, phase
        self.ops.append(op)
        if op.stream is not None and op.kind in ("kernel", "copy", "collective", "wait"):
            op.stream.last = op.id
        return op

    def _new(self, name: str, kind: str, **kw) -> Op:
        return Op(len(self.ops), name, kind, kw.pop("thread", None) or self._thread(), **kw)

    def stream_wait(self, stream: ModelStream, op_id: int | None, what: str) -> None:
        if op_id is not None and not self.paused_now:
            self._add(self._new(what, "wait", stream=stream, deps=[op_id]))

    def host_sync(self, op_id: int | None, what: str) -> None:
        if not self.paused_now:
            self._add(self._new(what, "sync", wait_for=op_id, site=_site()))

    def marker(self, name: str) -> None:
        self._add(self._new(name, "marker", thread="main"))

    def metas(self, tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
        """Each tensor's (element count, bytes, lead samples): what shapes.RoleMap scales; a constant's
        lead is -1 (its size is the same for every block)."""
        return tuple((t.numel(), t.numel() * t.element_size(),
                      -1 if self._key(t) in self._constants else lead_of(tuple(t.shape), self.seqlen))
                     for t in tensors)

    def mark_constant(self, t: torch.Tensor) -> None:
        """``t`` is a constant of fixed size (a lookup table), whatever block the record is replayed as."""
        self._constants.add(self._key(t))

    def device_read(self, t: torch.Tensor, what: str) -> None:
        """A host read of a device tensor: a blocking device-to-host copy on its device's current stream."""
        place = self.place_of(t)
        stream = self.current_stream(place)
        op = self._add(self._new(what, "copy", stream=stream, link="d2h", tensors=self.metas([t]),
                                 blocking=True, site=_site()))
        self._add(self._new(f"{what} (wait)", "sync", wait_for=op.id, site=op.site))

    def move(self, func, args, kwargs):
        """``Tensor.to`` / ``Tensor.cpu`` between places (see the module docstring)."""
        t = args[0]
        src = self.place_of(t)
        if func is torch.Tensor.cpu:
            device, dtype, non_blocking = torch.device("cpu"), None, False
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):  # t.to(other): other's place and dtype
            device, dtype = device_of_place(self.place_of(args[1])), args[1].dtype
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            kw = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kw)
        if device is not None and torch.device(device).type != "cpu":  # e.g. meta: not a place
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        dst = place_of_device(device, default=src)
        copy = bool(kwargs.get("copy", False))
        if dst == src:
            with torch._C.DisableTorchFunction():
                if dtype is None and not copy:
                    return t
                return t.to(dtype=dtype if dtype is not None else t.dtype, copy=copy)  # a kernel where it is
        with torch._C.DisableTorchFunction(), self.paused():
            out = t.to(dtype=dtype if dtype is not None else t.dtype, copy=True)  # the physical copy
        self._transfer(t, out, src, dst, non_blocking, "Tensor.to")
        return out

    def _transfer(self, src_t, dst_t, src: int | None, dst: int | None, non_blocking: bool, what: str) -> None:
        """Book a copy between two places (the physical CPU copy itself is not booked)."""
        self._places.pop(self._key(dst_t), None)
        self._book(dst_t, dst)
        metas = self.metas([dst_t])
        if src is HOST and dst is HOST:
            self._add(self._new(what, "host", tensors=metas))
            return
        if src is HOST or dst is HOST:
            device = dst if src is HOST else src
            stream = self.current_stream(device)
            pinned = self.is_pinned(src_t if src is HOST else dst_t)
            blocking = not (non_blocking and pinned)
            link = "h2d" if src is HOST else "d2h"
            op = self._add(self._new(f"{what} {link}{' pageable' if not pinned else ''}", "copy", stream=stream,
                                     link=link, tensors=metas, blocking=blocking,
                                     site=_site() if blocking or not pinned else ""))
            if blocking:
                self._add(self._new(f"{link} copy (host waits)", "sync", wait_for=op.id, site=op.site))
            return
        src_stream, dst_stream = self.current_stream(src), self.current_stream(dst)
        deps = [dst_stream.last] if dst_stream.last is not None else []
        op = self._add(self._new(f"{what} d2d dev{src}->dev{dst}", "copy", stream=src_stream, deps=deps, link="d2d",
                                 tensors=metas, site=_site()))
        self._add(self._new("d2d barrier", "wait", stream=dst_stream, deps=[op.id]))

    def collective(self, name: str, members, wire_factor: float) -> None:
        """One group: a kernel per (lane, buffers) on the lane's stream (:class:`ModelNccl`); each
        lane puts ``wire_factor`` x its first buffer's bytes on the wire."""
        gid = next(self._groups)
        for lane, bufs in members:
            stream = lane.stream if lane.stream is not None else self.current_stream(place_of_device(lane.device))
            self._add(self._new(f"nccl {name}", "collective", stream=stream, link="nccl", tensors=self.metas(bufs[:1]),
                                wire_factor=wire_factor, group=gid,
                                group_size=len(members)))

    def nccl_group(self, calls, lanes) -> None:
        """One NCCL group of :class:`ModelCupyNccl` (``calls``: the fake's records, rank = lane index):
        each call a host call into NCCL, then each rank's calls as one kernel on its lane's stream,
        every member ending together, each putting its sends (a collective: its ring's bytes) on the wire."""
        if self.paused_now or not calls:
            return
        world, by_rank = len(lanes), defaultdict(list)
        for c in calls:
            self._add(self._new(f"nccl {c.op} (host call)", "nccl_call"))
            by_rank[c.rank].append(c)
        gid = next(self._groups)
        for rank, mine in by_rank.items():
            lane = lanes[rank]
            stream = lane.stream if lane.stream is not None else self.current_stream(place_of_device(lane.device))
            sent = sum(_wire_elems(c, world) for c in mine)
            self._add(self._new(f"nccl {'+'.join(dict.fromkeys(c.op for c in mine))}", "collective", stream=stream,
                                link="nccl", tensors=((round(sent), round(sent * ITEMSIZE[mine[0].dtype]), 0),),
                                wire_factor=1.0, group=gid, group_size=len(by_rank)))

    def on_op(self, func, args, kwargs, out) -> None:
        schema = func._schema
        name = schema.name
        if is_view_schema(schema):
            # metadata only: no kernel, but the issuing thread's dispatch (replay: ``view_op_s``)
            self._add(self._new(name, "view"))
            return
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if name == "aten::copy_":
            dst_t, src_t = args[0], args[1]
            src, dst = self.place_of(src_t), self.place_of(dst_t)
            if src != dst:
                self._transfer(src_t, dst_t, src, dst, bool(kwargs.get("non_blocking", len(args) > 2 and args[2])),
                               "copy_")
                self._places.pop(self._key(dst_t), None)  # copy_ writes in place: dst keeps its place
                self._book(dst_t, dst)
                return
        device = kwargs.get("device")
        if name == "aten::_to_copy" and device is not None and torch.device(device).index:  # torch.tensor(x, device=)
            src, dst = self.place_of(args[0]), place_of_device(device)
            if src != dst:
                self._transfer(args[0], out, src, dst, bool(kwargs.get("non_blocking", False)), "_to_copy")
                return
        if name == "aten::lift_fresh":
            return  # torch.tensor(<Python data>): host memory
        if name.endswith("_like") and device is not None:  # empty_like(x, device=...): where device= says
            for t in outs:
                self._book(t, place_of_device(device))
            if place_of_device(device) is not HOST:
                self._add(self._new(name, "kernel", stream=self.current_stream(place_of_device(device)),
                                    tensors=self.metas(outs)))
            return
        places = {self.place_of(t) for t in ins}
        devs = {p for p in places if p is not HOST}
        host_big = [t for t in ins if self.place_of(t) is HOST and t.dim() > 0]
        node = self._node_stream()
        if not ins:
            place = place_of_device(kwargs.get("device"))
            if place is HOST and node is not None:
                # made by an autograd node of a lane (a compiled backward's zero gradients, made on its
                # forward's device, which the region ran as the real CPU): on that lane's device
                place = node.place
        elif devs:
            place = min(devs)
            if len(devs) > 1 or host_big:
                where = sorted(f"dev{p}" for p in devs) + (["host"] if host_big else [])
                self.violations.append(f"{name} mixes tensors of {', '.join(where)} (CUDA raises: expected all "
                                       f"tensors on the same device) at {_site()}")
        else:
            place = HOST
        for t in outs:
            self._book(t, place)
        if name in _HOST_READS:
            if place is not HOST:
                self.device_read(ins[0], name.removeprefix("aten::") + "()")
            return
        if place is HOST:
            self._add(self._new(name, "host", tensors=self.metas(ins + outs)))
            return
        stream = self.current_stream(place)
        work = work_of(name)
        moved = _traffic(schema, args, kwargs, ins, outs) if work == "elementwise" else ins + outs
        op = self._new(name, "kernel", stream=stream, flops=_flops(func, work, args, kwargs, out), work=work,
                       tensors=self.metas(moved), phase="grads" if _accumulating_grad() else "")
        # autograd's device threads run its C++ nodes without the GIL, Python hooks with it
        op.gil = op.thread == "main" or _issued_from_python()
        written = [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i < len(schema.arguments)
                   and schema.arguments[i].alias_info is not None and schema.arguments[i].alias_info.is_write]
        self._in_backward(op, op, ins, outs + written)
        self._add(op)

    def _in_backward(self, first: Op, last: Op, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Inside a backward call: ``first`` (the op that reads ``ins``) waits for each input's producer
        on another stream, and ``last`` becomes the producer of ``outs``."""
        if self._window is None:
            return
        # An exchange bucket's ops (dpq.engine.exchange, issued by the issuer node inside the backward) read the
        # gradient buffers through explicit waits on the bucket's marks (recorded as wait ops), not through
        # autograd's input buffers: the producer rule would tie them to the buffer's last write anywhere
        # (the storage is the key), i.e. the backward's end.
        for t in ins if self._bucket is None else ():
            producer = self._window_writes.get(self._key(t))
            if producer is not None and producer.stream is not first.stream:
                first.deps.append(producer.id)  # autograd's InputBuffer: the consumer waits for the producer
                if producer.thread != first.thread:
                    first.host_after = producer.id
        for t in outs:
            self._window_writes[self._key(t)] = last
        self._window_streams.setdefault(self._window, {})[last.stream.sid] = last.stream

    # -- compiled regions (dpqlab.timeline.compiled) --------------------------------------------

    def region_name(self) -> str:
        """The compiled region being run (its function's name), "" outside one."""
        return self._regions[-1][0] if self._regions else ""

    def run_region(self, name: str, compiled: Callable, args, kwargs):
        """A compiled function called by the recorded code: it runs for real without the recording's
        modes; each graph it calls is booked by :meth:`graph_call` on the current stream of the device
        its tensors live on; its fresh outputs live there, and their autograd nodes (the compiled
        backward) run on that stream."""
        ins = _tensors((args, kwargs))
        devs = {self.place_of(t) for t in ins} - {HOST}
        place = min(devs) if devs else HOST
        self.region_calls.append((name, place, max((lead_of(tuple(t.shape), self.seqlen) for t in ins), default=0)))
        calls = self._graph_calls
        self._regions.append((name, place))
        # a logical device passed in (auto-round's block_forward takes the lane's) is the real CPU in here
        args, kwargs = tree_map(_real_device, (args, kwargs))
        try:
            with without_modes(), _modules_on_real_devices([*args, *kwargs.values()]):
                out = compiled(*args, **kwargs)
        finally:
            self._regions.pop()
        self.region_graphs.append((name, self._graph_calls - calls))
        outs = _tensors(out)
        known = {self._key(t) for t in ins}
        for t in outs:
            if self._key(t) not in known:
                self._places.pop(self._key(t), None)
                self._book(t, place)
        roots = [t.grad_fn for t in outs if t.grad_fn is not None]
        if roots and torch.is_grad_enabled() and place is not HOST:
            self.tag_nodes(roots, outs[0])
        return out

    def graph_call(self, graph, inputs, out) -> None:
        """One call of a compiled graph (:class:`dpqlab.timeline.compiled.CompiledGraph`): the host's
        call, then its kernels on the stream of the region's lane (forward) or of the autograd node that
        runs it (backward)."""
        if self._regions:
            name, place = self._regions[-1]
        else:
            node = self._node_stream()
            name, place = (graph.region or "compiled backward"), (node.place if node is not None else HOST)
        ins, outs = _tensors(inputs), _tensors(out)
        for t in outs:
            self._places.pop(self._key(t), None)
            self._book(t, place)
        if place is HOST:
            return  # a compiled function on host memory: host work, not a lane's
        self._graph_calls += 1
        stream = self.current_stream(place)
        self._add(self._new(f"{name}: {'backward' if graph.backward else 'forward'} graph call", "call",
                            region=name))
        ops = [self._add(self._new(k.name, "kernel", stream=stream, flops=k.flops, tensors=k.tensors, work=k.work,
                                   region=name)) for k in graph.kernels]
        if ops:
            self._in_backward(ops[0], ops[-1], ins, outs)

    # -- install -----------------------------------------------------------------------------------

    def _patch(self, owner, name: str, value) -> None:
        """Replace a torch attribute while recording (autograd's backward, torch.distributed: never dpq's,
        which the model sees through its observer, Note [observers, not patches] in ``dpq.engine.phases``)."""
        real = getattr(owner, name)
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, real))

    def __enter__(self) -> TimelineModel:
        from dpq.comm import communicators
        from dpq.engine import phases

        TimelineModel.active = self
        real_cpu = dpq_streams.install_backend("cpu", ModelBackend(self))
        self._restore.append(lambda: dpq_streams.install_backend("cpu", real_cpu))
        communicators.register_communicator("model-nccl", ModelNccl)
        self._restore.append(lambda: communicators.register_communicator("model-nccl", None))
        real_cupy = communicators.register_communicator("cupy-nccl", ModelCupyNccl)  # the plan's pick on GPUs
        self._restore.append(lambda: communicators.register_communicator("cupy-nccl", real_cupy))
        self._observing = phases.observing(_Observer(self))
        self._observing.__enter__()
        self._restore.append(lambda: self._observing.__exit__(None, None, None))
        model = self

        real_autograd_backward = torch.autograd.backward

        def autograd_backward(*args, **kwargs):
            model.marker("bw_begin")
            model._window = len(model.ops)
            callers = {}
            try:
                return real_autograd_backward(*args, **kwargs)
            finally:
                window, model._window = model._window, None
                for s in model._window_streams.pop(window, {}).values():
                    callers.setdefault(s.place, model.current_stream(s.place))
                    if callers[s.place] is not s:  # the caller's stream on that device waits for the leaf streams
                        model.stream_wait(callers[s.place], s.last, "backward end")
                model._window_writes.clear()
                model.marker("bw_end")

        self._patch(torch.autograd, "backward", autograd_backward)
        self._install_distributed()
        self._modes = contextlib.ExitStack()
        self._modes.enter_context(_Places(self))
        self._modes.enter_context(_Record(self))
        return self

    def _install_distributed(self) -> None:
        """torch.distributed collectives as NCCL kernels on the current stream (peers assumed in step)."""
        dist = torch.distributed
        if not dist.is_available():
            return
        model = self

        def as_kernel(name, real):
            @functools.wraps(real)
            def call(*args, **kwargs):
                tensors = _tensors((args, kwargs))
                if model.paused_now or not tensors:
                    return real(*args, **kwargs)
                place = model.place_of(tensors[0])
                with model.paused():
                    out = real(*args, **kwargs)
                if place is not HOST:
                    stream = model.current_stream(place)
                    model._add(model._new(f"dist.{name}", "collective", stream=stream, link="nccl",
                                          tensors=model.metas(tensors[:1]), wire_factor=1.0))
                return out
            return call

        def as_sync(name, real):
            @functools.wraps(real)
            def call(*args, **kwargs):
                if not model.paused_now:
                    model.host_sync(None, f"dist.{name}")
                with model.paused():
                    return real(*args, **kwargs)
            return call

        # (isend/irecv are left alone: batch_isend_irecv checks its ops' functions by identity)
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
                     "all_gather", "reduce_scatter", "send", "recv", "reduce", "all_to_all"):
            if hasattr(dist, name):
                self._patch(dist, name, as_kernel(name, getattr(dist, name)))
        for name in ("all_gather_object", "broadcast_object_list", "barrier", "gather_object"):
            if hasattr(dist, name):
                self._patch(dist, name, as_sync(name, getattr(dist, name)))
        if hasattr(dist, "batch_isend_irecv"):
            real = dist.batch_isend_irecv

            def batch(ops):
                if model.paused_now or not ops:
                    return real(ops)
                place = model.place_of(ops[0].tensor)
                with model.paused():
                    out = real(ops)
                if place is not HOST:
                    model._add(model._new("dist.batch_isend_irecv", "collective", stream=model.current_stream(place),
                                          link="nccl", tensors=model.metas([o.tensor for o in ops]),
                                          wire_factor=1.0))
                return out

            self._patch(dist, "batch_isend_irecv", batch)

    def __exit__(self, *exc) -> None:
        self._modes.close()
        while self._restore:
            self._restore.pop()()
        TimelineModel.active = None


# the runtime's phases (dpq.engine.phases) as the record labels them (Op.phase); None: the label stays
_LABELS = {"split": "forward", "forward": "forward", "backward": "forward", "readback": "readback",
           "readback queue": "readback", "identical check": None,
           "loss gather": "readback", "exchange": "exchange", "exchange finish": "exchange", "grads": "grads",
           "step": "step", "issuer": None, "loop": None}


class _Observer(Observer):
    """What the model needs of a run (Note [observers, not patches] in ``dpq.engine.phases``): iteration
    markers, each op's phase label, the lanes, the buckets' layout (recorded one tuned tensor per
    bucket) and the bucket each exchange op belongs to, the constant tables, and the places put back
    for the overlapped exchange's issuer (autograd runs nodes without the caller's torch function
    modes, so ``Tensor.device`` would answer the real cpu there; the hooks only count and record
    events: no tensor op)."""

    def __init__(self, model: TimelineModel) -> None:
        self.model = model
        self._labels: list[str] = []
        self._places: list[contextlib.ExitStack] = []
        self._buckets: list[tuple[int, int] | None] = []

    def phase_begin(self, name: str, owner: object, lane: int | None) -> None:
        model = self.model
        if name == "split":
            model._iteration += 1
            model.marker(f"iteration {model._iteration}")
        if name == "issuer":
            stack = contextlib.ExitStack()
            stack.enter_context(_Places(model))
            self._places.append(stack)
        self._labels.append(model._phase)
        label = _LABELS.get(name)
        if label is not None:
            model._phase = label

    def phase_end(self, name: str, owner: object, lane: int | None, error: BaseException | None) -> None:
        model = self.model
        model._phase = self._labels.pop()
        if name == "issuer":
            self._places.pop().close()
        if name == "loop":
            model.marker("loop end")
            model._iteration = -1  # what follows (teardown, unwrap) belongs to no iteration

    def lanes_made(self, lanes: Sequence) -> None:
        self.model.lanes = list(lanes)

    def bucket_cap(self, sizes: Sequence[int], cap: BucketCap) -> int:
        # recorded with one tuned tensor per bucket (each bucket's ops then wait for exactly its tensor's
        # gradients), the cap dpq asked for (a dpq.engine.exchange.Buckets, or elements) kept for laying out the
        # target's buckets (dpq.engine.exchange.bucket_cap of the target's own tensors)
        self.model.bucket_layout = (list(sizes), cap)
        return 1

    def exchange_begin(self, policy: object, bucket: int, numel: int) -> None:
        self._buckets.append(self.model._bucket)
        self.model._bucket = (bucket, numel)

    def exchange_end(self, policy: object, bucket: int, numel: int, error: BaseException | None) -> None:
        self.model._bucket = self._buckets.pop()

    def constant_made(self, tensor: torch.Tensor) -> None:
        self.model.mark_constant(tensor)
