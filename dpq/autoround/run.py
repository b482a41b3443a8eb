"""The run: one ``enable()``'s settings and records, kept in its frame of the patch table's stack.

``enable()`` pushes a :class:`Run` (:func:`dpq.autoround.patches.install`), ``disable()`` pops it.
dpq's patched functions read the innermost run with :func:`current_run` (its process set with
:func:`run_processes`); nothing outside dpq/autoround/ reads it. After the outermost ``disable()`` the last
run's frame stays readable (:func:`reported_run`) for its records: the run summary, ``auto``'s
report, the CLI's ``--parallel_report``. Nothing that runs a block reads a finished run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dpq import session
from dpq.cost_model import AutoWorld
from dpq.distributed import ProcessSet
from dpq.staging import Staging

from . import patches

__all__ = ["BlockRecord", "Run", "current_run", "reported_run", "run_processes"]


@dataclass
class BlockRecord:
    name: str
    world: int
    seconds: float
    wire_bytes: int = 0
    best_loss: float | None = None
    communicator: str = ""
    reasons: list[str] = field(default_factory=list)
    fell_back: bool = False
    algorithm: str = ""  # the quantizer class that ran (SignRoundQuantizer, SignRoundV2Quantizer, ...)
    losses: list[float] = field(default_factory=list)  # per iteration (engine runs only)
    best_iter: int | None = None
    # the issuing thread's host time per lane-iteration (dpq.tune_loop.TuneEngine.issue_s): on
    # accelerator lanes, W x this next to the GPUs' time per iteration says whether one thread keeps up
    issue_s: float | None = None
    # 'auto' with the cost model (dpq.cost_model): the predicted seconds of the lanes' run per candidate
    # world (the chosen one is ``world``) and the measured seconds of the same span (mirrors + loop)
    predicted_s: dict[int, float] = field(default_factory=dict)
    measured_s: float | None = None
    # torch.compile on the lanes (dpq.compiles), per lane of this process: dynamo recompiles caused by
    # the lane's forwards (each is host time on the one issuing thread), all its compiles, and the
    # host seconds they took (lazily compiled backwards included); empty: serial, or nothing watched
    recompiles: list[int] = field(default_factory=list)
    compiles: list[int] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)


@dataclass
class Run:
    """One ``enable()``: its settings and its run's records."""

    world: int | str = "off"
    devices: object = None
    debug_identical: bool = False
    overlap: bool | None = None  # dpq.session.SessionConfig.overlap
    timeout: float = session.DEFAULT_TIMEOUT_S  # dpq.session.SessionConfig.timeout (--parallel_timeout)
    auto_world: AutoWorld | None = None  # 'auto': the run's cost model (one per enable())
    auto_given: bool = False  # the caller gave it: used even where lanes share a device
    records: list[BlockRecord] = field(default_factory=list)
    shapes_logged: set = field(default_factory=set)
    cpu_logged: bool = False
    # Several processes (torchrun): the group every block's run spans, one ProcessSet per job (its
    # store keys are the job's), detected at enable(); None: this process alone.
    processes: ProcessSet | None = None
    # The save in progress (dpq.autoround.ranks): the staging of the running quantize_and_save (it
    # hands the folders out once they are in place), and whether rank 0 is inside an original
    # save_quantized (a mixin's super().save_quantized is part of it: no second barrier).
    staging: Staging | None = None
    rank0_saving: bool = False


def current_run() -> Run | None:
    """The innermost enabled run on the patch stack (None: no enable() in effect; dpq's
    replacements, left under someone else's patch, then pass calls through)."""
    for f in reversed(patches.frames()):
        if isinstance(f.config, Run):
            return f.config
    return None


def reported_run() -> Run | None:
    """The run whose records are read: the innermost enabled one, else the last one that ended."""
    run = current_run()
    if run is not None:
        return run
    last = patches.last()
    return last.config if last is not None and isinstance(last.config, Run) else None


def run_processes() -> ProcessSet | None:
    """The innermost run's process set when it spans several processes, else None."""
    for f in reversed(patches.frames()):
        procs = getattr(f.config, "processes", None)
        if procs is not None:
            return procs if procs.size > 1 else None
    return None
