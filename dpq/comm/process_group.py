"""The ``torch.distributed`` process-group communicator: lanes of this process plus other processes.

Multi-process and multi-node runs (``torchrun``) compose with in-process lanes: P processes x L
lanes = world W, global lane order process rank major, local lane minor (DESIGN.md, contract 7):
global lane ``g = process_rank * L + k`` (:attr:`ProcessGroupCommunicator.lane_offset` is this
process's ``g`` of lane 0).

Canonical order (contract 3), so that 1 x W, P x L and W x 1 give the same bits: every sum is
folded by the chunk's *owner* over the W global lanes in global lane order
(:func:`dpq.comm.comm_base.ordered_sum`), exactly as the in-process communicators fold their lanes.
The owner receives every global lane's contribution to its chunk (an all-to-all): the other
processes' parts by point-to-point ``torch.distributed`` sends, this process's lanes' parts
read where they are (they never cross a wire). The results then travel as exact copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpq.comm.comm_base import CommunicatorBase, chunk_bounds, ordered_sum
from dpq.streams import Lane, copy_between, join

__all__ = ["ProcessGroupCommunicator"]

# (tensor, peer process index in the group, tag): one point-to-point message
_Message = tuple[Tensor, int, int]


class ProcessGroupCommunicator(CommunicatorBase):
    """Lanes of this process plus ``torch.distributed`` across processes (gloo / nccl / xccl / hccl).

    World: every process runs the same number L of lanes (checked at construction); global
    lane index ``g = lane_offset + k`` with ``lane_offset = process_rank * L``; ``world`` =
    L * processes, and the ``root`` of broadcast is a global lane index.

    The process's *place* is lane 0: it issues every ``torch.distributed`` call (under lane
    0's stream, after the lanes joined, R4), holds the staging buffer and folds the sums of
    this process's chunks. Lanes on another device than lane 0 are copied there first
    (CPU lanes and lanes sharing one GPU are read in place).

    * reduce_scatter (``send[k]`` = W chunks of n): this process owns chunks
      ``lane_offset .. lane_offset + L - 1``, one contiguous range. Each lane sends that
      range of its buffer to every other process (a point-to-point message of L*n, one
      per lane and peer, tag = local lane); the place folds, per element, the W
      contributions in global lane order, its own lanes' read in place; chunk k goes to
      ``recv[k]``.
    * all_reduce: the same with W chunks of sizes differing by at most one
      (:func:`dpq.comm.comm_base.chunk_bounds`: no zero padding is needed, because the
      chunks travel point to point, not through an equal-count collective), the sums
      written into lane 0's buffer, sent to every other process, then copied to the lanes.
    * all_gather: exact copies; each process sends its lanes' parts (one message of L*n)
      to every other process, lane 0's buffer receives, the lanes get copies.
    * broadcast: ``dist.broadcast`` of the root lane's buffer (exact copies).

    Wire bytes: ``wire_bytes`` counts, as every communicator does, the ring bytes of one lane
    (:func:`dpq.comm.comm_base.ring_wire_bytes`), and the canonical path moves exactly as many:
    each global lane sends every chunk but its own to that chunk's owner, (W-1)/W of the
    buffer, as a ring reduce-scatter does; the copies back are an all-gather's (W-1)/W.
    (In an all_reduce the lanes own chunks one element apart, so one lane may send up to
    W-1 elements more than another; the sum over lanes is exact.) Parts between lanes of
    one process are logical wire bytes here, as in every in-process communicator.
    ``p2p_bytes_sent`` counts what this process really handed to ``torch.distributed``
    point-to-point sends (reduce_scatter, all_reduce, all_gather): per lane (W - L)/W of a
    reduce-scatter, the rest being in-process reads. ``inner.wire_bytes`` counts the
    in-process copies of results (the ``inner`` communicator's broadcasts and copies).

    Backends: every transfer is ``P2POp`` + ``batch_isend_irecv`` (gloo and MPI: async
    sends and receives; NCCL, XCCL, HCCL: one coalesced group). Tested with gloo on CPU
    lanes; with ``nccl`` each process should run lanes on one GPU (ProcessGroupNCCL binds a
    rank to one device), which the place (lane 0) is. Not run on GPUs here.
    """

    def __init__(
        self, lanes: Sequence[Lane], *, inner: CommunicatorBase, group: object | None = None
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
        self.inner = inner
        self.processes = dist.get_world_size(group)
        self.process_rank = dist.get_rank(group)
        self.name = f"pg-{dist.get_backend(group)}"
        self.p2p_bytes_sent = 0
        self._check_same_lane_count()

    @property
    def world(self) -> int:
        return len(self.lanes) * self.processes

    def _check_same_lane_count(self) -> None:
        count = len(self.lanes)
        t = torch.tensor([count, -count], dtype=torch.int64, device=self.lanes[0].device)
        self.lanes[0].wait_for_current()  # R1: made on the current stream (lane 0 may be a communication lane)
        with self.lanes[0].issue():
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        self.lanes[0].current_waits_for_me()  # R2: read on the host below
        most, fewest = int(t[0]), -int(t[1])
        if most != fewest:
            raise ValueError(
                f"dpq: every process must run the same number of lanes; they run {fewest}..{most} (this one {count})"
            )

    def _global_rank(self, process: int) -> int:
        return process if self.group is None else self._dist.get_global_rank(self.group, process)

    def _others(self) -> list[int]:
        return [q for q in range(self.processes) if q != self.process_rank]

    # -- moving data ---------------------------------------------------------------------

    def _p2p(self, sends: Sequence[_Message], recvs: Sequence[_Message]) -> None:
        """Every message sent and received; returns when all have completed. Call under lane 0's
        stream context (NCCL-type backends order their work after it and ``wait`` orders it back).

        Zero-length messages are skipped on both sides (their sizes come from the same
        arithmetic on every process, so sender and receiver agree)."""
        dist = self._dist
        ops = [dist.P2POp(dist.isend, t, self._global_rank(q), self.group, tag) for t, q, tag in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, self._global_rank(q), self.group, tag) for t, q, tag in recvs if t.numel()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.p2p_bytes_sent += sum(t.numel() * t.element_size() for t, _, _ in sends)

    def _at_place(self, bufs: Sequence[Tensor]) -> list[Tensor]:
        """Every lane's buffer readable on lane 0's stream: in place where it is on lane 0's
        device (after the join), else a copy there. Call after :func:`dpq.streams.join` of the lanes."""
        home = self.lanes[0]
        out = list(bufs)
        moves = []
        for k, (b, lane) in enumerate(zip(bufs, self.lanes, strict=True)):
            if b.device != bufs[0].device:
                with home.issue():
                    out[k] = torch.empty_like(b, device=bufs[0].device)
                moves.append((out[k], home, b, lane))
        copy_between(moves)
        return out

    def _scatter_sum(self, bufs: Sequence[Tensor], bounds: Sequence[int]) -> Tensor:
        """The canonical sums of this process's chunks, one tensor on lane 0's device.

        ``bounds`` (W + 1 offsets) cut every buffer into the W global chunks; this process
        owns chunks ``lane_offset .. lane_offset + L - 1``, i.e. ``[bounds[base], bounds[base + L])``.
        Every element's W contributions are folded in global lane order by one
        :func:`ordered_sum` over the whole range (elementwise: the same bits as per chunk).
        """
        lanes, L, base = self.lanes, len(self.lanes), self.lane_offset
        lo, hi = bounds[base], bounds[base + L]
        join(lanes)  # R4: the lanes' writes of bufs are done before lane 0 reads or sends them
        parts = self._at_place(bufs)
        others = self._others()
        with lanes[0].issue():
            staging = torch.empty(len(others) * L, hi - lo, dtype=bufs[0].dtype, device=parts[0].device)
            row = {(q, k): i * L + k for i, q in enumerate(others) for k in range(L)}
            sends = [(p[bounds[q * L] : bounds[(q + 1) * L]], q, k) for q in others for k, p in enumerate(parts)]
            self._p2p(sends, [(staging[r], q, k) for (q, k), r in row.items()])
            contributions = [
                parts[k][lo:hi] if q == self.process_rank else staging[row[q, k]]
                for q in range(self.processes)
                for k in range(L)
            ]  # global lane order: process major, local lane minor
            return ordered_sum(contributions, torch.empty(hi - lo, dtype=bufs[0].dtype, device=parts[0].device))

    # -- collectives ---------------------------------------------------------------------

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n, home = recv[0].numel(), self.lanes[0]
        acc = self._scatter_sum(send, [g * n for g in range(self.world + 1)])
        lanes = zip(recv, self.lanes, strict=True)
        copy_between([(r, lane, acc[k * n : (k + 1) * n], home) for k, (r, lane) in enumerate(lanes)])

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        bounds, L = chunk_bounds(bufs[0].numel(), self.world), len(self.lanes)
        acc = self._scatter_sum(bufs, bounds)  # every read of bufs is queued on lane 0's stream
        mine = slice(bounds[self.lane_offset], bounds[self.lane_offset + L])
        with self.lanes[0].issue():
            bufs[0][mine].copy_(acc)
            others = self._others()
            theirs = [(bufs[0][bounds[q * L] : bounds[(q + 1) * L]], q, L) for q in others]
            self._p2p([(bufs[0][mine], q, L) for q in others], theirs)
        self.inner.broadcast(bufs, root=0)

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n, L, base, home = send[0].numel(), len(self.lanes), self.lane_offset, self.lanes[0]
        gathered = recv[0]
        copy_between([(gathered[(base + k) * n : (base + k + 1) * n], home, s, lane)
                       for k, (s, lane) in enumerate(zip(send, self.lanes, strict=True))])
        with home.issue():
            others = self._others()
            theirs = [(gathered[q * L * n : (q + 1) * L * n], q, 0) for q in others]
            self._p2p([(gathered[base * n : (base + L) * n], q, 0) for q in others], theirs)
        self.inner.broadcast(recv, root=0)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        process, lane = divmod(root, len(self.lanes))
        if process == self.process_rank:
            self.inner.broadcast(bufs, root=lane)  # the root's data onto lane 0 (and the others)
        with self.lanes[0].issue():
            self._dist.broadcast(bufs[0], src=self._global_rank(process), group=self.group)
        self.inner.broadcast(bufs, root=0)

    def reduce(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        raise TypeError("dpq: reduce is an in-process helper; across processes use all_reduce")

    def abort(self, reason: str) -> bool:
        """The watchdog's abort (``dpq.tune_loop``): the group's backend for the lanes' device type
        (ProcessGroupNCCL's ``abort()``, which aborts its NCCL communicators and so ends their queued
        kernels; the group's other backends, gloo for dpq's object collectives, stay), then the
        in-process communicator's. False where the backend has no abort (gloo: its work fails on
        its own at the group's timeout)."""
        device = self.lanes[0].device
        ended = False
        if device.type != "cpu":
            group = self.group if self.group is not None else self._dist.distributed_c10d._get_default_group()
            try:
                pg_backend = group._get_backend(device)
            except Exception:  # no backend for this device type
                pg_backend = None
            abort = getattr(pg_backend, "abort", None)
            if abort is not None:
                abort()
                ended = True
        return self.inner.abort(reason) or ended
