"""auto-round's no-grad phases, sharded over lanes: the entry to the per-phase seams.

The seams themselves live by phase: :mod:`.seams_collection` (collection forwards),
:mod:`.seams_rtn` (``iters=0`` weight searches), :mod:`.seams_init_scale` (SignRoundV2
init-scale searches), :mod:`.seams_awq` (AWQ grid and clip searches), with what they share in
:mod:`.seams_common`. They are installed, with every other replacement, by the patch table
(:mod:`.patches`); ``install(config)`` here pushes ``config`` (``world``, ``devices``) on it
without an ``enable()`` (the tuner then stays serial). The phase benchmark is
``benchmarks/phases.py``.
"""

from __future__ import annotations

from . import patches
from .seams_collection import ShardedRunner
from .seams_common import PhaseRecord, SeamRun, phase_seconds, records, reported

__all__ = ["PhaseRecord", "SeamRun", "ShardedRunner", "install", "installed", "last_run", "phase_seconds", "records",
           "reset", "uninstall"]


def install(config) -> None:
    """Install the seams (with the whole patch table) for ``config``; undone by one :func:`uninstall`."""
    patches.install(config)


def uninstall() -> None:
    """Undo the innermost install; safe to call when nothing is installed."""
    patches.uninstall()


def installed() -> bool:
    return patches.installed()


def last_run() -> SeamRun:
    """The seams' run of the innermost install, or after the run, the last one (counters, records)."""
    return reported()


def reset() -> None:
    """Forget the phase records (e.g. between two measured runs)."""
    reported().records.clear()
