"""auto-round's no-grad phases, sharded over lanes: the entry to the per-phase seams.

The seams themselves live by phase: :mod:`.seams_collection` (collection forwards),
:mod:`.seams_rtn` (``iters=0`` weight searches), :mod:`.seams_init_scale` (SignRoundV2
init-scale searches), :mod:`.seams_awq` (AWQ grid and clip searches), with what they share in
:mod:`.seams_common`. They are installed, with every other replacement, by the patch table
(:mod:`.patches`); ``install(run)`` here pushes a seams-only run
(``Run(ParallelSpec(2, "cpu,cpu"), seams_only=True)``) on it without an ``enable()``: the no-grad
phases run over lanes and each block's tune stays auto-round's own. The phase benchmark is
``benchmarks/phases.py``.
"""

from __future__ import annotations

from . import patches
from .run import Run
from .seams_common import reported

__all__ = ["install", "installed", "reset", "uninstall"]


def install(run: Run) -> None:
    """Install the seams (with the whole patch table) for ``run`` (``seams_only``: the tuner stays
    auto-round's); undone by one :func:`uninstall`."""
    patches.install(run)


def uninstall() -> None:
    """Undo the innermost install; safe to call when nothing is installed."""
    patches.uninstall()


def installed() -> bool:
    return patches.installed()


def reset() -> None:
    """Forget the phase records (e.g. between two measured runs)."""
    reported().phases.clear()
