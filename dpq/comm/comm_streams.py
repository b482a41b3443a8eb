"""A second stream per lane for the exchange, so a bucket's collective runs beside the rest of the backward.

With overlap on (:meth:`dpq.engine.exchange._Exchange.during_backward`) a bucket's collective is issued
while autograd still queues the block's earlier layers' backward kernels on each lane's stream.
Queued on that same stream (the default), the collective and every kernel after it run one after
another: the exchange is interleaved with the backward, not hidden under it. :class:`CommStreams`
runs the communicator (and the exchange's own pack/unpack ops, which run under ``comm.lanes``)
on a communication lane per compute lane: same device, its own stream (:func:`comm_lanes`).

Invariants, next to the code that keeps them (rule R4 of ``dpq.streams`` for two streams of one
lane; ``tests/test_comm_streams.py`` checks them with the CPU stream-order checker):

C1  Before a bucket's exchange (:meth:`CommStreams.begin_bucket`, called by
    ``_Exchange.exchange_bucket``), each communication stream waits for its compute lane's
    stream: the bucket's gradients were accumulated there. With the marks of an overlapped
    backward (``dpq.engine.exchange``: on accelerator lanes, each lane's event recorded when its part of
    the bucket was final) it waits for that event only; without, for everything the compute lane
    queued so far (recorded when the bucket is complete, so it covers the bucket; it may also
    cover later backward kernels already queued: conservative; an observer may ask for this wait
    instead of the marks, ``Observer.bucket_waits`` in ``dpq.engine.phases``: the GPU check's
    diagnosis).
C2  The compute lanes wait for their communication streams only when the exchange ends
    (:meth:`CommStreams.wait`: ``_Exchange.wait`` at the end of the iteration's exchange), not
    per collective: a wait queued mid-backward would hold the rest of that lane's backward
    behind the collective, which is what this avoids. The step, the next ``attach`` (zeroing)
    and the next backward run after it.
C3  Memory: the gradient buckets live for the run (made on the compute streams, used on both,
    every use ordered by C1/C2); the sign path's scratch is made and used on the communication
    streams only (``sign_groups`` over ``comm.lanes``). Nothing is freed between a use on one
    stream and the join.
C4  Teardown, also on failure: :meth:`join` (C2 for whatever was issued) before the session's
    ``ReplicaSet.close`` joins the compute lanes with the current stream (R5).

In one process and across processes (the session builds the process-group communicator over the
communication lanes: its place, staging and ``torch.distributed`` calls are on communication lane
0's stream; the engine's gathered losses keep C1/C2 too), only where lanes have streams
(accelerators; on CPU streams are no-ops and it would change nothing). Not run on a GPU: the
ordering is checked on CPU with logical streams and the timeline model, the overlap itself is
not measured.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpq.comm.comm_base import CommunicatorWrapper
from dpq.streams import Lane

__all__ = ["CommStreams", "comm_lanes"]


def comm_lanes(lanes: Sequence[Lane]) -> list[Lane]:
    """A communication lane per lane: same index and device, its own stream (the run's, as every lane's:
    ``dpq.streams``; None where the lane has none)."""
    seen: dict = {}
    out = []
    for lane in lanes:
        stream = None
        if lane.stream is not None:
            key = (lane.device.type, lane.device.index or 0)
            seen[key] = n = seen.get(key, -1) + 1
            stream = lane.backend.run_stream(lane.device, ("comm", n))
        out.append(Lane(index=lane.index, device=lane.device, stream=stream))
    return out


class CommStreams(CommunicatorWrapper):
    """A communicator over :func:`comm_lanes` whose collectives run beside the compute lanes'
    work (module docstring: C1-C4). ``inner`` is built over the communication lanes; ``compute``
    are the lanes the replicas and gradient buckets live on, in the same order. The collectives
    themselves are ``inner``'s; the joins around them are this class's."""

    SUFFIX = "+comm-streams"  # its name: the inner communicator's and this

    def __init__(self, inner, compute: Sequence[Lane]) -> None:
        if len(inner.lanes) != len(compute):
            raise ValueError(f"dpq: {len(inner.lanes)} communication lanes for {len(compute)} lanes")
        super().__init__(inner, inner.name + self.SUFFIX)
        self.compute = list(compute)

    def begin_bucket(self, marks=None) -> None:
        """C1: each communication stream waits for its compute lane's mark (``marks[k]``, an event
        of that lane's stream), or where it has none for everything the compute lane queued."""
        for k, (comm, lane) in enumerate(zip(self.lanes, self.compute, strict=True)):
            mark = marks[k] if marks is not None else None
            if mark is not None:
                comm.waits(mark)
            else:
                comm.wait_for(lane)

    def wait(self) -> None:
        """C2: the compute lanes' later work runs after every collective issued so far."""
        self.inner.wait()  # a simulated link: until its last collective completed
        self.join()

    def join(self) -> None:
        """C2 without waiting for a simulated link: the compute lanes wait for the communication streams."""
        for lane, comm in zip(self.compute, self.lanes, strict=True):
            lane.wait_for(comm)

    def close(self) -> None:
        self.join()
        self.inner.close()
