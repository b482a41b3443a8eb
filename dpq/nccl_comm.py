"""The Communicator protocol and the in-process NCCL communicators.

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

NCCL communicators here use one process driving several GPUs: communicators from
``ncclCommInitAll`` and every rank's call inside one ``groupStart/groupEnd``, which is the
only way a single thread can issue a collective to several ranks without deadlocking
(a lone rank's call would wait for its peers, which are never issued).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dpq.streams import Lane

__all__ = [
    "SUPPORTED_DTYPES",
    "Communicator",
    "CommunicatorBase",
    "CupyNcclCommunicator",
    "TorchNcclCommunicator",
    "cupy_nccl_available",
    "distinct_cuda_ids",
    "ring_wire_bytes",
    "torch_nccl_available",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)

# Bus-bytes factor per op: an all_reduce is a reduce-scatter plus an all-gather.
_RING_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "reduce": 1}

_DUPLICATE_GPU = "NCCL hangs when two ranks share a GPU; use the local communicator for lanes that share a device"


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


def ring_wire_bytes(op: str, world: int, numel: int, itemsize: int) -> int:
    """Bytes one lane puts on the wire for ``op`` under the ring algorithm.

    ``numel`` is the per-lane buffer for all_reduce / broadcast / reduce, the whole send
    buffer (W*n) for reduce_scatter and the whole receive buffer (W*n) for all_gather.
    Exact integer arithmetic (floor), so every communicator reports the same number.
    """
    return _RING_FACTOR[op] * (world - 1) * numel * itemsize // world


class CommunicatorBase:
    """Argument checks, wire-byte accounting and the world-1 shortcuts shared by all communicators.

    Subclasses implement ``_all_reduce``, ``_reduce_scatter``, ``_all_gather``, ``_broadcast``
    and ``_reduce``; those run only for world >= 2 and only after the buffers were checked,
    so they may assume one buffer per lane, equal sizes and dtypes, on the lanes' devices.
    """

    name = "base"

    def __init__(self, lanes: Sequence[Lane]) -> None:
        if len(lanes) == 0:
            raise ValueError(f"dpq: {type(self).__name__} needs at least one lane")
        self.lanes: list[Lane] = list(lanes)
        self.wire_bytes = 0

    @property
    def world(self) -> int:
        """Ranks the collective spans (the lanes here; a process group spans more)."""
        return len(self.lanes)

    # -- the protocol --------------------------------------------------------------------

    def all_reduce(self, bufs: Sequence[Tensor]) -> None:
        n = self._check("all_reduce", "bufs", bufs)
        self._count("all_reduce", n, bufs[0].element_size())
        if self.world > 1:
            self._all_reduce(bufs)

    def reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = self._check("reduce_scatter", "recv", recv)
        self._check("reduce_scatter", "send", send, numel=self.world * n, dtype=recv[0].dtype)
        self._count("reduce_scatter", self.world * n, recv[0].element_size())
        if self.world > 1:
            self._reduce_scatter(send, recv)
        else:
            _copy_on_lane(recv[0], send[0], self.lanes[0])

    def all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = self._check("all_gather", "send", send)
        self._check("all_gather", "recv", recv, numel=self.world * n, dtype=send[0].dtype)
        self._count("all_gather", self.world * n, send[0].element_size())
        if self.world > 1:
            self._all_gather(send, recv)
        else:
            _copy_on_lane(recv[0], send[0], self.lanes[0])

    def broadcast(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        n = self._check("broadcast", "bufs", bufs)
        self._check_root("broadcast", root)
        self._count("broadcast", n, bufs[0].element_size())
        if self.world > 1:
            self._broadcast(bufs, root)

    def reduce(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        """In place on ``bufs[root]``: the sum over lanes; the other buffers keep their values.

        Not part of the protocol: the process-group communicator uses it to reduce inside
        the process before crossing processes.
        """
        n = self._check("reduce", "bufs", bufs)
        self._check_root("reduce", root)
        self._count("reduce", n, bufs[0].element_size())
        if self.world > 1:
            self._reduce(bufs, root)

    def close(self) -> None:
        """Release communicator resources (nothing to release by default)."""

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


def distinct_cuda_ids(lanes: Sequence[Lane]) -> list[int]:
    """The CUDA device index of every lane; refuses non-CUDA lanes and shared GPUs (before any NCCL call)."""
    ids = []
    for lane in lanes:
        if lane.device.type != "cuda":
            raise ValueError(f"dpq: NCCL needs CUDA lanes; lane {lane.index} is on {lane.device}")
        ids.append(0 if lane.device.index is None else lane.device.index)
    if len(set(ids)) != len(ids):
        raise ValueError(f"dpq: lanes on cuda devices {ids} share a GPU: {_DUPLICATE_GPU}")
    return ids


# -- CuPy --------------------------------------------------------------------------------


def _import_cupy_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as e:  # cupy raises more than ImportError when CUDA libraries are missing
        raise RuntimeError(
            f"dpq: the cupy-nccl communicator needs CuPy with NCCL ({type(e).__name__}: {e}); "
            "install it with `pip install dpq[cuda12]` (or dpq[cuda13]), or use torch-nccl / p2p / host"
        ) from e
    if not getattr(nccl, "available", True):
        raise RuntimeError(
            "dpq: CuPy is installed but cannot load NCCL; install it with `pip install dpq[cuda12]` "
            "(or dpq[cuda13]), or use torch-nccl / p2p / host"
        )
    return nccl


def cupy_nccl_available() -> bool:
    """True when ``cupy.cuda.nccl`` imports and has found the NCCL library."""
    try:
        _import_cupy_nccl()
    except RuntimeError:
        return False
    return True


class CupyNcclCommunicator(CommunicatorBase):
    """NCCL through CuPy: ``NcclCommunicator.initAll(device_ids)``, one comm per lane (rank = lane index).

    Every collective is one ``groupStart()``, each rank's call on its lane's stream, one
    ``groupEnd()``; arguments are built before ``groupStart`` so a Python error cannot leave
    a half-issued group (which would hang the ranks already issued).
    """

    name = "cupy-nccl"

    def __init__(self, lanes: Sequence[Lane]) -> None:
        super().__init__(lanes)
        device_ids = distinct_cuda_ids(self.lanes)  # before any NCCL call: shared GPUs hang initAll
        self._nccl = _import_cupy_nccl()
        self._comms = list(self._nccl.NcclCommunicator.initAll(device_ids))

    def close(self) -> None:
        for comm in self._comms:
            comm.destroy()
        self._comms = []

    def _dtype(self, dtype: torch.dtype) -> int:
        name = {torch.float32: "NCCL_FLOAT32", torch.bfloat16: "NCCL_BFLOAT16", torch.uint8: "NCCL_UINT8"}[dtype]
        if not hasattr(self._nccl, name):
            raise TypeError(f"dpq: this CuPy's NCCL binding has no {name}; upgrade cupy for {dtype} collectives")
        return getattr(self._nccl, name)

    def _grouped(self, method: str, args_per_rank: list[tuple]) -> None:
        if not self._comms:
            raise RuntimeError("dpq: cupy-nccl communicator used after close()")
        calls = [getattr(comm, method) for comm in self._comms]
        self._nccl.groupStart()
        for call, lane, args in zip(calls, self.lanes, args_per_rank, strict=True):
            with lane.issue():
                call(*args)
        self._nccl.groupEnd()

    def _stream(self, k: int) -> int:
        return self.lanes[k].stream_handle

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        dt, n, op = self._dtype(bufs[0].dtype), bufs[0].numel(), self._nccl.NCCL_SUM
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("allReduce", [(ptrs[k], ptrs[k], n, dt, op, self._stream(k)) for k in range(self.world)])

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        dt, n, op = self._dtype(recv[0].dtype), recv[0].numel(), self._nccl.NCCL_SUM
        args = [(send[k].data_ptr(), recv[k].data_ptr(), n, dt, op, self._stream(k)) for k in range(self.world)]
        self._grouped("reduceScatter", args)

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        dt, n = self._dtype(send[0].dtype), send[0].numel()
        args = [(send[k].data_ptr(), recv[k].data_ptr(), n, dt, self._stream(k)) for k in range(self.world)]
        self._grouped("allGather", args)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        dt, n = self._dtype(bufs[0].dtype), bufs[0].numel()
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("broadcast", [(ptrs[k], ptrs[k], n, dt, root, self._stream(k)) for k in range(self.world)])

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        dt, n, op = self._dtype(bufs[0].dtype), bufs[0].numel(), self._nccl.NCCL_SUM
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("reduce", [(ptrs[k], ptrs[k], n, dt, op, root, self._stream(k)) for k in range(self.world)])


# -- torch.cuda.nccl ---------------------------------------------------------------------


def torch_nccl_available() -> bool:
    """True when this torch build carries NCCL (``torch.cuda.nccl``) and CUDA is usable.

    ``torch.cuda.nccl.is_available(tensors)`` also checks that the tensors are dense,
    contiguous and on distinct GPUs; the communicator's own checks and
    :func:`distinct_cuda_ids` already guarantee that, so the build check is what is left.
    """
    if not torch.cuda.is_available():
        return False
    import torch.cuda.nccl as tnccl

    return bool(tnccl.is_available([]))


class TorchNcclCommunicator(CommunicatorBase):
    """NCCL through ``torch.cuda.nccl`` (used where CuPy is absent).

    torch issues every rank's call inside one NCCL group itself and keeps its own cache of
    communicators per device list, so there is nothing to create or destroy here.
    """

    name = "torch-nccl"

    def __init__(self, lanes: Sequence[Lane]) -> None:
        super().__init__(lanes)
        distinct_cuda_ids(self.lanes)  # before any NCCL call: shared GPUs hang
        if not torch_nccl_available():
            raise RuntimeError("dpq: torch-nccl needs a torch build with CUDA and NCCL; use p2p or host")
        import torch.cuda.nccl as tnccl

        self._nccl = tnccl

    @property
    def _streams(self) -> list:
        return [lane.stream for lane in self.lanes]

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        self._nccl.all_reduce(list(bufs), streams=self._streams)

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._nccl.reduce_scatter(list(send), list(recv), streams=self._streams)

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._nccl.all_gather(list(send), list(recv), streams=self._streams)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        self._nccl.broadcast(list(bufs), root=root, streams=self._streams)

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        self._nccl.reduce(list(bufs), output=bufs[root], root=root, streams=self._streams)
