"""The run: one ``enable()``'s settings, records and scratch, kept in its frame of the patch table's stack.

``enable()`` pushes a :class:`Run` (:func:`dpq.autoround.patches.install`) and returns it,
``disable()`` pops it and returns it; every frame on the stack holds one. A seams-only install
(``shard_seams.install``) pushes a run with ``seams_only``: its no-grad phases run over lanes while
the tuner stays auto-round's own. dpq's patched functions are handed the run as their first
argument (Note [each replacement is handed its run] in :mod:`dpq.autoround.patches`: the tuner's
and the save's replacements the innermost run that is not seams-only, the seams the top frame's)
and pass it down; nothing outside dpq/autoround/ reads it. After the outermost ``disable()`` the
last run stays readable (:func:`dpq.autoround.patches.reported`) for its records: the run summary,
the phase seconds, ``auto``'s report, the CLI's ``--parallel_report``. Nothing that runs a block
reads a finished run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from auto_round.utils.device_manager import device_manager

from dpq.planning.cost_model import AutoWorld
from dpq.planning.distributed import ProcessSet
from dpq.planning.spec import ParallelSpec, SpecSettings
from dpq.staging import Staging

__all__ = ["BlockRecord", "PhaseRecord", "Run", "SeamScratch"]


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
    # 'auto' with the cost model (dpq.planning.cost_model): the predicted seconds of the lanes' run per candidate
    # world (the chosen one is ``world``) and the measured seconds of the same span (mirrors + loop)
    predicted_s: dict[int, float] = field(default_factory=dict)
    measured_s: float | None = None
    # torch.compile on the lanes (dpq.engine.compiles), per lane of this process: dynamo recompiles caused by
    # the lane's forwards (each is host time on the one issuing thread), all its compiles, and the
    # host seconds they took (lazily compiled backwards included); empty: serial, or nothing watched
    recompiles: list[int] = field(default_factory=list)
    compiles: list[int] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # this process's lanes (engine runs only)


@dataclass
class PhaseRecord:
    """One phase of one block as the seams recorded it: a no-grad pass, sharded or on home alone
    (``seams_common.run_phase``), or the block quantizer's time (``"tune"``)."""

    block: str
    phase: str  # "collection" | "search" | "tune"
    world: int  # lanes used; 0 for a "tune" record (the tuner's own plan decides, see integration)
    seconds: float
    detail: str = ""  # the hooks merged / the items per lane
    reasons: list[str] = field(default_factory=list)  # why home alone, or why fewer lanes
    fell_back: bool = False
    nested: bool = False  # a detail inside another record's time (not summed by phase_seconds)


@dataclass(slots=True)
class SeamScratch:
    """What the seams keep for one run between the patched functions they replace (slots: a
    misspelt name raises instead of making a new attribute)."""

    logged: set = field(default_factory=set)  # the keys of the phase log lines said (once each)
    init_scales: dict = field(default_factory=dict)  # id(home layer) -> (key, init_scale) precomputed on lanes
    current_layer: object = None  # the layer whose SignRoundV2 wrapper is being built
    init_scale_hits: int = 0
    block_name: str = ""  # the block whose quantize_block is running (for nested records)
    awq_grid: object = None  # the AWQ grid search running now (None: serial)
    awq_clips: dict = field(default_factory=dict)  # id(home layer) -> (key, clip range) precomputed on lanes
    awq_clip_hits: int = 0


@dataclass(slots=True)
class Run(SpecSettings):
    """One ``enable()`` (or one seams-only install, ``seams_only``): its settings (``spec``, validated
    once where they came in: the CLI, ``enable()``; read through :class:`dpq.planning.spec.SpecSettings`),
    its records (the tuner's per block, the seams' per phase) and the seams' scratch."""

    spec: ParallelSpec = field(default_factory=ParallelSpec)
    auto_world: AutoWorld | None = None  # 'auto': the run's cost model (one per enable())
    auto_given: bool = False  # the caller gave it: used even where lanes share a device
    # shard_seams.install: the no-grad phases over lanes alone; each block's tune is auto-round's own
    # (the tuner's replacements are handed the run below it: dpq.autoround.patches.enabled_run)
    seams_only: bool = False
    records: list[BlockRecord] = field(default_factory=list)
    phases: list[PhaseRecord] = field(default_factory=list)
    seams: SeamScratch = field(default_factory=SeamScratch)
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
    # what the run works on now: a block's name while auto-round quantizes it, "save" while the output
    # is written (dpq.autoround.ranks), "" between them; a failure's report says where it stopped
    at: str = ""

    def lane_devices(self):
        """The lanes' devices: the given ``devices``, else auto-round's device list (``--device_map``)
        when it lists several, else None (the plan's default)."""
        if self.devices is not None:
            return self.devices
        listed = [str(d) for d in (device_manager.device_list or []) if d is not None]
        return listed if len(listed) > 1 else None

    def record_phase(self, block: str, phase: str, world: int, seconds: float, detail: str = "",
                     reasons: Sequence[str] = (), *, fell_back: bool = False, nested: bool = False) -> None:
        """Append one :class:`PhaseRecord` (the only place one is made)."""
        self.phases.append(PhaseRecord(block, phase, world, seconds, detail, list(reasons), fell_back, nested))
