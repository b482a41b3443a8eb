"""Communicators without in-process NCCL: local, peer copies, host staging, XPU copies.

Which communicator a run's lanes use is :mod:`dpq.comm.communicators`' job; the NCCL ones are in
:mod:`dpq.nccl_comm`, the torch.distributed process-group one in :mod:`dpq.comm.process_group`.

Local, peer-copy, host-staged and xpu-copy communicators share one algorithm
(:class:`_RootReduce`): bring every lane's buffer to one *place* (lane 0's device, or host
memory), sum there in lane order (``((b0 + b1) + b2) + ...`` in the buffer dtype, one
accumulator, as NCCL does for one rank's chunk), then copy that one result out to every
lane. Every lane receives a copy of the same accumulator, so results are bitwise identical
across lanes, and the fixed order makes them repeatable run to run.

Cross-stream invariant (what keeps these communicators correct on accelerators): every
copy between two lanes' memory is bracketed by :func:`dpq.streams.join` of the lanes involved, before
and after, and runs inside both lanes' stream contexts. So a buffer is read only after the
work its owner lane queued before the collective; a lane's later work runs after the data
written into its buffers arrived; and no buffer - nor a staging block that the caching
allocator hands out on the root's stream - is written while queued work still uses it.
torch makes cross-device copies barrier on the two devices' *current* streams, which is
why both lanes' contexts are entered; lanes that share a device (separate streams) get
their ordering only from the joins. Copies through the host are issued on the owning
lane's stream, and the host waits for device-to-host copies before it sums (the one host
sync these fallbacks need). On CPU streams are None: joins are no-ops and copies are
synchronous, so the same code (copies included) runs in tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from dpq.comm.comm_base import CommunicatorBase, ordered_sum
from dpq.streams import Lane, backend, copy_between, device_key, join, unique_lanes

__all__ = ["HostStagedCommunicator", "LocalCommunicator", "PeerCopyCommunicator", "XpuCopyCommunicator"]

_HOST = None  # a place index meaning host memory (device places are lane indices)


def _copy_to_host(moves: Sequence[tuple[Tensor, Tensor, Lane]]) -> None:
    """Device-to-host copies on the source lanes' streams; returns when they have landed."""
    for dst, src, lane in moves:
        with lane.issue():
            dst.copy_(src, non_blocking=True)
    for lane in unique_lanes(lane for _, _, lane in moves):
        lane.synchronize()  # the host reads these next: the one host sync of the staged path


def _copy_from_host(moves: Sequence[tuple[Tensor, Tensor, Lane]]) -> None:
    """Host-to-device copies on the destination lanes' streams (no host wait)."""
    for dst, src, lane in moves:
        with lane.issue():  # pinned src: torch's host allocator keeps it alive until the copy ran
            dst.copy_(src, non_blocking=True)


Move = tuple[Tensor, int | None, Tensor, int | None]  # (dst, dst place, src, src place); None = host


class _RootReduce(CommunicatorBase):
    """Gather at a place, sum there in lane order, copy the one result out (module docstring)."""

    place: int | None = 0  # lane index whose device holds the sums, or _HOST
    copies_to_place = True  # False: the place reads lanes' buffers where they are (same device)

    def __init__(self, lanes: Sequence[Lane]) -> None:
        super().__init__(lanes)
        # Pinned host memory lets device<->host copies run async; CPU lanes have nothing to pin for.
        self._pin = next((be for be in (backend(lane.device) for lane in self.lanes) if be.accelerator), None)

    # -- moving data ---------------------------------------------------------------------

    def _issue_at(self, place: int | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if place is _HOST else self.lanes[place].issue()

    def _empty_at(self, place: int | None, numel: int, dtype: torch.dtype) -> Tensor:
        if place is _HOST:
            return torch.empty(numel, dtype=dtype) if self._pin is None else self._pin.pinned_empty(numel, dtype)
        with self.lanes[place].issue():  # allocated for (and owned by) that lane's stream
            return torch.empty(numel, dtype=dtype, device=self.lanes[place].device)

    def _move(self, moves: Sequence[Move]) -> None:
        """``dst <- src`` for every move, ordered against both ends (module docstring)."""
        lane = self.lanes
        copy_between([(d, lane[dp], s, lane[sp]) for d, dp, s, sp in moves if dp is not _HOST and sp is not _HOST])
        _copy_to_host([(d, s, lane[sp]) for d, dp, s, sp in moves if dp is _HOST and sp is not _HOST])
        _copy_from_host([(d, s, lane[dp]) for d, dp, s, sp in moves if sp is _HOST and dp is not _HOST])

    def _fetch(self, srcs: Sequence[Tensor]) -> list[Tensor]:
        """Every lane's buffer readable at the place, in lane order."""
        if not self.copies_to_place:
            join(self.lanes)  # the place reads the lanes' own buffers on its stream
            return list(srcs)
        parts = [
            src if k == self.place else self._empty_at(self.place, src.numel(), src.dtype) for k, src in enumerate(srcs)
        ]
        self._move([(parts[k], self.place, srcs[k], k) for k in range(len(srcs)) if k != self.place])
        return parts

    def _sum(self, srcs: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
        """Sum of ``srcs`` in lane order, into ``out`` (a tensor at the place) or a fresh one."""
        parts = self._fetch(srcs)
        acc = self._empty_at(self.place, parts[0].numel(), parts[0].dtype) if out is None else out
        with self._issue_at(self.place):
            return ordered_sum(parts, acc)  # out may be parts[0] (in place)

    def _finish(self) -> None:
        # Lanes must not touch buffers the place read or wrote on its stream until it is done.
        if self.place is not _HOST:
            join(self.lanes)

    def _own_out(self, bufs: Sequence[Tensor], k: int) -> Tensor | None:
        """``bufs[k]`` when it can be the accumulator in place (it lives at the place)."""
        return bufs[k] if k == self.place else None

    # -- collectives ---------------------------------------------------------------------

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        acc = self._sum(bufs, out=self._own_out(bufs, 0))
        self._move([(bufs[k], k, acc, self.place) for k in range(self.world) if bufs[k] is not acc])
        self._finish()

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        acc = self._sum(bufs, out=self._own_out(bufs, root))
        if acc is not bufs[root]:
            self._move([(bufs[root], root, acc, self.place)])
        self._finish()

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        acc, n = self._sum(send), recv[0].numel()
        self._move([(recv[k], k, acc[k * n : (k + 1) * n], self.place) for k in range(self.world)])
        self._finish()

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = send[0].numel()
        gathered = recv[0] if self.place == 0 else self._empty_at(self.place, self.world * n, send[0].dtype)
        self._move([(gathered[j * n : (j + 1) * n], self.place, send[j], j) for j in range(self.world)])
        self._move([(recv[k], k, gathered, self.place) for k in range(self.world) if recv[k] is not gathered])
        self._finish()

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        src, src_place = bufs[root], root
        if self.place is _HOST:
            src, src_place = self._empty_at(_HOST, bufs[root].numel(), bufs[root].dtype), _HOST
            self._move([(src, _HOST, bufs[root], root)])
        self._move([(bufs[k], k, src, src_place) for k in range(self.world) if k != root])
        self._finish()


class LocalCommunicator(_RootReduce):
    """Lanes that share one device (several CPU lanes, or several lanes on one GPU).

    Lane 0's stream sums the other lanes' buffers where they are (no staging copy); the
    result is copied to the other lanes.
    """

    name = "local"
    copies_to_place = False

    def __init__(self, lanes: Sequence[Lane]) -> None:
        super().__init__(lanes)
        devices = {device_key(lane.device) for lane in self.lanes}
        if len(devices) != 1:
            raise ValueError(
                f"dpq: the local communicator needs lanes on one device, got {sorted(map(str, devices))}; "
                "use p2p or host for lanes on different devices"
            )

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        # Every buffer is on the place's device: sum each chunk straight into its lane's
        # recv buffer (same lane order per element as the generic path, so the same bits),
        # with no W*n accumulator and no copy out.
        parts, n = self._fetch(send), recv[0].numel()
        with self._issue_at(self.place):
            for k, out in enumerate(recv):
                ordered_sum([p[k * n : (k + 1) * n] for p in parts], out)
        self._finish()


class PeerCopyCommunicator(_RootReduce):
    """Lanes on different devices: direct device-to-device copies to lane 0's device, sums there, copies back.

    With peer access (``backend.can_access_peer``) the copies go GPU to GPU; without it the
    runtime stages them, and :class:`HostStagedCommunicator` is the better choice. Copies
    into lane 0 run concurrently on the source lanes' streams; copies back run on lane 0's
    stream. Works for lanes that share a device too, and for CPU lanes (tests).
    """

    name = "p2p"


class XpuCopyCommunicator(PeerCopyCommunicator):
    """Intel XPU lanes: the peer-copy path.

    oneCCL has no in-process multi-device API (no ``ncclCommInitAll`` / group-call
    equivalent: one rank per process), so several XPUs in one process exchange through
    device-to-device copies to lane 0's device, summed there in lane order.
    """

    name = "xpu-copy"

    def __init__(self, lanes: Sequence[Lane]) -> None:
        super().__init__(lanes)
        others = sorted({str(lane.device) for lane in self.lanes if lane.device.type != "xpu"})
        if others:
            raise ValueError(f"dpq: the xpu-copy communicator is for xpu lanes; got {', '.join(others)}")


class HostStagedCommunicator(_RootReduce):
    """Any lanes: device-to-host copies into (pinned) host buffers, sums on the host in lane order, copies back.

    Pinned only when some lane is an accelerator; CPU lanes use plain buffers and still go
    through the staging copies. The host waits for the device-to-host copies before it
    sums: unlike the other communicators this one syncs the host once per collective.
    """

    name = "host"
    place = _HOST
