"""torch.compile on the lanes: which lane's work made dynamo compile, and how long the host spent.

A tuner may run its block forward through ``torch.compile`` (auto-round does by default on
Linux: its ``BlockForwardRunner`` compiles ``block_forward``, its wrappers the quantize
functions). On the lanes that is one compiled function called with W module replicas, on W
devices, with slices whose sizes can differ by one. Dynamo guards on each call's arguments, so
each of those can fail a guard and recompile: once per lane device (a guard on the device),
once per mirror object if the graph specialises on the module, once per uneven slice shape (a
shape guard; dynamo then usually recompiles once more with a dynamic batch size). Every compile
runs on the one thread that issues every lane (contract 4 of DESIGN.md): while it compiles, no
lane gets new work, so a recompile per lane is host time that W lanes wait for, and a recompile
*every iteration* (the cache limit exceeded, an ever-changing guard) would make a compiled run
slower than an eager one. That is why every block record carries the compiles per lane.

:class:`CompileWatch` counts them with torch's compilation callbacks
(``torch._dynamo.callback_handler``: a start and an end callback around every dynamo frame
compile and every lazily compiled backward, each with its compile id ``frame/n``):

* a *compile* is a dynamo frame compile caused by a lane's forward (issued inside
  :meth:`CompileWatch.lane`); a *recompile* is one whose frame (code object) had been
  compiled before in this process (``n >= 1``: a cached graph's guards failed). A block's
  first tuning forward at home usually recompiles too (the tuner compiled the same function
  for its no-grad caching forward), in serial as well;
* a backward compiled lazily during the one multi-lane backward belongs to the lane whose
  forward compiled that graph (the callback's compile id is the forward's);
* ``compile_s``: the host seconds between each compile's start and end callbacks.

Compiles outside a lane's forward and its backward (the tuner's own passes before or after
the loop) are not counted. Nested compiles are reported once, as the outermost (torch runs the
callbacks only at the outermost level). If ``torch._dynamo`` is not imported when the watch
starts, nothing has been compiled and the watch does not import it (seconds of import on a
run that compiles nothing): it stays empty.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["CompileWatch", "LaneCompiles"]


@dataclass
class LaneCompiles:
    """One lane's compiles during a block (see the module docstring)."""

    compiles: int = 0  # dynamo frame compiles caused by the lane's forwards
    recompiles: int = 0  # of those, frames compiled before (a guard failed)
    backward_compiles: int = 0  # lazily compiled backwards of the lane's graphs
    compile_s: float = 0.0  # host seconds in all of the above
    # each recompile: its compile id ('3/1': frame 3's second compile) and, where torch still holds
    # its metrics, the guard that failed (dynamo's recompile_reason)
    reasons: list[str] = field(default_factory=list)


def _frame_compile(compile_id: str) -> tuple[int | None, int | None]:
    """(frame id, compile number of that frame) from a compile id string ('3/1', '!0/3/1')."""
    parts = compile_id.lstrip("!").split("/")
    if len(parts) < 2:
        return None, None
    try:
        return int(parts[-2]), int(parts[-1])
    except ValueError:
        return None, None


class CompileWatch:
    """Counts dynamo's compiles per lane while it is entered (``with CompileWatch(world) as w:``).

    Wrap each lane's forward in ``with w.lane(k):`` (or the lane loss in :meth:`lane_loss`);
    ``w.lanes[k]`` is lane ``k``'s :class:`LaneCompiles`. Callbacks can come from another thread
    (a lazy backward compiled on autograd's device thread): the counts are taken under a lock.
    """

    def __init__(self, world: int) -> None:
        self.lanes = [LaneCompiles() for _ in range(world)]
        self._lock = threading.Lock()
        self._current: int | None = None  # the lane whose forward is being issued
        self._owner: dict[str, int] = {}  # forward compile id -> lane
        self._started: dict[tuple[object, str], tuple[float, int | None]] = {}
        self._handler = None
        self.watched = False  # the callbacks were installed (torch._dynamo was imported at the start)

    # -- entering and leaving ------------------------------------------------------------------

    def __enter__(self) -> CompileWatch:
        dynamo = sys.modules.get("torch._dynamo")
        handler = getattr(dynamo, "callback_handler", None)
        if handler is not None:
            handler.register_start_callback(self._on_start)
            handler.register_end_callback(self._on_end)
            self._handler = handler
            self.watched = True
        return self

    def __exit__(self, *exc) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        with contextlib.suppress(ValueError):
            handler.remove_start_callback(self._on_start)
        with contextlib.suppress(ValueError):
            handler.remove_end_callback(self._on_end)
        self._explain()

    def _explain(self) -> None:
        """Each recompile's guard failure, from the compilation metrics torch keeps (its last 64)."""
        if not any(c.reasons for c in self.lanes):
            return
        try:
            from torch._dynamo.utils import get_compilation_metrics

            why = {str(m.compile_id): m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason}
        except Exception:  # best effort: an internal API of torch
            return
        for c in self.lanes:
            c.reasons = [f"{cid}: {why[cid]}" if cid in why else cid for cid in c.reasons]

    @contextlib.contextmanager
    def lane(self, k: int) -> Iterator[None]:
        """Compiles that start in here are lane ``k``'s."""
        before, self._current = self._current, k
        try:
            yield
        finally:
            self._current = before

    def lane_loss(self, lane_loss: Callable) -> Callable:
        """``lane_loss(lane, module, chunk)`` (:class:`dpq.tune_loop.TuneEngine`'s) with each call
        inside :meth:`lane` for ``lane.index``; as it is when nothing is watched (no callbacks to
        attribute: nothing added to the issuing thread's per-call work)."""
        if not self.watched:
            return lane_loss

        def watched(lane, module, chunk):
            with self.lane(lane.index):
                return lane_loss(lane, module, chunk)

        return watched

    # -- the callbacks -------------------------------------------------------------------------

    def _on_start(self, args) -> None:
        with self._lock:
            self._started[(args.callback_trigger, args.compile_id)] = (time.perf_counter(), self._current)

    def _on_end(self, args) -> None:
        now = time.perf_counter()
        trigger, compile_id = args.callback_trigger, args.compile_id
        with self._lock:
            t0, current = self._started.pop((trigger, compile_id), (now, self._current))
            backward = getattr(trigger, "name", "") == "LAZY_BACKWARD"
            k = self._owner.get(compile_id) if backward else current
            if k is None or not 0 <= k < len(self.lanes):
                return  # not a lane's work (or a backward of a graph compiled outside the block)
            counts = self.lanes[k]
            counts.compile_s += now - t0
            if backward:
                counts.backward_compiles += 1
                return
            if getattr(trigger, "name", "") != "DYNAMO":
                return  # e.g. a CUDA graph recording: host time, not a compile
            self._owner[compile_id] = k
            counts.compiles += 1
            _, n = _frame_compile(compile_id)
            if n is not None and n >= 1:
                counts.recompiles += 1
                counts.reasons.append(compile_id)

    # -- what the records carry ----------------------------------------------------------------

    def recompiles(self) -> list[int]:
        return [c.recompiles for c in self.lanes]

    def compiles(self) -> list[int]:
        return [c.compiles for c in self.lanes]

    def compile_s(self) -> list[float]:
        return [round(c.compile_s, 4) for c in self.lanes]
