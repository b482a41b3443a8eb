"""A recording fake of ``cupy.cuda.nccl``: enough of the API for CupyNcclCommunicator, no GPU.

Every call lands in ``FakeNccl.calls`` in issue order: ``("initAll", devices)``,
``("groupStart",)``, ``("groupEnd",)``, ``("destroy", rank)`` and, for collectives, a
:class:`Call` with the arguments normalised to (op, rank, sendptr, recvptr, count, dtype,
root, stream) in the argument order of CuPy's ``NcclCommunicator`` methods.
"""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

# ncclRedOp_t / ncclDataType_t, the values of cupy_backends/cuda/libs/nccl.pxd
NCCL_SUM = 0
NCCL_UINT8 = 1
NCCL_FLOAT32 = 7
NCCL_BFLOAT16 = 9


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

    def _record(self, op, sendptr, recvptr, count, dtype, root, stream) -> None:
        self._nccl.calls.append(Call(op, self.rank, sendptr, recvptr, count, dtype, root, stream))

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
        self._nccl.calls.append(("destroy", self.rank))


class FakeNccl(types.ModuleType):
    """Module-like stand-in for ``cupy.cuda.nccl``."""

    NCCL_SUM = NCCL_SUM
    NCCL_UINT8 = NCCL_UINT8
    NCCL_FLOAT32 = NCCL_FLOAT32
    NCCL_BFLOAT16 = NCCL_BFLOAT16
    available = True

    def __init__(self) -> None:
        super().__init__("cupy.cuda.nccl")
        self.calls: list = []
        nccl = self

        class NcclCommunicator:
            @staticmethod
            def initAll(devices):
                assert isinstance(devices, list), "CuPy's initAll takes an int or a list of ints"
                nccl.calls.append(("initAll", list(devices)))
                return [FakeComm(nccl, rank, dev) for rank, dev in enumerate(devices)]

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        self.calls.append(("groupStart",))

    def groupEnd(self):
        self.calls.append(("groupEnd",))


def install(monkeypatch) -> FakeNccl:
    """Put a fresh fake at ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` for one test."""
    nccl = FakeNccl()
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return nccl
