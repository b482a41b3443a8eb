"""A recording fake of ``cupy.cuda.nccl``: enough of the API for CupyNcclCommunicator, no GPU.

Every call lands in ``FakeNccl.calls`` in issue order: ``("initAll", devices)``,
``("groupStart",)``, ``("groupEnd",)``, ``("destroy", rank)``, ``("abort", rank)`` and, for
collectives and point-to-point calls, a :class:`Call` with the arguments normalised to (op,
rank, sendptr, recvptr, count, dtype, root, stream, peer) in the argument order of CuPy's
``NcclCommunicator`` methods (``send(sendbuf, count, datatype, peer, stream)``,
``recv(recvbuf, count, datatype, peer, stream)``; unused fields None).

Data: the buffers are CPU tensors standing in for GPU memory, so the fake moves real bytes
(``ctypes.memmove`` on the pointers) when the group ends, as NCCL runs a group's work after
``groupEnd``: ``send``/``recv`` are matched per (sender, receiver) pair in issue order (counts
and types must agree, every call must have its match: an unmatched one would hang NCCL and
fails here), ``allGather`` and ``broadcast`` copy. Every source is read before any destination
is written, and a receive range that overlaps a range read in the same group fails (NCCL runs
them concurrently). ``allReduce``, ``reduceScatter`` and ``reduce`` (dpq's ``--parallel_order native``)
sum as a ring would: chunk ``c`` (of W, or the root's whole buffer) folds the ranks starting after its
owner, ``c+1, c+2, ..., c`` (:func:`ring_order`), in the buffers' dtype; every rank gets the same bits,
which differ from the canonical order's (rank order) where the fold's order matters.

Failure injection: ``FakeNccl.fail[(op, rank)] = status`` makes that rank's call (or
``("groupEnd", None)``, or ``("initAll", None)``) raise :class:`NcclError` with that status after
recording it, as CuPy's ``check_status`` does. ``FakeNccl.async_error[rank] = status``: that
rank's ``check_async_error()`` (CuPy's wrapper of ``ncclCommGetAsyncError``) raises
:class:`NcclError` with it, as an asynchronous failure of queued work would; it is recorded as
``("check_async_error", rank)``. Like CuPy, ``abort()`` and ``destroy()`` release a handle once:
after either, the other records nothing. ``get_version()`` returns ``FakeNccl.version_code``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import types
from typing import NamedTuple

# ncclRedOp_t / ncclDataType_t, the values of cupy_backends/cuda/libs/nccl.pxd
NCCL_SUM = 0
NCCL_UINT8 = 1
NCCL_FLOAT32 = 7
NCCL_BFLOAT16 = 9
NCCL_INVALID_USAGE = 5  # ncclInvalidUsage
ITEMSIZE = {NCCL_UINT8: 1, NCCL_FLOAT32: 4, NCCL_BFLOAT16: 2}


class NcclError(RuntimeError):
    """Stands in for ``cupy.cuda.nccl.NcclError``."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"NCCL_ERROR {status}: fake NCCL failure")


class Call(NamedTuple):
    op: str
    rank: int
    sendptr: int
    recvptr: int
    count: int
    dtype: int
    root: int | None
    stream: int
    peer: int | None = None


class FakeComm:
    def __init__(self, nccl: FakeNccl, rank: int, device: int) -> None:
        self._nccl, self.rank, self.device = nccl, rank, device
        self.released = False  # CuPy sets _comm = 0 after destroy() or abort()

    def _record(self, op, sendptr, recvptr, count, dtype, root, stream, peer=None) -> None:
        assert not self.released, f"rank {self.rank}'s communicator used after destroy/abort"
        call = Call(op, self.rank, sendptr, recvptr, count, dtype, root, stream, peer)
        self._nccl.calls.append(call)
        self._nccl.pending.append(call)
        status = self._nccl.fail.get((op, self.rank))
        if status is not None:
            self._nccl.group_failed = True  # NCCL runs nothing of a group whose call failed
            raise NcclError(status)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM
        self._record("allReduce", sendbuf, recvbuf, count, datatype, None, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        assert op == NCCL_SUM
        self._record("reduce", sendbuf, recvbuf, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        assert op == NCCL_SUM
        self._record("reduceScatter", sendbuf, recvbuf, recvcount, datatype, None, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._record("allGather", sendbuf, recvbuf, count, datatype, None, stream)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._record("broadcast", sendbuff, recvbuff, count, datatype, root, stream)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._record("send", sendbuf, None, count, datatype, None, stream, peer)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._record("recv", None, recvbuf, count, datatype, None, stream, peer)

    def check_async_error(self):
        assert not self.released, f"rank {self.rank}'s communicator queried after destroy/abort"
        self._nccl.calls.append(("check_async_error", self.rank))
        status = self._nccl.async_error.get(self.rank)
        if status is not None:
            raise NcclError(status)

    def destroy(self):
        if not self.released:
            self.released = True
            self._nccl.calls.append(("destroy", self.rank))

    def abort(self):
        if not self.released:
            self.released = True
            self._nccl.calls.append(("abort", self.rank))


class FakeNccl(types.ModuleType):
    """Module-like stand-in for ``cupy.cuda.nccl``."""

    NCCL_SUM = NCCL_SUM
    NCCL_UINT8 = NCCL_UINT8
    NCCL_FLOAT32 = NCCL_FLOAT32
    NCCL_BFLOAT16 = NCCL_BFLOAT16
    available = True
    NcclError = NcclError

    def __init__(self, version_code: int = 22703) -> None:
        super().__init__("cupy.cuda.nccl")
        self.calls: list = []
        self.pending: list[Call] = []  # this group's calls, run at groupEnd
        self.group_failed = False
        self.fail: dict = {}
        self.async_error: dict = {}
        self.version_code = version_code
        nccl = self

        class NcclCommunicator:
            @staticmethod
            def initAll(devices):
                assert isinstance(devices, list), "CuPy's initAll takes an int or a list of ints"
                nccl.calls.append(("initAll", list(devices)))
                if ("initAll", None) in nccl.fail:
                    raise NcclError(nccl.fail[("initAll", None)])
                multi_rank = nccl.version_code >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
                if len(set(devices)) < len(devices) and not multi_rank:
                    raise NcclError(NCCL_INVALID_USAGE)  # "Duplicate GPU detected"
                return [FakeComm(nccl, rank, dev) for rank, dev in enumerate(devices)]

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        self.calls.append(("groupStart",))
        self.pending, self.group_failed = [], False

    def groupEnd(self):
        self.calls.append(("groupEnd",))
        pending, self.pending = self.pending, []
        status = self.fail.get(("groupEnd", None))
        if status is not None:
            raise NcclError(status)
        if not self.group_failed:
            _run(pending)

    def get_version(self) -> int:
        return self.version_code


def _transfers(pending: list[Call]) -> list[tuple[int, int, int]]:
    """(src ptr, dst ptr, nbytes) of a group's calls; asserts what NCCL would hang or fail on."""
    moves = []
    sends: dict[tuple[int, int], list[Call]] = {}
    for c in pending:
        if c.op == "send":
            sends.setdefault((c.rank, c.peer), []).append(c)
    by_rank = {c.rank: c for c in pending}
    for c in pending:
        nbytes = c.count * ITEMSIZE[c.dtype]
        if c.op == "recv":
            queue = sends.get((c.peer, c.rank))
            assert queue, f"rank {c.rank} receives from {c.peer}, which sends nothing more: NCCL would hang"
            s = queue.pop(0)
            assert (s.count, s.dtype) == (c.count, c.dtype), f"send {s} and recv {c} disagree"
            moves.append((s.sendptr, c.recvptr, nbytes))
        elif c.op == "allGather":
            moves += [(by_rank[j].sendptr, c.recvptr + j * nbytes, nbytes) for j in sorted(by_rank)]
        elif c.op == "broadcast":
            moves.append((by_rank[c.root].sendptr, c.recvptr, nbytes))
    left = [c for queue in sends.values() for c in queue]
    assert not left, f"sends nobody receives: {left} (NCCL would hang)"
    return moves


TORCH_DTYPES = {NCCL_UINT8: "uint8", NCCL_FLOAT32: "float32", NCCL_BFLOAT16: "bfloat16"}


def ring_order(owner: int, world: int) -> list[int]:
    """The ranks in the order a ring reduce-scatter folds chunk ``owner``: starting after its owner."""
    return [(owner + 1 + i) % world for i in range(world)]


def _memory(ptr: int, count: int, dtype: int):
    """``count`` elements at ``ptr`` as a tensor over that memory (a CPU tensor stands in for the GPU's)."""
    import torch

    buf = (ctypes.c_char * (count * ITEMSIZE[dtype])).from_address(ptr)
    return torch.frombuffer(buf, dtype=getattr(torch, TORCH_DTYPES[dtype]), count=count)


def _ring_sum(parts: list, owner: int):
    order = ring_order(owner, len(parts))
    acc = parts[order[0]].clone()
    for r in order[1:]:
        acc.add_(parts[r])
    return acc


def _reductions(pending: list[Call]) -> list[tuple[int, int, bytes]]:
    """(dst ptr, nbytes, payload) of a group's reductions, every sum taken before any is written."""
    import torch

    out = []
    for op in ("reduceScatter", "allReduce", "reduce"):
        calls = sorted((c for c in pending if c.op == op), key=lambda c: c.rank)
        if not calls:
            continue
        world, n, dt = len(calls), calls[0].count, calls[0].dtype
        assert all((c.count, c.dtype) == (n, dt) for c in calls), f"{op}: ranks disagree on count or type"
        isz = ITEMSIZE[dt]
        if op == "reduceScatter":
            for c in calls:
                parts = [_memory(s.sendptr + c.rank * n * isz, n, dt) for s in calls]
                out.append((c.recvptr, n * isz, _ring_sum(parts, c.rank).view(torch.uint8).numpy().tobytes()))
        elif op == "allReduce":
            size, extra = divmod(n, world)
            bounds = [k * size + min(k, extra) for k in range(world + 1)]
            for k in range(world):
                lo, m = bounds[k], bounds[k + 1] - bounds[k]
                if not m:
                    continue
                chunk = _ring_sum([_memory(s.sendptr + lo * isz, m, dt) for s in calls], k)
                total = chunk.view(torch.uint8).numpy().tobytes()
                out += [(c.recvptr + lo * isz, m * isz, total) for c in calls]
        else:
            root = calls[0].root
            total = _ring_sum([_memory(s.sendptr, n, dt) for s in calls], root).view(torch.uint8).numpy().tobytes()
            out.append((calls[root].recvptr, n * isz, total))
    return out


def _run(pending: list[Call]) -> None:
    """Run a group's transfers and reductions: every source read before any destination is written."""
    sums = _reductions(pending)
    for dst, n, data in sums:
        ctypes.memmove(dst, data, n)
    moves = [(src, dst, n) for src, dst, n in _transfers(pending) if src != dst and n]
    for _, dst, n in moves:
        for other, _, m in moves:
            assert dst + n <= other or other + m <= dst, "a receive overlaps a buffer read in the same group"
    payloads = [ctypes.string_at(src, n) for src, _, n in moves]
    for (_, dst, n), data in zip(moves, payloads, strict=True):
        ctypes.memmove(dst, data, n)


def install(monkeypatch, version_code: int = 22703) -> FakeNccl:
    """Put a fresh fake at ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` for one test."""
    nccl = FakeNccl(version_code)
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return nccl
