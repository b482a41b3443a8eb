"""The iteration deadline, owned by a thread that is not the issuing one (torch DDP's watchdog pattern).

The tune loop's own waits check their deadline themselves (the readback polls its events against
``--parallel_timeout``: :func:`dpq.streams.wait_events`). That covers a wait the issuing thread is
in, not the thread itself: on a GPU it can block inside a CUDA or NCCL call (a synchronize, an
allocation, a communicator's set-up) where no Python check runs, and nothing would ever stop it.
:class:`IterationWatchdog` is a daemon thread that holds each iteration's deadline instead.

Note (the invariants that keep contract 4, one thread issues, and contract 6, lose nothing):

* It issues nothing. It reads the clock and the issuing thread's position (what the engine last
  noted: ``where()``), and acts only through the two callables it is given: ``expire`` (the engine
  aborts its communicators and says what hung) and ``end`` (the process is ended). It never touches
  a lane, a tensor, the block or the optimizers.
* The deadline is armed at every iteration's start (:meth:`arm`), suspended while the issuing thread
  is in a wait with a deadline of its own (:meth:`waiting`: the readback, which raises by itself
  first) and dropped when the loop ends or fails (:meth:`disarm`). So it fires only when the issuing
  thread has spent ``timeout_s`` of one iteration outside such a wait.
* On expiry: first ``expire()``, which aborts the communicators: NCCL's abort ends the kernels a
  blocked synchronize or collective waits for, so the issuing thread may come back with an error and
  unwind through the session's failure policy (the block put back; ``auto`` reruns it serially). A
  thread that comes back by itself (it was only slow) finds :attr:`IterationWatchdog.expired` set
  at its next iteration or at the loop's end, and the engine raises there: its communicators are
  aborted, so the block must not go on on them.
* If the issuing thread has not left the iteration ``grace_s`` later, it cannot be stopped from
  outside: an exception can be raised in a thread only while it runs Python bytecode, and a signal
  handler runs only between the main thread's bytecodes; a thread blocked in C does neither. Then
  ``end(text)`` runs, in this thread. The session gives an ``end`` only when the process is the
  command's (:func:`dpq.cancel.installed`): it reports the hang to the other ranks, then
  :func:`dpq.cancel.end_process` says it, writes the report (block, lane, the blocks finished
  before), removes the staging folder (so ``--output_dir`` is exactly as it was) and ends the
  process with status 1, as DDP's watchdog ends a process stuck in NCCL. A library caller's
  process is never ended: without ``end`` the text is logged once and the deadline stays expired.
* Under several processes the issuing thread may be blocked in a collective, waiting for a rank
  that is hung or lost: that failure is the peers', and the collective's own timeout (the group's,
  a little after this deadline: :data:`dpq.session.PG_WATCHDOG_LEAD`) ends the wait and names the
  rank (:meth:`dpq.planning.distributed.ProcessSet.stop`). So while ``in_collective()`` says so, ``end``
  waits for that instead of ending a healthy rank; a rank stuck in its own work ends itself, its
  hang reported to the store first, so that the others name it and why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["GRACE_S", "IterationWatchdog"]

GRACE_S = 5.0  # after expiry, how long the issuing thread has to come back (an abort may free it)
_POLL_S = 0.5  # how often a stuck thread is looked at again (still in a collective? back?)
log = logging.getLogger("dpq.engine.watchdog")


class IterationWatchdog:
    """One block's iteration deadline (module docstring). ``expire(waited_s)``: aborts what can be
    aborted and returns the text naming what hung; ``end(text)``: ends the process (None: it is not
    this run's to end); ``in_collective()``: the issuing thread waits in a collective for other
    ranks. Started at construction; :meth:`close` stops it."""

    def __init__(self, timeout_s: float, expire: Callable[[float], str], end: Callable[[str], None] | None = None,
                 *, in_collective: Callable[[], bool] = lambda: False, grace_s: float = GRACE_S,
                 name: str = "dpq-watchdog") -> None:
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._expire, self._end, self._in_collective = expire, end, in_collective
        self._cv = threading.Condition()
        self._iteration = 0  # counts arm(): which iteration a deadline belongs to
        self._deadline: float | None = None  # None: not armed, or suspended (waiting)
        self._started = 0.0  # when the armed stretch began
        self._fired = 0  # the iteration whose deadline fired last
        self._closed = False
        self.expired: str | None = None  # what the deadline that passed said (set once, kept)
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """An iteration starts: its deadline is ``timeout_s`` from now (the caller looks at
        :attr:`expired` first: a deadline that passed stops the run)."""
        with self._cv:
            self._iteration += 1
            self._started = time.monotonic()
            self._deadline = self._started + self.timeout_s
            self._cv.notify()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait with a deadline of its own: the iteration's is suspended meanwhile, then restarted."""
        with self._cv:
            armed = self._deadline is not None
            self._deadline = None
        try:
            yield
        finally:
            if armed:
                with self._cv:
                    self._started = time.monotonic()
                    self._deadline = self._started + self.timeout_s
                    self._cv.notify()

    def disarm(self) -> None:
        """The loop ended (or failed): no deadline until the next :meth:`arm`."""
        with self._cv:
            self._deadline = None
            self._iteration += 1  # a stuck-thread wait on the last iteration sees it leave
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed, self._deadline = True, None
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    # -- the watchdog thread ------------------------------------------------------------------

    def _watch(self) -> None:
        while (passed := self._next_expiry()) is not None:
            iteration, waited = passed
            text = self._expire(waited)
            with self._cv:
                if not self._still_in(iteration):
                    continue  # it left the iteration meanwhile: nothing was stuck
                self.expired = self.expired or text
            if self._comes_back(iteration):
                continue
            if self._end is not None:
                self._end(text)  # ends the process (module docstring)
            log.error("%s", text)
            self._comes_back(iteration, forever=True)

    def _next_expiry(self) -> tuple[int, float] | None:
        """Wait until an armed deadline passes: (its iteration, seconds since it was armed); None: closed."""
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                if self._deadline is None or self._fired == self._iteration:
                    self._cv.wait()
                elif now < self._deadline:
                    self._cv.wait(self._deadline - now)
                else:
                    self._fired = self._iteration
                    return self._iteration, now - self._started
        return None

    def _still_in(self, iteration: int) -> bool:
        return not self._closed and self._iteration == iteration and self._deadline is not None

    def _comes_back(self, iteration: int, forever: bool = False) -> bool:
        """Whether the issuing thread leaves ``iteration`` within the grace (``forever``: however long),
        or, blocked in a collective for other ranks, once that collective's own timeout ends it."""
        until = time.monotonic() + self.grace_s
        with self._cv:
            while self._still_in(iteration):
                if not forever and time.monotonic() >= until and not self._in_collective():
                    return False
                self._cv.wait(_POLL_S)
        return True
