"""The Communicator protocol and what every dpq communicator shares (:class:`CommunicatorBase`).

A communicator runs collectives over the lanes of one process: one buffer per lane
(``bufs[k]`` lives on ``lanes[k].device``), 1-D contiguous, float32, bfloat16 or uint8.
Every call is issued from one Python thread; each lane's part is queued on that lane's
stream, so nothing here blocks the host unless a communicator says so (host staging).

Contract for every communicator (kept by :class:`CommunicatorBase`, which all dpq
communicators derive from):

* Results are bitwise identical on every lane.
* ``wire_bytes`` grows by the ring-algorithm bytes one lane puts on the wire (NCCL's
  "bus bytes" convention), computed by :func:`ring_wire_bytes` from the logical call,
  so benchmarks of different communicators compare.
* World 1: every call is a no-op, except reduce_scatter / all_gather, which copy.
* Watchdog (R8 of ``dpq.streams``): ``check_async_error()`` raises if work already queued has
  failed unseen (NCCL: ``ncclCommGetAsyncError``); ``abort(reason)`` ends queued work that may
  never complete and returns whether it did (NCCL: ``ncclCommAbort``). Copy-based communicators
  have nothing to check and nothing they can end: the defaults.
* **Canonical order** (DESIGN.md, contract 3): every element of a sum is folded over the
  global lanes left to right, ``acc = x0 + x1; acc += x2; ...`` in the buffer dtype
  (:func:`ordered_sum`), so the bits depend on the world alone, not on the communicator or
  on how lanes are spread over processes. A communicator that cannot keep it says so in
  ``canonical_order = False`` and ``order_note`` (why), for the plan's reason.

The communicators themselves: in-process NCCL in :mod:`dpq.nccl_comm`; device copies, host
staging and the process-group communicator in :mod:`dpq.fallback_p2p` / :mod:`dpq.comm.process_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dpq.streams import Lane

__all__ = ["SUPPORTED_DTYPES", "Communicator", "CommunicatorBase", "CommunicatorWrapper", "chunk_bounds", "ordered_sum",
           "ring_wire_bytes"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)

# Bus-bytes factor per op: an all_reduce is a reduce-scatter plus an all-gather.
_RING_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "reduce": 1}


@runtime_checkable
class Communicator(Protocol):
    """Collectives over the lanes of one process (see the module docstring for the contract)."""

    name: str
    lanes: Sequence[Lane]
    wire_bytes: int

    @property
    def world(self) -> int:
        """Ranks a collective spans: ``len(lanes)`` in-process; more across processes."""
        ...

    def all_reduce(self, bufs: Sequence[Tensor]) -> None:
        """In place: every ``bufs[k]`` becomes the sum over lanes."""
        ...

    def reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        """``send[k]`` has W*n elements, ``recv[k]`` n: ``recv[k] = sum_j send[j][k*n:(k+1)*n]``."""
        ...

    def all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        """``send[k]`` has n elements, ``recv[k]`` W*n: ``recv[k][j*n:(j+1)*n] = send[j]``."""
        ...

    def broadcast(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        """In place: every ``bufs[k]`` becomes ``bufs[root]``."""
        ...

    # The rest has defaults in CommunicatorBase; callers call these, never probe for them.

    @property
    def lane_offset(self) -> int:
        """Global index of ``lanes[0]``: 0 in one process; ``process_rank * len(lanes)`` across processes."""
        ...

    def begin_bucket(self, marks: Sequence | None = None) -> None:
        """Before a bucket's collectives: communication streams wait for each lane's mark (an event;
        None: everything the lane queued). Default: nothing (collectives run on the lanes' streams)."""
        ...

    def join(self) -> None:
        """The lanes' streams wait for every collective issued so far. Default: nothing (they ran there)."""
        ...

    def wait(self) -> None:
        """The lanes' next use of the results waits for the last collective, also one that completes
        later than it is issued (a simulated link). Default: :meth:`join`."""
        ...

    def check_async_error(self) -> None:
        """Raise if queued work failed without an error at issue (watchdog)."""
        ...

    def abort(self, reason: str) -> bool:
        """End queued work that may never complete; True when it was ended."""
        ...

    def close(self) -> None:
        """Release what the communicator holds."""
        ...


class CommunicatorWrapper:
    """A communicator around ``inner`` (communication streams, a simulated link): every part of
    the protocol goes to ``inner`` unless the wrapper overrides it."""

    def __init__(self, inner: Communicator, name: str) -> None:
        self.inner = inner
        self.name = name
        self.lanes: list[Lane] = list(inner.lanes)

    @property
    def world(self) -> int:
        return self.inner.world

    @property
    def wire_bytes(self) -> int:
        return self.inner.wire_bytes

    @property
    def lane_offset(self) -> int:
        return self.inner.lane_offset

    def all_reduce(self, bufs: Sequence[Tensor]) -> None:
        self.inner.all_reduce(bufs)

    def reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self.inner.reduce_scatter(send, recv)

    def all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self.inner.all_gather(send, recv)

    def broadcast(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        self.inner.broadcast(bufs, root)

    def begin_bucket(self, marks: Sequence | None = None) -> None:
        self.inner.begin_bucket(marks)

    def join(self) -> None:
        self.inner.join()

    def wait(self) -> None:
        self.inner.wait()

    def check_async_error(self) -> None:
        self.inner.check_async_error()

    def abort(self, reason: str) -> bool:
        return self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


def ring_wire_bytes(op: str, world: int, numel: int, itemsize: int) -> int:
    """Bytes one lane puts on the wire for ``op`` under the ring algorithm.

    ``numel`` is the per-lane buffer for all_reduce / broadcast / reduce, the whole send
    buffer (W*n) for reduce_scatter and the whole receive buffer (W*n) for all_gather.
    Exact integer arithmetic (floor), so every communicator reports the same number.
    """
    return _RING_FACTOR[op] * (world - 1) * numel * itemsize // world


def ordered_sum(parts: Sequence[Tensor], out: Tensor) -> Tensor:
    """``out = ((parts[0] + parts[1]) + parts[2]) + ...``: the canonical order, returns ``out``.

    Elementwise, in the parts' dtype (bf16 rounds after every add), the one fold every dpq
    communicator uses, so the same bits on any device. Issued on the caller's current stream.
    ``out`` may be ``parts[0]`` itself (each element is read before it is written: in place).
    Where ``out`` overlaps any other part's memory, the fold runs into a fresh accumulator, copied
    into ``out`` last (``out`` is written after the first add while later parts are still to be read).
    """
    if len(parts) == 1:
        return out.copy_(parts[0])
    shared = any(_overlap(out, p) for p in parts[1:]) or (_overlap(out, parts[0]) and not _same_memory(out, parts[0]))
    acc = torch.empty_like(out) if shared else out
    torch.add(parts[0], parts[1], out=acc)
    for part in parts[2:]:
        acc.add_(part)
    return out.copy_(acc) if shared else out


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` may share bytes: exact byte ranges for contiguous tensors (views of
    one buffer side by side do not), the whole storage otherwise."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def chunk_bounds(numel: int, world: int) -> list[int]:
    """``world + 1`` offsets splitting ``numel`` elements into ``world`` contiguous chunks, sizes
    differing by at most one (the larger first): chunk ``c`` is ``[b[c], b[c + 1])``, owned by
    global lane ``c`` in an all_reduce."""
    size, extra = divmod(numel, world)
    return [c * size + min(c, extra) for c in range(world + 1)]


class CommunicatorBase:
    """Argument checks, wire-byte accounting and the world-1 shortcuts shared by all communicators.

    Subclasses implement ``_all_reduce``, ``_reduce_scatter``, ``_all_gather``, ``_broadcast``
    and ``_reduce``; those run only for world >= 2 and only after the buffers were checked,
    so they may assume one buffer per lane, equal sizes and dtypes, on the lanes' devices.
    """

    name = "base"
    # Contract 3: sums fold in global lane order (ordered_sum). A subclass that cannot sets
    # False and says why in order_note (the plan shows it).
    canonical_order = True
    order_note = "sums fold over the lanes in global lane order (canonical)"
    # The orders a kind can sum in (--parallel_order): "canonical" (contract 3) and, for the kinds that
    # can hand sums to NCCL's own reduce-scatter / all-reduce, "native" (ORDERS in dpq.planning.plan says each's cost)
    orders: tuple[str, ...] = ("canonical",)
    # What the plan and the session ask of a kind (dpq.comm.communicators: no name is tested elsewhere).
    # nccl: an NCCL communicator per lane set (the plan prices its buffers on every lane);
    # sends_to_peers: its collectives send to every other lane (an NCCL peer buffer each);
    # shares_handles: built with shared=True, its handles made once per device tuple per run;
    # setup_failure: what its set-up raises when it cannot start (the session then chooses again);
    # priority: among the NCCL kinds available here (available()), the plan takes the lowest for lanes on
    # distinct GPUs, saying chosen_because (formatted with the lane count ``world`` and the kind's ``name``).
    nccl = False
    priority = 100
    chosen_because = "{world} distinct GPUs: {name}"
    sends_to_peers = False
    shares_handles = False
    setup_failure: tuple[type[BaseException], ...] = ()
    # World 1 skips the collectives (nothing to exchange). The GPU smoke test sets this
    # False on an instance to push one-rank NCCL collectives through the real library.
    shortcut_world_one = True

    @classmethod
    def available(cls) -> bool:
        """Whether this kind can be built in this process (its library importable, its devices there)."""
        return True

    def __init__(self, lanes: Sequence[Lane]) -> None:
        if len(lanes) == 0:
            raise ValueError(f"dpq: {type(self).__name__} needs at least one lane")
        self.lanes: list[Lane] = list(lanes)
        self.wire_bytes = 0

    def _issues(self) -> bool:
        return self.world > 1 or not self.shortcut_world_one

    @property
    def world(self) -> int:
        """Ranks the collective spans (the lanes here; a process group spans more)."""
        return len(self.lanes)

    # -- the protocol --------------------------------------------------------------------

    def all_reduce(self, bufs: Sequence[Tensor]) -> None:
        n = self._check("all_reduce", "bufs", bufs)
        self._count("all_reduce", n, bufs[0].element_size())
        if self._issues():
            self._all_reduce(bufs)

    def reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = self._check("reduce_scatter", "recv", recv)
        self._check("reduce_scatter", "send", send, numel=self.world * n, dtype=recv[0].dtype)
        self._count("reduce_scatter", self.world * n, recv[0].element_size())
        if self._issues():
            self._reduce_scatter(send, recv)
        else:
            _copy_on_lane(recv[0], send[0], self.lanes[0])

    def all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = self._check("all_gather", "send", send)
        self._check("all_gather", "recv", recv, numel=self.world * n, dtype=send[0].dtype)
        self._count("all_gather", self.world * n, send[0].element_size())
        if self._issues():
            self._all_gather(send, recv)
        else:
            _copy_on_lane(recv[0], send[0], self.lanes[0])

    def broadcast(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        n = self._check("broadcast", "bufs", bufs)
        self._check_root("broadcast", root)
        self._count("broadcast", n, bufs[0].element_size())
        if self._issues():
            self._broadcast(bufs, root)

    def reduce(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        """In place on ``bufs[root]``: the sum over lanes; the other buffers keep their values.

        Not part of the protocol: the process-group communicator uses it to reduce inside
        the process before crossing processes.
        """
        n = self._check("reduce", "bufs", bufs)
        self._check_root("reduce", root)
        self._count("reduce", n, bufs[0].element_size())
        if self._issues():
            self._reduce(bufs, root)

    process_rank = 0  # this process's rank in a process group (one process: 0)

    @property
    def lane_offset(self) -> int:
        return self.process_rank * len(self.lanes)

    def begin_bucket(self, marks: Sequence | None = None) -> None:
        """Collectives run on the lanes' own streams, after what the lanes queued: nothing to wait for."""

    def join(self) -> None:
        """Collectives ran on the lanes' own streams: the lanes' later work is ordered after them."""

    def wait(self) -> None:
        self.join()

    def close(self) -> None:
        """Release communicator resources (nothing to release by default)."""

    def check_async_error(self) -> None:
        """Raise if queued work failed without an error at issue (module docstring: watchdog); default: nothing can."""

    def abort(self, reason: str) -> bool:
        """End queued work that may never complete; True when it was ended. Default: False (copies
        have no abort: they complete, or the device is stuck)."""
        return False

    # -- for subclasses ------------------------------------------------------------------

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        raise NotImplementedError

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        raise NotImplementedError

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        raise NotImplementedError

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        raise NotImplementedError

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        raise NotImplementedError

    def _count(self, op: str, numel: int, itemsize: int) -> None:
        self.wire_bytes += ring_wire_bytes(op, self.world, numel, itemsize)

    def _check_device(self, t: Tensor, lane: Lane) -> str | None:
        """None if ``t`` may be used as ``lane``'s buffer, else why not."""
        if t.device != lane.device and not (t.device.type == lane.device.type == "cpu"):
            return f"is on {t.device} but lane {lane.index} is on {lane.device}"
        return None

    def _check_root(self, op: str, root: int) -> None:
        # A rank index: the lane index in-process, the global lane index across processes.
        if not 0 <= root < self.world:
            raise ValueError(f"dpq: {self.name}.{op}: root {root} is not a rank (0..{self.world - 1})")

    def _check(
        self, op: str, what: str, bufs: Sequence[Tensor], numel: int | None = None, dtype: torch.dtype | None = None
    ) -> int:
        """Refuse anything the collectives cannot take; returns the per-lane element count.

        ``numel`` / ``dtype`` default to those of ``bufs[0]``.
        """
        where = f"dpq: {self.name}.{op}: {what}"
        if len(bufs) != len(self.lanes):
            raise ValueError(f"{where} has {len(bufs)} buffers for {len(self.lanes)} lanes (one per lane)")
        if not all(isinstance(t, Tensor) for t in bufs):
            raise TypeError(f"{where} must be tensors, got {[type(t).__name__ for t in bufs]}")
        numel = bufs[0].numel() if numel is None else numel
        dtype = bufs[0].dtype if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{where} has dtype {dtype}; supported: float32, bfloat16, uint8")
        for k, (t, lane) in enumerate(zip(bufs, self.lanes, strict=True)):
            problem = _layout_problem(t, numel, dtype) or self._check_device(t, lane)
            if problem:
                raise ValueError(f"{where}[{k}] {problem}")
        return numel


def _layout_problem(t: Tensor, numel: int, dtype: torch.dtype) -> str | None:
    if t.dim() != 1 or not t.is_contiguous():
        return f"must be 1-D and contiguous (shape {tuple(t.shape)})"
    if t.dtype != dtype:
        return f"has dtype {t.dtype}, expected {dtype}"
    if t.numel() != numel:
        return f"has {t.numel()} elements, expected {numel}"
    return None


def _copy_on_lane(dst: Tensor, src: Tensor, lane: Lane) -> None:
    with lane.issue():
        dst.copy_(src, non_blocking=True)
