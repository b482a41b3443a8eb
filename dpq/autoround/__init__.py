"""Everything that knows auto-round's internals (pinned to the 0.16 series)."""

from .compat import check_auto_round_version

check_auto_round_version()

from .api import ParallelTuneResult, parallel_tune  # noqa: E402

__all__ = ["ParallelTuneResult", "parallel_tune"]
