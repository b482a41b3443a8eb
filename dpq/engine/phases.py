"""The iteration's phases, and the observers through which tools see a run. (An iteration's phases, inside
one block's tune; the adapter's phases of a quantization run, ``dpq.autoround.seams_common.run_phase``, are
the passes around the tunes.)

One data-parallel iteration is six phases, each a method of :class:`dpq.tune_loop.TuneEngine` that
``run_loop`` calls in order::

    split      the serial batch's indices into the global lanes' slices and micro-steps
    forward    one micro-step's forwards, every local lane (each under its own stream)
    backward   one backward call over every lane's loss (the last one exchanging buckets as they fill)
    exchange   the reduced gradient on every lane (after the backward, where it did not overlap)
    readback   the iteration's one host sync: every micro-step's loss, folded in global lane order
               (its copies to the host queued before the last backward: ``readback queue``)
    step       every lane applies the same update

Each runs inside :func:`phase`, which notes where the issuing thread is for the iteration watchdog
(``doing``, :mod:`dpq.engine.watchdog`), opens a ``torch.profiler.record_function`` range while a profiler
runs, and tells the observers. Some runtime work inside a phase is a phase of its own for the
observers (``grads``: the flat gradient buffers made ready; ``loss gather``; ``exchange finish``:
an overlapped exchange's buckets that did not go during the backward; ``issuer``: the overlapped
exchange's issuing node on autograd's calling thread; ``identical check``: ``--parallel_debug``'s
check of the mirrors after the step; ``exchange wait``: the lanes' wait for the exchange's last
collective, ``dpq.engine.exchange._Exchange.wait``; ``loop``: the whole loop of a block). A lane's own
forward is phase ``forward`` again, with its global lane.

Note [observers, not patches]
A tool that must see a run (the CUDA timeline model, fault injection, the benchmarks that time the
phases) registers an :class:`Observer` with :func:`observing`; it never replaces a runtime attribute,
so a renamed private method cannot silently stop a tool from seeing what it measures
(``tests/test_layout.py`` scans for such assignments). The runtime calls the observers synchronously
on the thread that does the work: an observer that raises fails the run at that point, which is how
fault injection fails a lane. With no observer registered each notification is one empty-list
check, and the exchange's per-bucket and per-gradient events allocate nothing (the gradient hooks
of an overlapped backward are told only where an observer was registered when that backward began:
decided once, so an unobserved hook is what it would be without events). Two observer answers
change what runs, for the tools that ask: ``bucket_cap`` (the timeline model's one tensor per
bucket) and ``bucket_waits`` (the GPU check's diagnosis: each bucket's communication streams wait
for everything their lanes queued). Two declared seams let a tool that simulates devices take the accelerator path:
:func:`dpq.streams.install_backend` and :func:`dpq.comm.communicators.register_communicator`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["Observer", "Watched", "bucket_cap", "bucket_waits", "notify", "observers", "observing", "phase",
           "register", "told"]


class Observer:
    """What a run tells its observers; every method does nothing here, so an observer overrides the
    events it watches. ``owner``: the object whose phase it is (the engine, the exchange's state),
    ``lane``: the global lane of a lane's phase, else None."""

    def phase_begin(self, name: str, owner: object, lane: int | None) -> None:
        """Phase ``name`` starts (module docstring)."""

    def phase_end(self, name: str, owner: object, lane: int | None, error: BaseException | None) -> None:
        """Phase ``name`` ended, ``error`` the exception it raised (None: it returned)."""

    def lanes_made(self, lanes: Sequence) -> None:
        """The session made a block's lanes (``dpq.streams.Lane``; before anything runs on them)."""

    def communicator_made(self, comm: object, reason: str) -> None:
        """The session built a block's exchange communicator, for ``reason``."""

    def buckets_laid_out(self, buckets: object, cap: int) -> None:
        """``dpq.engine.exchange.GradBuckets`` laid out the flat gradients in buckets of at most ``cap`` elements."""

    def bucket_cap(self, sizes: Sequence[int], cap: object) -> object:
        """The cap the buckets are laid out with: ``cap`` (what the exchange plan says: a
        ``dpq.engine.exchange.Buckets`` or a number of elements). The timeline
        model records one tensor per bucket, so it answers 1 and lays the target's buckets out itself."""
        return cap

    def exchange_begin(self, policy: object, bucket: int, numel: int) -> None:
        """The exchange policy starts gradient bucket ``bucket`` (``numel`` elements)."""

    def exchange_end(self, policy: object, bucket: int, numel: int, error: BaseException | None) -> None:
        """The exchange policy issued everything of bucket ``bucket``."""

    def exchange_step_begin(self, policy: object, bucket: int, step: str) -> None:
        """Step ``step`` of bucket ``bucket`` starts: ``reduce``, ``update_owned`` or ``gather`` (Note [the
        exchange in three steps] in ``dpq.engine.exchange``; the sign exchange's pack is its
        ``update_owned``, its unpack the ``gather`` after the all-gather); inside ``exchange_begin``/``_end``."""

    def exchange_step_end(self, policy: object, bucket: int, step: str, error: BaseException | None) -> None:
        """Step ``step`` of bucket ``bucket`` issued everything (``error``: what it raised)."""

    def bucket_waits(self, policy: object, bucket: int, marks: Sequence | None) -> Sequence | None:
        """What the communication streams wait for before bucket ``bucket`` (C1 of ``dpq.comm.comm_streams``):
        ``marks``, per lane the event after which its part of the bucket is final (an overlapped
        backward on accelerator lanes), or None: everything each compute lane queued so far. An
        observer may answer None where there were marks (correct, and conservative: the GPU check's
        diagnosis of a race the marks let through)."""
        return marks

    def gradient_hook_begin(self, exchange: object, lane: int, param: int) -> None:
        """An overlapped backward's hook on tuned parameter ``param`` of local lane ``lane`` (the position
        in the communicator's lanes) starts: its gradient was just accumulated. ``exchange``: the
        ``dpq.engine.exchange.BackwardExchange``. On CPU lanes the hook that completes a bucket
        issues it (``exchange_begin`` inside); on accelerator lanes it runs on autograd's device thread."""

    def gradient_hook_end(self, exchange: object, lane: int, param: int, error: BaseException | None) -> None:
        """The hook on tuned parameter ``param`` of local lane ``lane`` returned (``error``: what it raised)."""

    def bucket_marked(self, exchange: object, bucket: int, lane: int, mark: object) -> None:
        """Accelerator lanes, overlapped: local lane ``lane``'s part of bucket ``bucket`` is final after
        ``mark``, an event just recorded on the stream current on this thread (autograd's stream for
        the node: the lane's forward stream). Called on that device thread, under the exchange's lock."""

    def constant_made(self, tensor: torch.Tensor) -> None:
        """A lookup table of fixed size, whatever the block (the sign unpack's table)."""


_OBSERVERS: list[Observer] = []


def observers() -> list[Observer]:
    """The observers registered now (in registration order)."""
    return _OBSERVERS


def register(observer: Observer) -> Callable[[], None]:
    """``observer`` sees every run from now on, until the function returned is called."""
    _OBSERVERS.append(observer)
    return lambda: _OBSERVERS.remove(observer) if observer in _OBSERVERS else None


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """``observer`` sees every run while entered."""
    unregister = register(observer)
    try:
        yield observer
    finally:
        unregister()


class _Notify:
    """``notify.<event>(...)``: every observer's method of that name, in registration order."""

    def __getattr__(self, event: str):
        def call(*args, **kwargs):
            out = None
            for observer in list(_OBSERVERS):
                out = getattr(observer, event)(*args, **kwargs)
            return out
        return call


notify = _Notify()


def told(event: str, args: tuple, work: Callable[[], None]) -> None:
    """``work()`` told to the observers as ``<event>_begin(*args)`` before it and ``<event>_end(*args, error)``
    after it (``error``: what it raised, else None), as the exchange's steps and hooks are."""
    getattr(notify, f"{event}_begin")(*args)
    try:
        work()
    except BaseException as err:
        getattr(notify, f"{event}_end")(*args, err)
        raise
    getattr(notify, f"{event}_end")(*args, None)


def bucket_cap(sizes: Sequence[int], cap: object) -> object:
    """The cap the observers leave (each may replace the one before it): a ``dpq.engine.exchange.BucketCap``
    (typed ``object`` here: dpq.engine.exchange imports this module)."""
    for observer in list(_OBSERVERS):
        cap = observer.bucket_cap(sizes, cap)
    return cap


def bucket_waits(policy: object, bucket: int, marks: Sequence | None) -> Sequence | None:
    """What bucket ``bucket``'s communication streams wait for, as the observers leave it (each may replace
    the answer before it; :meth:`Observer.bucket_waits`)."""
    for observer in list(_OBSERVERS):
        marks = observer.bucket_waits(policy, bucket, marks)
    return marks


class Watched:
    """An owner of phases whose issuing thread the iteration watchdog watches (``dpq.tune_loop.TuneEngine``):
    ``doing`` is what the thread does now, ``(phase, global lane or None)``, for the watchdog's text."""

    doing: tuple[str, int | None] = ("loop", None)


@contextlib.contextmanager
def phase(name: str, owner: object = None, *, lane: int | None = None, doing: bool = True) -> Iterator[None]:
    """Phase ``name`` of ``owner`` (module docstring). ``doing``: ``owner.doing`` is ``(name, lane)`` while
    it runs, where the owner is :class:`Watched` (what the iteration watchdog says the issuing thread
    does), and what it was before once it ends."""
    if doing and isinstance(owner, Watched):
        before, owner.doing = owner.doing, (name, lane)
        try:
            with _phase(name, owner, lane):
                yield
        finally:
            owner.doing = before
    else:
        with _phase(name, owner, lane):
            yield


@contextlib.contextmanager
def _phase(name: str, owner: object, lane: int | None) -> Iterator[None]:
    profiled = torch.autograd.profiler._is_profiler_enabled
    ranged = torch.profiler.record_function(f"dpq {name}") if profiled else contextlib.nullcontext()
    if not _OBSERVERS:
        with ranged:
            yield
        return
    watching: list[Observer] = []
    try:
        for observer in list(_OBSERVERS):
            observer.phase_begin(name, owner, lane)
            watching.append(observer)
    except BaseException as err:  # an observer failed the phase (fault injection): the others see it end
        for observer in reversed(watching):
            observer.phase_end(name, owner, lane, err)
        raise
    try:
        with ranged:
            yield
    except BaseException as err:
        for observer in reversed(watching):
            observer.phase_end(name, owner, lane, err)
        raise
    for observer in reversed(watching):
        observer.phase_end(name, owner, lane, None)
