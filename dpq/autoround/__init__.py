"""Everything that knows auto-round's internals (pinned to the 0.16 series)."""

from .compat import check_auto_round_version

check_auto_round_version()

from .api import ParallelTuneResult, parallel_tune  # noqa: E402
from .integration import (  # noqa: E402
    BlockRecord,
    ParallelLaneError,
    disable,
    enable,
    parallel_quantization,
    run_summary,
)

__all__ = [
    "BlockRecord",
    "ParallelLaneError",
    "ParallelTuneResult",
    "disable",
    "enable",
    "parallel_quantization",
    "parallel_tune",
    "run_summary",
]
