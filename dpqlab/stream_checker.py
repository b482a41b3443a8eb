"""A stream-order checker for CPU lanes: CUDA's stream semantics, modelled with logical streams.

On CPU every dpq stream is a no-op, so a missing wait cannot corrupt anything and no test can
see it. This checker installs a cpu backend in ``dpq.streams`` (``install_backend``) whose streams are
*logical*: each has a vector clock; ``wait_stream`` and events carry happens-before edges;
``Stream.synchronize`` / ``Event.synchronize`` are host syncs (everything issued afterwards, on
any stream, happens after what was synced). The device's current stream is a logical default
stream, and ``stream_context`` makes a lane's stream current, as ``torch.cuda.stream`` does.

A ``TorchDispatchMode`` sees every aten op and books it on the stream it would run on under
CUDA: the current logical stream, or, for backward ops, the stream their forward op ran on
(autograd on CUDA runs each backward op on its forward op's stream; here a
``TorchFunctionMode`` tags every new autograd node with the stream current when it was
created, and backward ops look up ``torch._C._current_autograd_node()``). Per storage it keeps
the last write and the reads since, each as (stream, clock). It fails (``StreamOrderError``,
naming the op, the storage, the producer and the consumer stream) when:

* an op reads a storage last written on another stream with no happens-before edge (RAW);
* an op writes a storage last written or read on another stream with no edge (WAW, WAR);
* a storage is freed (``weakref.finalize`` on the untyped storage: it runs when the memory is
  released) while a use on a stream other than its allocation stream is neither ordered
  before the allocation stream's present (so the caching allocator could hand the block to
  new work on the allocation stream while that use still runs) nor recorded on the user's
  stream (``record_stream``, routed through ``Backend.record_stream``).

What is modelled of autograd beyond op streams: gradients passed between backward nodes on
different streams are synchronised by autograd (``InputBuffer``: the consumer waits for the
producer and records the tensor on its stream); here a read of a storage written during the
same ``torch.autograd.backward`` call adds that edge and that record. The caller's stream
waiting for the leaf streams at the end of backward is *not* modelled (stricter than CUDA).

Limits (it is a CPU model of CUDA semantics, not CUDA):

* every lane is on one logical device, so cross-device copies (which torch orders itself)
  are not exercised;
* a storage first seen as an op's *input* is taken as made earlier on the default stream
  (a tensor built outside the dispatcher under a lane's context would be mis-assigned);
* tensors made from Python data (``torch.tensor``, seen as ``lift_fresh``: lr values, index
  lists) and whatever is computed from them alone are host tensors, on no stream and not
  checked (under CUDA that is where they live, unless ``device=`` puts them on the GPU);
* every ``.item()`` of a non-host tensor counts as a host sync, which orders everything
  issued afterwards after the synced stream: a sync can hide a missing wait that the same
  run on CUDA would also not hit, but a different schedule might;
* accesses are byte ranges of a storage (a strided view counts as its hull);
* host-side computation on host buffers (the host-staged communicator) is booked on the
  current stream; ``Tensor.tolist`` is not an aten op (a host read must go through an event
  or ``.item()`` to be seen); NCCL kernels are not modelled (nothing runs them on CPU).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dpq.streams as dpq_streams

__all__ = ["LogicalEvent", "LogicalStream", "StreamOrderChecker", "StreamOrderError"]

_NODE_KEY = "dpq_stream_checker_stream"

# Ops that are host syncs on CUDA (their result is a Python value read by the host).
_HOST_SYNC_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}


class StreamOrderError(AssertionError):
    """A cross-stream use without a happens-before edge (see the module docstring)."""


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


class LogicalStream:
    """A stream with a vector clock; the API dpq uses of ``torch.cuda.Stream``."""

    def __init__(self, checker: StreamOrderChecker, sid: int, name: str) -> None:
        self.checker, self.sid, self.name = checker, sid, name
        self.vc: dict[int, int] = {sid: 0}
        self.cuda_stream = 0

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def wait_stream(self, other: LogicalStream) -> None:
        self.checker.waits += 1
        if other is not self:
            _join(self.vc, other.vc)

    def record_event(self, event: LogicalEvent | None = None) -> LogicalEvent:
        event = event if event is not None else LogicalEvent(self.checker)
        event.record(self)
        return event

    def wait_event(self, event: LogicalEvent) -> None:
        event.wait(self)

    def synchronize(self) -> None:
        self.checker._host_sync(self.vc, f"{self.name}.synchronize()")

    def query(self) -> bool:
        self.checker._host_sync(self.vc, f"{self.name}.query()")
        return True


class LogicalEvent:
    """An event: a snapshot of the recording stream's clock."""

    def __init__(self, checker: StreamOrderChecker) -> None:
        self.checker = checker
        self.vc: dict[int, int] = {}

    def record(self, stream: LogicalStream | None = None) -> None:
        stream = stream if stream is not None else self.checker.current_stream()
        self.vc = dict(stream.vc)

    def wait(self, stream: LogicalStream | None = None) -> None:
        stream = stream if stream is not None else self.checker.current_stream()
        self.checker.waits += 1
        _join(stream.vc, self.vc)

    def synchronize(self) -> None:
        self.checker._host_sync(self.vc, "event.synchronize()")

    def query(self) -> bool:
        """Complete at once; the host learns that it is, as from a wait (a polling loop is a host sync)."""
        self.checker._host_sync(self.vc, "event.query()")
        return True


class _CheckedCpuBackend(dpq_streams.Backend):
    """dpq's cpu backend with logical streams (installed by :class:`StreamOrderChecker`)."""

    has_streams = True

    def __init__(self, checker: StreamOrderChecker) -> None:
        self.checker = checker

    def new_stream(self, device: torch.device):
        return self.checker.new_stream(f"lane-stream-{len(self.checker.streams)}")

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if stream is None else self.checker.stream_context(stream)

    def current_stream(self, device: torch.device):
        return self.checker.current_stream()

    def synchronize(self, device: torch.device) -> None:
        for s in self.checker.streams:
            self.checker._host_sync(s.vc, "device synchronize()")

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.checker.record_stream(tensor, stream)


@dataclass
class _Storage:
    alloc: int  # stream id the storage was allocated on (its caching-allocator pool)
    desc: str
    # Accesses by byte range [lo, hi): disjoint slices of one buffer (a communicator's chunks)
    # may be used by different streams at once, as on CUDA.
    writes: list = field(default_factory=list)  # (lo, hi, stream id, clock, op, backward window)
    reads: list = field(default_factory=list)  # (lo, hi, stream id, clock, op), since the range's last write
    uses: dict = field(default_factory=dict)  # stream id -> (clock, op), the latest use per stream
    recorded: set = field(default_factory=set)  # stream ids given by record_stream
    host: bool = False  # host memory (made from Python data): no stream, never booked


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage ``t`` can touch (the hull of a strided view)."""
    if t.numel() == 0:
        return None
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    lo = t.storage_offset() * t.element_size()
    return lo, lo + span * t.element_size()


def _inside(a_lo: int, a_hi: int, lo: int, hi: int) -> bool:
    return lo <= a_lo and a_hi <= hi


class _Dispatch(TorchDispatchMode):
    def __init__(self, checker: StreamOrderChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.checker._on_op(func, args, kwargs, out)
        return out


class _Tagger(TorchFunctionMode):
    """Tags every autograd node created by a call with the stream current at that call."""

    def __init__(self, checker: StreamOrderChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if roots:
                self.checker._tag(roots)
        return out


class StreamOrderChecker:
    """Context manager: dpq's cpu lanes get logical streams and every op is checked (module docstring).

    ``violations`` lists every failure (each is also raised as :class:`StreamOrderError` at the
    op that made it, or at exit for frees); ``host_syncs`` counts host syncs (sync *points*: host
    waits that follow each other with no op booked between them are one point, the host stalls
    once, until the last of them; ``host_waits`` counts every wait), ``waits`` stream
    and event waits, ``ops`` the aten ops seen.
    """

    def __init__(self) -> None:
        self.streams: list[LogicalStream] = []
        self.default = self.new_stream("default")
        self._tls = threading.local()
        self.host_vc: dict[int, int] = {}
        self.storages: dict[int, _Storage] = {}
        self.violations: list[str] = []
        self._pending: list[str] = []
        self.host_syncs = 0
        self.host_waits = 0
        self._op_since_sync = True
        self.waits = 0
        self.ops = 0
        self._window: int | None = None  # the running torch.autograd.backward call
        self._windows = 0
        self._bw_depth: int | None = None  # stream-context depth when the running backward began
        self._saved = None
        self._closed = False
        self.scalar_reads = 0  # .item() and friends, host tensors included

    # -- streams ---------------------------------------------------------------------------

    def new_stream(self, name: str) -> LogicalStream:
        s = LogicalStream(self, len(self.streams), name)
        self.streams.append(s)
        return s

    def _stack(self) -> list:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def current_stream(self) -> LogicalStream:
        # Inside a backward node, CUDA's autograd makes the node's stream current (a stream guard
        # around the node, its hooks included): a hook's ops and its ``current_stream()`` queries
        # see the node's stream, unless the hook enters a stream context of its own, as the
        # overlapped exchange's hooks do (``lane.issue()`` around each lane's part of a
        # collective): those ops go on that stream, as under ``torch.cuda.stream``.
        stack = self._stack()
        if self._bw_depth is None or len(stack) <= self._bw_depth:
            node = torch._C._current_autograd_node()
            if node is not None:
                s = node.metadata.get(_NODE_KEY)
                if s is not None:
                    return s
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def stream_context(self, stream: LogicalStream):
        self._stack().append(stream)
        try:
            yield
        finally:
            self._stack().pop()

    def _host_sync(self, vc: dict, what: str) -> None:
        self.host_waits += 1
        if self._op_since_sync:
            self.host_syncs += 1
        self._op_since_sync = False
        _join(self.host_vc, vc)

    def record_stream(self, tensor: torch.Tensor, stream: LogicalStream) -> None:
        st = self._storage(tensor, None)
        if st is not None:
            st.recorded.add(stream.sid)

    # -- install ---------------------------------------------------------------------------

    def __enter__(self) -> StreamOrderChecker:
        real_backward = torch.autograd.backward
        # the declared seam (Note [observers, not patches] in dpq.engine.phases): the CPU lanes' backend is ours
        self._saved = (dpq_streams.install_backend("cpu", _CheckedCpuBackend(self)), real_backward)

        def backward(*args, **kwargs):
            self._windows += 1
            outer, self._window = self._window, self._windows
            outer_depth, self._bw_depth = self._bw_depth, len(self._stack())
            try:
                return real_backward(*args, **kwargs)
            finally:
                self._window, self._bw_depth = outer, outer_depth

        torch.autograd.backward = backward
        self._modes = contextlib.ExitStack()
        self._modes.enter_context(_Tagger(self))
        self._modes.enter_context(_Dispatch(self))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            gc.collect()  # run the frees of whatever the test dropped, while the modes still book them
        finally:
            self._modes.close()
            real_cpu, torch.autograd.backward = self._saved
            dpq_streams.install_backend("cpu", real_cpu)
            self._closed = True
        if exc_type is None:
            self._raise_pending()

    def _raise_pending(self) -> None:
        if self._pending:
            first, self._pending = self._pending[0], []
            raise StreamOrderError(first)

    # -- booking ---------------------------------------------------------------------------

    def _tag(self, roots) -> None:
        stream = self.current_stream()
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None:
                continue
            md = node.metadata
            if _NODE_KEY in md:
                continue
            md[_NODE_KEY] = stream
            todo.extend(n for n, _ in node.next_functions)

    def _op_stream(self) -> LogicalStream:
        return self.current_stream()  # a backward op: its node's stream (see current_stream)

    def _storage(self, t: torch.Tensor, alloc_on: LogicalStream | None, op: str = "") -> _Storage | None:
        """The booking of ``t``'s storage; a storage seen for the first time is allocated on
        ``alloc_on`` (an op's output) or, when None, was made before on the default stream."""
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        if s.nbytes() == 0:
            return None
        key = id(s)
        st = self.storages.get(key)
        if st is None:
            alloc = alloc_on if alloc_on is not None else self.default
            desc = f"{tuple(t.shape)} {t.dtype} ({s.nbytes()} bytes, first {'made by ' + op if op else 'seen'} " \
                   f"on {alloc.name})"
            st = self.storages[key] = _Storage(alloc.sid, desc)
            weakref.finalize(s, self._on_free, key).atexit = False
        return st

    def _hb(self, stream: LogicalStream, producer_sid: int, clock: int) -> bool:
        return stream.sid == producer_sid or stream.vc.get(producer_sid, 0) >= clock

    def _fail(self, msg: str) -> None:
        self.violations.append(msg)
        self._pending.append(msg)

    def _on_op(self, func, args, kwargs, out) -> None:
        self.ops += 1
        schema = func._schema
        name = schema.name
        if name in _HOST_SYNC_OPS:
            self.scalar_reads += 1
        if name == "aten::lift_fresh":
            # torch.tensor(<Python data>): under CUDA a host tensor (an lr, an index list, a
            # scalar); host ops run synchronously on the host, on no stream.
            self._mark_host(args[0])
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if inputs and all(self._is_host(t) for t in inputs):
            for t in tree_flatten(out)[0]:  # host in, host out (lr schedules, sampler arithmetic)
                if isinstance(t, torch.Tensor) and not self._known(t):
                    self._mark_host(t)
            return
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return  # a view (or detach/alias): metadata only, no kernel reads or writes
        reads, writes = [], []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            if not tensors:
                continue
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes.extend(tensors)
            else:
                reads.extend(tensors)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        sync = name in _HOST_SYNC_OPS
        self._book(self._op_stream(), name, reads, writes, outs, sync)
        self._raise_pending()

    def _book(self, stream: LogicalStream, op: str, reads, writes, outs, sync: bool) -> None:
        self._op_since_sync = True
        _join(stream.vc, self.host_vc)  # work issued after a host sync runs after what it waited for
        stream.vc[stream.sid] += 1
        clock = stream.vc[stream.sid]
        for t in outs:  # a fresh output storage is allocated on this stream (and written)
            if not self._known(t):
                st = self._storage(t, stream, op)
                if st is not None:
                    st.writes.append((0, t.untyped_storage().nbytes(), stream.sid, clock, op, self._window))
                    st.uses[stream.sid] = (clock, op)
        for t in reads:
            st, rng = self._storage(t, None), _byte_range(t)
            if st is None or rng is None or st.host:
                continue
            lo, hi = rng
            self._check_after_write(st, lo, hi, stream, op, "reads")
            st.reads = [r for r in st.reads if not (r[2] == stream.sid and _inside(r[0], r[1], lo, hi))]
            st.reads.append((lo, hi, stream.sid, clock, op))
            st.uses[stream.sid] = (clock, op)
        for t in writes:
            st, rng = self._storage(t, None), _byte_range(t)
            if st is None or rng is None or st.host:
                continue
            lo, hi = rng
            self._check_after_write(st, lo, hi, stream, op, "writes")
            for r_lo, r_hi, sid, c, rop in st.reads:
                if r_lo < hi and lo < r_hi and not self._hb(stream, sid, c):
                    self._fail(f"{op} on {stream.name} writes bytes [{lo}, {hi}) of storage {st.desc} still being "
                               f"read by {rop} on {self.streams[sid].name}: no happens-before edge "
                               "(write-after-read; missing wait)")
            st.writes = [w for w in st.writes if not _inside(w[0], w[1], lo, hi)]
            st.writes.append((lo, hi, stream.sid, clock, op, self._window))
            st.reads = [r for r in st.reads if not _inside(r[0], r[1], lo, hi)]
            st.uses[stream.sid] = (clock, op)
        if sync:
            self._host_sync(stream.vc, op)

    def _mark_host(self, t: torch.Tensor) -> None:
        st = self._storage(t, None)
        if st is not None:
            st.host = True

    def _is_host(self, t: torch.Tensor) -> bool:
        try:
            st = self.storages.get(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return False
        return st is not None and st.host

    def _known(self, t: torch.Tensor) -> bool:
        try:
            return id(t.untyped_storage()) in self.storages
        except (RuntimeError, NotImplementedError):
            return True

    def _check_after_write(self, st: _Storage, lo: int, hi: int, stream: LogicalStream, op: str, verb: str) -> None:
        for w_lo, w_hi, sid, clock, wop, window in st.writes:
            if w_hi <= lo or hi <= w_lo:
                continue
            if sid != stream.sid and window is not None and window == self._window:
                # a gradient passed between backward nodes: autograd's InputBuffer makes the
                # consumer wait for the producer and records the tensor on the consumer's stream.
                # It does so whenever the two streams differ, even where an earlier edge already
                # orders them (the overlapped exchange's collectives join the lanes mid-backward):
                # the record is what lets the producer's pool free the gradient safely.
                stream.vc[sid] = max(stream.vc.get(sid, 0), clock)
                st.recorded.add(stream.sid)
                continue
            if self._hb(stream, sid, clock):
                continue
            self._fail(f"{op} on {stream.name} {verb} bytes [{lo}, {hi}) of storage {st.desc} last written by "
                       f"{wop} on {self.streams[sid].name}: no happens-before edge (missing wait)")

    def _on_free(self, key: int) -> None:
        st = self.storages.pop(key, None)
        if st is None or self._closed:
            return
        alloc = self.streams[st.alloc]
        if st.host:
            return
        for sid, (clock, op) in st.uses.items():
            if sid == st.alloc or sid in st.recorded or self._hb(alloc, sid, clock):
                continue
            self._fail(f"storage {st.desc} freed (back to {alloc.name}'s pool) while its use by {op} on "
                       f"{self.streams[sid].name} is not ordered before {alloc.name} and not recorded on "
                       f"{self.streams[sid].name} (missing wait or record_stream)")
