"""The auto-round version dpq is written against, checked once on first use."""

from __future__ import annotations

SUPPORTED = "0.16"


def check_auto_round_version() -> str:
    """Return auto-round's version, or raise with what to install when it is not 0.16.x."""
    try:
        from auto_round.version import __version__
    except ImportError as e:  # pragma: no cover - auto-round is a hard dependency
        raise ImportError("dpq.autoround needs auto-round 0.16.x: pip install 'auto-round>=0.16.1,<0.17'") from e
    if not __version__.startswith(SUPPORTED + "."):
        raise RuntimeError(
            f"dpq.autoround is pinned to auto-round {SUPPORTED}.x (it delegates auto-round's internal "
            f"SignRound loop), but auto-round {__version__} is installed. "
            f"Fix: pip install 'auto-round>={SUPPORTED}.1,<0.17', or run plain auto-round without dpq."
        )
    return __version__
