"""Fault injection for tests: a lane made to fail from outside the runtime.

Tests make a lane fail where they want (a block's lane loss, one lane of a no-grad pass, or the
whole process, as a killed or hung rank) to check that a failure mid-run loses nothing already
done. Nothing in ``dpq/`` outside this package knows of it. A tune fault is an observer of the
runtime (``dpq.engine.phases``: Note [observers, not patches]) that raises as a lane's forward begins; an
adapter pass's fault replaces the callable the adapter looks up at its seam (the adapter's, never
the runtime's; put back when the last fault of that seam is removed):

    kind                   seen at / replaced                          what fails
    tune, exit, hang       a lane's forward phase (an observer)        the engine's lane forward
    collection             ``dpq.autoround.seams_collection``'s        a collection pass's forward
                           ``sharded_collection``                      on the lane
    awq_grid               ``dpq.autoround.seams_awq``'s               an AWQ grid search's reference
                           ``shard_forward``                           replay on the lane

A subprocess the test cannot reach into (the CLI's, torchrun's workers) gets its fault from the
environment, read by :func:`inject_from_environment` (``tests/site_hooks`` calls it once
``dpq.session`` is imported): ``DPQ_TEST_FAULT=<exit|raise|hang>:<RANK (0 outside
torchrun)>:<block>:<after>``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dpq.engine import phases

__all__ = ["ENV", "inject_fault", "inject_from_environment"]

ENV = "DPQ_TEST_FAULT"
_TUNE_KINDS = ("tune", "exit", "hang")
# seam -> (module, the name that module looks the callable up by)
_SEAMS = {
    "collection": ("dpq.autoround.seams_collection", "sharded_collection"),
    "awq_grid": ("dpq.autoround.seams_awq", "shard_forward"),
}


def _seam(kind: str) -> str:
    return "tune" if kind in _TUNE_KINDS else kind


@dataclass(eq=False)
class Fault:
    """One injected fault; ``calls``: the matching calls seen so far (it fires on call ``after + 1``).
    Active until :meth:`remove` (or the end of a ``with`` block)."""

    kind: str
    block: int | str | None
    lane: int | None
    after: int
    calls: int = 0
    registry: list = field(default_factory=list, repr=False)

    def __enter__(self) -> Fault:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        if self in self.registry:
            self.registry.remove(self)
            _uninstall_unused()

    def matches_block(self, name: str) -> bool:
        """An int block matches the name's last dotted part (auto-round's ``model.layers.1`` is
        block 1), a str the whole name; None any block."""
        if self.block is None:
            return True
        if isinstance(self.block, int):
            return name.rsplit(".", 1)[-1] == str(self.block)
        return name == self.block


_FAULTS: list[Fault] = []
_ORIGINALS: dict[str, Callable] = {}  # seam -> the callable it had before the first fault there


def inject_fault(*, kind: str = "tune", block: int | str | None = None, lane: int | None = None,
                 after: int = 0) -> Fault:
    """Make a lane fail. ``kind="tune"``: the lane loss of block ``block`` (its index or name;
    None: any) on lane ``lane`` (None: any) raises from its call ``after + 1`` on, counted over
    the lanes it matches (``"exit"``: the process exits there instead, as if killed; ``"hang"``: it
    never returns, as a hung process). ``"collection"``, ``"awq_grid"``: the pass's forward on lane
    ``lane`` raises once, at its call ``after + 1`` (then the fault is gone); ``block`` is not
    taken. The seam's callable is looked up by the run at each block or pass, so a fault injected
    between two blocks applies from the next one."""
    if kind not in _TUNE_KINDS and kind not in _SEAMS:
        raise ValueError(f"unknown fault kind {kind!r}: expected one of {sorted({*_TUNE_KINDS, *_SEAMS})}")
    if kind not in _TUNE_KINDS and block is not None:
        raise ValueError(f"a {kind} fault matches a lane, not a block (got block={block!r})")
    fault = Fault(kind, block, lane, after, registry=_FAULTS)
    _install(_seam(kind))
    _FAULTS.append(fault)
    return fault


def inject_from_environment() -> Fault | None:
    """The fault ``DPQ_TEST_FAULT`` asks of this process (its RANK, 0 outside torchrun), injected;
    the variable is consumed, so processes this one starts do not inherit it."""
    raw = os.environ.pop(ENV, "")
    if not raw:
        return None
    spec = raw.split(":")
    if len(spec) != 4 or spec[0] not in ("exit", "raise", "hang"):
        raise ValueError(f"{ENV}={raw!r}: expected <exit|raise|hang>:<rank>:<block>:<after>")
    if os.environ.get("RANK", "0") != spec[1]:
        return None
    return inject_fault(kind="tune" if spec[0] == "raise" else spec[0], block=int(spec[2]), after=int(spec[3]))


# -- the seams -----------------------------------------------------------------------------------------

def _install(seam: str) -> None:
    if seam in _ORIGINALS:
        return
    if seam == "tune":
        _ORIGINALS[seam] = phases.register(_LaneForwardFaults())
        return
    module, name = _SEAMS[seam]
    target = importlib.import_module(module)
    original = getattr(target, name)
    _ORIGINALS[seam] = original
    setattr(target, name, _faulty_pass(seam, original))


def _uninstall_unused() -> None:
    for seam in [s for s in _ORIGINALS if not any(_seam(f.kind) == s for f in _FAULTS)]:
        if seam == "tune":
            _ORIGINALS.pop(seam)()  # the observer unregistered
            continue
        module, name = _SEAMS[seam]
        setattr(sys.modules[module], name, _ORIGINALS.pop(seam))


class _LaneForwardFaults(phases.Observer):
    """The tune faults: a lane's forward (phase ``forward`` of a global lane, run by ``dpq.tune_loop.
    TuneEngine`` on the lane's stream) fails as the faults injected for the engine's block (its ``name``)
    and the lane (its index in this process) say."""

    def phase_begin(self, name: str, owner: object, lane: int | None) -> None:
        if name != "forward" or lane is None:
            return
        block = getattr(owner, "name", "")
        local = lane - getattr(owner, "lane_offset", 0)
        for fault in [f for f in _FAULTS if f.kind in _TUNE_KINDS and f.matches_block(block)]:
            if fault.lane in (None, local):
                fault.calls += 1
                if fault.calls > fault.after:
                    _fail(fault, block)


def _fail(fault: Fault, block: str) -> None:
    if fault.kind == "exit":  # the process dies there, as a killed rank does
        os._exit(9)
    if fault.kind == "hang":  # it never returns, as a hung rank does (its peers wait in a collective)
        print(f"dpq test hook: rank {os.environ.get('RANK', '0')} hangs in block "
              f"{block.rsplit('.', 1)[-1]}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)
    raise RuntimeError("injected lane failure (dpq test hook)")


def _faulty_pass(kind: str, run: Callable) -> Callable:
    """``run`` (a sharded pass: ``run(module(s), lanes, n_samples, forward_fn, ...)``) with its
    ``forward_fn`` raising once on a lane the faults of ``kind`` match."""

    @functools.wraps(run)
    def sharded(modules, lanes, n_samples, forward_fn, *args, **kwargs):
        def forward(module, lane, start, stop):
            _fire(kind, lane.index)
            return forward_fn(module, lane, start, stop)

        return run(modules, lanes, n_samples, forward, *args, **kwargs)

    return sharded


def _fire(kind: str, lane_index: int) -> None:
    for fault in [f for f in _FAULTS if f.kind == kind and f.lane in (None, lane_index)]:
        fault.calls += 1
        if fault.calls > fault.after:
            fault.remove()
            raise RuntimeError(f"injected {kind} lane failure (dpq test hook)")
