"""Everything that knows auto-round's internals: the series the patch table covers
(:data:`dpq.autoround.patches.TABLE`, checked against the installed auto-round at install)."""

from .compat import check_auto_round_version

check_auto_round_version()

from .api import ParallelTuneResult, parallel_tune  # noqa: E402
from .integration import (  # noqa: E402
    ParallelLaneError,
    disable,
    enable,
    parallel_quantization,
    run_summary,
)
from .run import BlockRecord  # noqa: E402

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
