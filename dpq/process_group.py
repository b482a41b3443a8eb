"""The ``torch.distributed`` process-group communicator: lanes of this process plus other processes.

Multi-process and multi-node runs (``torchrun``) compose with in-process lanes: P processes x L
lanes = world W, global lane order process rank major, local lane minor (DESIGN.md, contract 7).
The in-process legs use the communicator :func:`dpq.fallback_p2p.select_communicator` picks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpq.comm_base import CommunicatorBase
from dpq.fallback_p2p import select_communicator
from dpq.streams import Lane

__all__ = ["ProcessGroupCommunicator"]


class ProcessGroupCommunicator(CommunicatorBase):
    """Lanes of this process plus ``torch.distributed`` across processes (gloo / nccl / xccl / hccl).

    World: every process runs the same number L of lanes (checked at construction); global
    lane index ``g = process_rank * L + k``; ``world`` = L * processes, and the ``root`` of
    broadcast is a global lane index.

    all_reduce: ``inner.reduce`` onto lane 0, ``dist.all_reduce`` of lane 0's buffer (issued
    on lane 0's stream), ``inner.broadcast`` back. Across processes the summation order is
    the backend's, still identical on every rank. reduce_scatter and all_gather are
    fallbacks built on that all_reduce: reduce_scatter all-reduces a W*n copy of the send
    buffer and keeps its chunk; all_gather zeroes the receive buffer, writes its own chunk
    and all-reduces the raw bytes as uint8 (one non-zero contributor per byte, so the
    result is exact for any dtype, -0.0 and NaN payloads included). Their ``wire_bytes``
    are counted as what runs, an all_reduce of W*n elements: twice the ring
    reduce-scatter / all-gather bytes. ``inner.wire_bytes`` counts the in-process legs.
    """

    def __init__(
        self, lanes: Sequence[Lane], group: object | None = None, inner: CommunicatorBase | None = None
    ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "dpq: the process-group communicator needs torch.distributed initialised "
                "(launch with torchrun, or call torch.distributed.init_process_group first)"
            )
        super().__init__(lanes)
        self._dist = dist
        self.group = group
        self.inner = inner if inner is not None else select_communicator(self.lanes)[0]
        self.processes = dist.get_world_size(group)
        self.process_rank = dist.get_rank(group)
        self.name = f"pg-{dist.get_backend(group)}"
        self._check_same_lane_count()

    @property
    def world(self) -> int:
        return len(self.lanes) * self.processes

    def _check_same_lane_count(self) -> None:
        count = len(self.lanes)
        t = torch.tensor([count, -count], dtype=torch.int64, device=self.lanes[0].device)
        with self.lanes[0].issue():
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        most, fewest = int(t[0]), -int(t[1])
        if most != fewest:
            raise ValueError(
                f"dpq: every process must run the same number of lanes; they run {fewest}..{most} (this one {count})"
            )

    def _count(self, op: str, numel: int, itemsize: int) -> None:
        # The fallbacks run an all_reduce of the whole W*n buffer; count what runs.
        super()._count("all_reduce" if op in ("reduce_scatter", "all_gather") else op, numel, itemsize)

    def _global_rank(self, process: int) -> int:
        return process if self.group is None else self._dist.get_global_rank(self.group, process)

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        self.inner.reduce(bufs, root=0)
        with self.lanes[0].issue():
            self._dist.all_reduce(bufs[0], group=self.group)
        self.inner.broadcast(bufs, root=0)

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        full = []
        for s, lane in zip(send, self.lanes, strict=True):
            with lane.issue():
                full.append(s.clone())
        self._all_reduce(full)
        n, base = recv[0].numel(), self.process_rank * len(self.lanes)
        for k, (r, lane) in enumerate(zip(recv, self.lanes, strict=True)):
            with lane.issue():
                r.copy_(full[k][(base + k) * n : (base + k + 1) * n])

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        nbytes, base = send[0].numel() * send[0].element_size(), self.process_rank * len(self.lanes)
        raw = [r.view(torch.uint8) for r in recv]
        for k, (s, lane) in enumerate(zip(send, self.lanes, strict=True)):
            with lane.issue():
                raw[k].zero_()
                raw[k][(base + k) * nbytes : (base + k + 1) * nbytes].copy_(s.view(torch.uint8))
        self._all_reduce(raw)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        process, lane = divmod(root, len(self.lanes))
        if process == self.process_rank:
            self.inner.broadcast(bufs, root=lane)  # the root's data onto lane 0 (and the others)
        with self.lanes[0].issue():
            self._dist.broadcast(bufs[0], src=self._global_rank(process), group=self.group)
        self.inner.broadcast(bufs, root=0)

    def reduce(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        raise NotImplementedError("dpq: reduce is an in-process helper; a process group runs all_reduce")
