"""Cancel means stop: SIGTERM or SIGINT, or the launcher gone, ends this process within seconds,
also while its main thread is blocked in a collective, and nothing written after the cancel
reaches the output.

:func:`install` (a command's entry point calls it once, from the main thread; a library never
installs signal handlers) puts a Python handler on SIGTERM and SIGINT and gives the signals a
wakeup fd (:func:`signal.set_wakeup_fd`): Python's C-level handler writes each signal's number
there at once, even while the main thread waits in C++ (a gloo collective does not return to the
interpreter, so a Python handler alone would not run until the collective ends), and a watcher
thread reads it. The same thread watches the launcher: when this process's parent at
:func:`install` is gone (it was killed, even with SIGKILL: the process is re-parented), that is a
cancel too, so no worker outlives its launcher. Checking the parent's pid is used rather than
``PR_SET_PDEATHSIG``, which fires when the parent *thread* that started the process exits.

What a cancel does:

* one process (``peers`` None): the handler raises :class:`Cancelled` in the main thread, which
  unwinds as an interrupt does (the session puts the block back, the output's staging folder is
  removed); the watcher ends the process if that has not happened within ``BACKSTOP_S``.
* several processes: this rank reports the cancel to the others (``peers``, the run's
  :class:`dpq.planning.distributed.ProcessSet`), then leaves when every rank has reported one (a cancel of
  the whole job: at once), or after ``NAMING_S`` (a peer that lost its process meanwhile has been
  seen by then: its collectives fail at once, and :meth:`~dpq.planning.distributed.ProcessSet.stop` names
  it; the watcher waits for that, up to the set's ``grace_s``). The watcher then says so, removes
  the staging folders registered with :func:`on_exit` and ends the process (``os._exit``: a main
  thread blocked in a collective cannot unwind).

:func:`uninterrupted` guards the one step that must not be cut: moving a finished output into
place. A cancel before it refuses it (raises :class:`Cancelled`); one during it waits for its end.

:func:`end_process` is how any thread ends this process when its main thread cannot unwind (the
watcher after a cancel; the iteration watchdog, :mod:`dpq.engine.watchdog`, when the issuing thread is
stuck): a move into place finishes first, the reason is said, :func:`ending` tells the cleanups
registered with :func:`on_exit` why (so a report can say it: a cancel, which signal, or a hang), the
cleanups run (staging folders removed, the report written) and the process exits with the status
given. A main thread that is naming a failed rank (:func:`note_failing`: torchrun sends SIGTERM to
the others as soon as one rank is lost) gets up to the naming grace plus ``FAILING_S`` to end the
run itself, its report and exit status saying that a rank was lost, not that the run was cancelled.

Exit statuses (the shell's convention, 128 + the signal): 130 after SIGINT, 143 after SIGTERM,
129 when the launcher is gone (as a hang-up, SIGHUP).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BACKSTOP_S", "FAILING_S", "LAUNCHER_GONE", "NAMING_S", "Cancelled", "Peers", "cancelled", "cause_of",
           "end_process", "ending", "exit_status", "install", "installed", "note_failing", "on_exit", "said",
           "uninterrupted", "what"]

LAUNCHER_GONE = signal.SIGHUP  # what a cancel by the launcher's death counts as (its exit status: 129)
NAMING_S = 2.0  # several processes: how long a cancelled rank lets its main thread notice a lost peer
BACKSTOP_S = 5.0  # one process: how long the main thread has to unwind before the process is ended
FAILING_S = 10.0  # a main thread naming a lost rank: how long it has after the naming grace to report and exit


class Cancelled(KeyboardInterrupt):
    """The run was cancelled (``signum``: the signal, or :data:`LAUNCHER_GONE`). An interrupt, so
    that everything on the way out treats it as one (the session restores the block, no rerun)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(what(signum))


class Peers(Protocol):
    """The other ranks of the run, as the watcher needs them (:class:`dpq.planning.distributed.ProcessSet`)."""

    grace_s: float

    def report_cancel(self, what: str) -> None: ...

    def cancelled_everywhere(self) -> bool: ...


@dataclass
class _State:
    signum: int | None = None  # what cancelled the run (first one wins)
    received: int = 0  # signals read off the wakeup fd
    again: bool = False  # a second signal: leave at once
    raised: bool = False  # one process: the main thread's handler raised Cancelled
    parent: int | None = None  # the launcher's pid (None: not watched)
    peers: Peers | None = None
    failing_since: float | None = None  # the main thread is naming a failed rank (dpq.planning.distributed)
    protected: threading.Lock = field(default_factory=threading.Lock)
    in_protected: bool = False
    moved: bool = False  # a protected step finished after the cancel arrived (the output is in place)
    in_place: bool = False  # a protected step (the output moved into place) completed, cancel or not
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    said: bool = False  # the cancel was told to the user (by the main thread, or the watcher)
    ending: tuple[str, str] | None = None  # end_process: why a thread ends the process (kind, what was said)
    watcher: threading.Thread | None = None
    pipe: tuple[int, int] | None = None  # the wakeup fd's (read, write) ends


_state = _State()


def what(signum: int) -> str:
    """The cancel's cause in words: 'SIGTERM', 'SIGINT', or the launcher's death."""
    if signum == LAUNCHER_GONE:
        return "its launcher is gone"
    return signal.Signals(signum).name


def cause_of(text: str) -> int:
    """The signal :func:`what` put in words (SIGTERM for a text it did not write)."""
    for signum in (signal.SIGTERM, signal.SIGINT, LAUNCHER_GONE):
        if what(signum) == text:
            return signum
    return signal.SIGTERM


def exit_status(signum: int) -> int:
    return 128 + int(signum)


def cancelled() -> int | None:
    """The signal that cancelled this process's run (:data:`LAUNCHER_GONE` for the launcher), or None."""
    return _state.signum


def installed() -> bool:
    return _state.watcher is not None


def install(*, watch_parent: bool = False, peers: Peers | None = None) -> None:
    """Cancel handling for this process (module docstring). ``watch_parent``: a cancel when this
    process's parent goes (a launcher's worker). ``peers``: the other ranks (several processes);
    may be given later with ``install(peers=...)``. Call from the main thread."""
    if peers is not None:
        _state.peers = peers
    if _state.watcher is not None:
        return
    read_fd, write_fd = os.pipe()
    _state.pipe = (read_fd, write_fd)
    os.set_blocking(write_fd, False)  # the C-level handler must never block
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    _state.parent = os.getppid() if watch_parent else None
    _state.watcher = threading.Thread(target=_watch, args=(read_fd,), name="dpq-cancel", daemon=True)
    _state.watcher.start()


def _forget_in_child() -> None:
    """A forked child (a multiprocessing worker, a data loader) starts without cancel handling:
    it inherits the handlers and the wakeup fd but not the watcher thread, so a signal to the
    child would write into the parent's pipe and cancel the *parent* (``terminate()`` on a worker
    would stop the run), and the child would raise Cancelled instead of dying of the signal."""
    global _state
    if _state.watcher is None:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in _state.pipe or ():
        with contextlib.suppress(OSError):
            os.close(fd)
    _state = _State()


os.register_at_fork(after_in_child=_forget_in_child)


def on_exit(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` (best effort) if a thread ends the process (:func:`end_process`: the watcher
    after a cancel, the iteration watchdog); returns a function that unregisters it. A cleanup may
    read :func:`ending` for why."""
    _state.cleanups.append(cleanup)
    return lambda: _state.cleanups.remove(cleanup) if cleanup in _state.cleanups else None


def ending() -> tuple[str, str] | None:
    """Why a thread is ending this process (:func:`end_process`): (kind, what it said), kind
    "cancelled" or the caller's (e.g. "hung"); None while the main thread ends the run itself."""
    return _state.ending


def note_failing() -> None:
    """The main thread is naming a failed rank (:meth:`dpq.planning.distributed.ProcessSet.stop`): a cancel
    arriving now (torchrun stops the other workers when one fails) lets it finish."""
    if _state.failing_since is None:
        _state.failing_since = time.monotonic()


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A step a cancel must not cut (the output moved into place): refused by an earlier cancel
    (raises :class:`Cancelled`), waited for by a later one."""
    with _state.protected:
        if _state.signum is not None:
            raise Cancelled(_state.signum)
        _state.in_protected = True
        try:
            yield
            _state.in_place = True  # the step completed: what it moved is in place, whatever comes later
        finally:
            _state.in_protected = False
            _state.moved = _state.signum is not None
    if _state.moved and not _state.raised:  # it came during the step, which finished: the run stops now
        _state.raised = True
        raise Cancelled(_state.signum)


def _cancel(signum: int) -> None:
    """Record the cancel's cause (the first one wins)."""
    if _state.signum is None:
        _state.signum = signum


def _on_signal(signum: int, frame) -> None:
    """The main thread's handler, when the interpreter gets to run it (the watcher, which counts the
    signals, acts anyway). One process: the main thread unwinds, once."""
    _cancel(signum)
    if _state.peers is None and not _state.raised and not _state.in_protected:
        _state.raised = True
        raise Cancelled(signum)


def _watch(read_fd: int) -> None:
    while _state.signum is None:
        _poll(read_fd)
    if _state.peers is None and _state.signum != LAUNCHER_GONE:
        # one process: the main thread unwinds by itself (Cancelled, raised once a move into place
        # has finished); end it if it has not done so soon after
        with _state.protected:
            pass
        deadline = time.monotonic() + BACKSTOP_S
        while time.monotonic() < deadline and not _state.again:
            _poll(read_fd)
    _leave(read_fd)


def _poll(read_fd: int, timeout_s: float = 0.2) -> None:
    """Wait up to ``timeout_s`` for a signal's byte on the wakeup fd; then look at the launcher."""
    ready, _, _ = select.select([read_fd], [], [], timeout_s)
    if ready:
        for sig in os.read(read_fd, 64):  # one byte per signal delivered
            if sig in (signal.SIGTERM, signal.SIGINT):
                _cancel(sig)
                _state.received += 1
                _state.again = _state.received > 1
    if _state.parent is not None and os.getppid() != _state.parent:
        _cancel(LAUNCHER_GONE)


def _bounded(call: Callable[[], object], timeout_s: float) -> object:
    """``call()`` in a helper thread, for at most ``timeout_s`` (a store op must not hold the exit)."""
    out: list = []
    helper = threading.Thread(target=lambda: out.append(_quiet(call)), daemon=True)
    helper.start()
    helper.join(timeout_s)
    return out[0] if out else None


def _quiet(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception:
        return None


def _leave(read_fd: int) -> None:
    """The watcher's end of a cancel (module docstring); never returns."""
    signum, peers = _state.signum, _state.peers
    if peers is not None and signum != LAUNCHER_GONE:
        _bounded(lambda: peers.report_cancel(what(signum)), 1.0)
        deadline = time.monotonic() + NAMING_S
        while time.monotonic() < deadline and not _state.again:
            if _state.failing_since is not None:  # the main thread names a lost peer: let it end the run
                deadline = max(deadline, _state.failing_since + peers.grace_s + FAILING_S)
            elif _bounded(peers.cancelled_everywhere, 1.0):
                break
            _poll(read_fd, 0.05)  # a second signal: leave at once
    told = _state.said  # the main thread told the user already
    end_process(exit_status(signum), "cancelled", f"dpq: {said()}", say=not told)


def end_process(status: int, kind: str, message: str, *, say: bool = True) -> None:
    """End this process from any thread (module docstring); never returns. ``message`` (printed
    unless ``say`` is False) and ``kind`` are what :func:`ending` tells the cleanups."""
    with _state.protected:  # a move into place that started before this finishes first
        pass
    _state.ending = (kind, message)
    if say:
        print(message, file=sys.stderr, flush=True)
    for cleanup in list(_state.cleanups):
        _quiet(cleanup)
    for stream in (sys.stdout, sys.stderr):
        _quiet(stream.flush)
    os._exit(status)


def said() -> str:
    """What the main thread tells the user of the cancel (the watcher then says nothing more)."""
    _state.said = True
    cause = what(_state.signum) if _state.signum is not None else "an interrupt"
    from dpq import refusals

    if _state.moved:
        return refusals.cancelled_after_move(cause)
    return refusals.cancelled_after_save(cause) if _state.in_place else refusals.cancelled(cause)
