"""Everything that knows auto-round's internals: the series the patch table covers
(:data:`dpq.autoround.patches.TABLE`, checked against the installed auto-round at install)."""

from . import compat  # noqa: F401 (first: importing it refuses an auto-round the patch table does not cover)
from .api import ParallelTuneResult, parallel_tune
from .integration import disable, enable, parallel_quantization, run_summary
from .run import BlockRecord
from .seams_common import ParallelLaneError

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
