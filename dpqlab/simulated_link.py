"""A communicator that does the real sums and completes each collective after a modelled link time.

For CPU benchmarks and tests of overlap and of ``auto``'s cost model: no real interconnect is
needed to see what a slow link does to an iteration.

``SimulatedLink(inner, bandwidth_GBps=..., latency_s=...)`` wraps a real communicator (e.g.
:class:`dpq.fallback_p2p.LocalCommunicator`). Each collective:

1. runs on ``inner`` at once (the real sums, in ``inner``'s canonical order: results are
   bitwise ``inner``'s), on the calling thread;
2. occupies the link for ``latency_s + bytes / bandwidth`` of wall time, ``bytes`` being the
   ring wire bytes one lane puts on the wire (``inner.wire_bytes`` grows by exactly that), and
   the link carries one collective at a time, in issue order, like one communication stream:
   a collective starts when it is issued or when the previous one completes, whichever is
   later;
3. completes at the end of that time: a timer thread sets the collective's event then.

The issuing thread never blocks in a collective. Work that reads a result later waits for its
event, as a stream would: :meth:`wait` (the lanes' next use of the grads: dpq's exchange calls
it before the step) blocks until the last collective issued has completed. Waiting is
``threading.Event.wait``, which releases the GIL, and the timer thread sleeps in a condition
variable until the next deadline, so neither holds the GIL or a core while the link is busy.
Collectives issued back to back inside one exchange (the sign path's reduce-scatter, the
packing of its result, the all-gather) are chained on the link's timeline without a host
wait: the packing reads results that are already in memory, and its (tiny) time counts as
part of the link's, as the kernels queued between two collectives on one stream would.

Not modelled: contention between lanes' links (every lane's link runs at ``bandwidth``, the
per-lane bus bandwidth NCCL reports), compute slowed by communication, and anything of the
real transport (the sums cost what ``inner`` costs on the host).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence

from torch import Tensor

from dpq.comm.comm_base import Communicator, CommunicatorWrapper

__all__ = ["Completion", "SimulatedLink"]


class Completion:
    """One collective on the simulated link: ``done_at`` (``time.perf_counter()`` seconds) and the
    event the timer thread sets then."""

    __slots__ = ("done_at", "event", "nbytes", "op")

    def __init__(self, op: str, nbytes: int, done_at: float) -> None:
        self.op, self.nbytes, self.done_at = op, nbytes, done_at
        self.event = threading.Event()

    def wait(self) -> None:
        """Block until ``done_at``. The waiter sleeps until then itself (one wake-up, not the timer
        thread's and then this one's: on a loaded machine each wake-up can come late)."""
        while (left := self.done_at - time.perf_counter()) > 0:
            self.event.wait(left)

    def done(self) -> bool:
        return self.event.is_set() or time.perf_counter() >= self.done_at


class _Timer:
    """One daemon thread that sets events at their deadlines (a heap; sleeps until the next)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Completion]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="dpq-simulated-link", daemon=True)
        self._thread.start()

    def add(self, c: Completion) -> None:
        with self._cv:
            heapq.heappush(self._heap, (c.done_at, next(self._seq), c))
            if self._heap[0][2] is c:
                # Only a new earliest deadline needs the thread awake sooner. The link completes in
                # issue order, so usually the thread already sleeps until an earlier deadline and
                # is left alone: no wake-up (GIL hand-off, core switch) per collective issued.
                self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                now = time.perf_counter()
                while self._heap and self._heap[0][0] <= now:
                    heapq.heappop(self._heap)[2].event.set()
                if self._heap:
                    self._cv.wait(self._heap[0][0] - now)
                else:
                    self._cv.wait()
            for _, _, c in self._heap:  # closing: nothing may wait forever
                c.event.set()
            self._heap.clear()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()


class SimulatedLink(CommunicatorWrapper):
    """A :class:`dpq.comm.comm_base.Communicator` over ``inner`` whose collectives complete after
    ``latency_s + wire bytes / (bandwidth_GBps * 1e9)`` seconds on a one-at-a-time link (module
    docstring). World 1 (no wire bytes): complete at once, no latency."""

    def __init__(self, inner: Communicator, *, bandwidth_GBps: float, latency_s: float = 0.0) -> None:
        if bandwidth_GBps <= 0 or latency_s < 0:
            raise ValueError(f"dpq: a simulated link needs bandwidth > 0 and latency >= 0, got "
                             f"{bandwidth_GBps} GB/s and {latency_s} s")
        super().__init__(inner, f"simulated({inner.name})")
        self.bandwidth_Bps = bandwidth_GBps * 1e9
        self.latency_s = latency_s
        self.collectives = 0
        self.busy_s = 0.0  # link time of every collective so far
        self.last: Completion | None = None
        self._free_at = 0.0
        self._timer: _Timer | None = None

    def link_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    # -- the protocol ------------------------------------------------------------------------

    def all_reduce(self, bufs: Sequence[Tensor]) -> None:
        self._run("all_reduce", self.inner.all_reduce, bufs)

    def reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._run("reduce_scatter", self.inner.reduce_scatter, send, recv)

    def all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._run("all_gather", self.inner.all_gather, send, recv)

    def broadcast(self, bufs: Sequence[Tensor], root: int = 0) -> None:
        self._run("broadcast", self.inner.broadcast, bufs, root)

    def _run(self, op: str, fn, *args) -> None:
        before = self.inner.wire_bytes
        fn(*args)  # the real collective, now, on this thread
        nbytes = self.inner.wire_bytes - before
        if nbytes == 0:
            return
        start = max(time.perf_counter(), self._free_at)
        seconds = self.link_seconds(nbytes)
        c = Completion(op, nbytes, start + seconds)
        self._free_at = c.done_at
        self.collectives += 1
        self.busy_s += seconds
        if self._timer is None:
            self._timer = _Timer()
        self._timer.add(c)
        self.last = c

    # -- completion ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Block (GIL released) until every collective issued so far has completed."""
        if self.last is not None:
            self.last.wait()
        self.inner.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self.inner.close()

    def __del__(self) -> None:  # a forgotten close must not leave the thread sleeping forever
        timer = getattr(self, "_timer", None)
        if timer is not None:
            try:
                timer.stop()
            except Exception:
                pass
