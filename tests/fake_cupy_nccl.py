"""A recording fake of ``cupy.cuda.nccl``: enough of the API for CupyNcclCommunicator, no GPU.

Every call lands in ``FakeNccl.calls`` in issue order: ``("initAll", devices)``,
``("groupStart",)``, ``("groupEnd",)``, ``("destroy", rank)``, ``("abort", rank)`` and, for
collectives, a :class:`Call` with the arguments normalised to (op, rank, sendptr, recvptr,
count, dtype, root, stream) in the argument order of CuPy's ``NcclCommunicator`` methods.

Failure injection: ``FakeNccl.fail[(op, rank)] = status`` makes that rank's call (or
``("groupEnd", None)``) raise :class:`NcclError` with that status after recording it, as
CuPy's ``check_status`` does. Like CuPy, ``abort()`` and ``destroy()`` release a handle once:
after either, the other records nothing. ``get_version()`` returns ``FakeNccl.version_code``.
"""

from __future__ import annotations

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


class FakeComm:
    def __init__(self, nccl: FakeNccl, rank: int, device: int) -> None:
        self._nccl, self.rank, self.device = nccl, rank, device
        self.released = False  # CuPy sets _comm = 0 after destroy() or abort()

    def _record(self, op, sendptr, recvptr, count, dtype, root, stream) -> None:
        assert not self.released, f"rank {self.rank}'s communicator used after destroy/abort"
        self._nccl.calls.append(Call(op, self.rank, sendptr, recvptr, count, dtype, root, stream))
        status = self._nccl.fail.get((op, self.rank))
        if status is not None:
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
        self.fail: dict = {}
        self.version_code = version_code
        nccl = self

        class NcclCommunicator:
            @staticmethod
            def initAll(devices):
                assert isinstance(devices, list), "CuPy's initAll takes an int or a list of ints"
                nccl.calls.append(("initAll", list(devices)))
                multi_rank = nccl.version_code >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
                if len(set(devices)) < len(devices) and not multi_rank:
                    raise NcclError(NCCL_INVALID_USAGE)  # "Duplicate GPU detected"
                return [FakeComm(nccl, rank, dev) for rank, dev in enumerate(devices)]

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        self.calls.append(("groupStart",))

    def groupEnd(self):
        self.calls.append(("groupEnd",))
        status = self.fail.get(("groupEnd", None))
        if status is not None:
            raise NcclError(status)

    def get_version(self) -> int:
        return self.version_code


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
