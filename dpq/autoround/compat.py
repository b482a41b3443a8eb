"""The auto-round versions dpq is written against. Importing this module checks the installed one:
the package imports it before anything that imports auto-round, so an uncovered auto-round is refused
by name before any of its modules load."""

from __future__ import annotations

from dpq import refusals

from .versions import SERIES

SUPPORTED = tuple(SERIES)  # the series the patch table (dpq.autoround.patches) covers: one module each
CHECKED = tuple(m.RELEASE for m in SERIES.values())  # the releases their signatures and digests were read on
PIP_BOUND = "auto-round>=0.16.1,<0.18"


def check_auto_round_version() -> str:
    """Return auto-round's version, or raise with what to install when its series is not covered."""
    try:
        from auto_round.version import __version__
    except ImportError as e:  # pragma: no cover - auto-round is a hard dependency
        raise ImportError(refusals.auto_round_missing(PIP_BOUND)) from e
    if ".".join(__version__.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(refusals.auto_round_unsupported(SUPPORTED, __version__, PIP_BOUND))
    return __version__


check_auto_round_version()


def prepare_block_for_tuning(q, block, active_inputs, batch_size: int) -> None:
    """What the installed auto-round does to a wrapped block before its tune loop and dpq's lanes
    must do too (call after ``wrapper_block``, before mirroring). 0.17: the MoE experts
    implementation switch (``maybe_adapt_moe_implementation``; a no-op for blocks without grouped
    expert stacks). Its ``pull_tuning_pool`` is a placement choice only (values unchanged); lanes
    stage their own slices, so it is not repeated."""
    adapt = getattr(q, "maybe_adapt_moe_implementation", None)
    if adapt is not None:
        adapt(block, active_inputs, batch_size)
