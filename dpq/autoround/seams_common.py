"""What the per-phase seams share: the installed config, the run's scratch, the per-pass lane plan.

The seams (``seams_collection``, ``seams_rtn``, ``seams_init_scale``, ``seams_awq``) run
auto-round's no-grad phases over lanes with :mod:`dpq.shard`; every one is bitwise serial.
Each replacement reads the installed config (``world``, ``devices``) from the patch table's
top frame (:func:`dpq.autoround.patches.current`) and keeps its per-run scratch (phase
records, precomputed search results, the AWQ grid in progress) in that frame; with
``world == 'off'`` every replacement passes straight through to auto-round's own function.

Hooks whose statistics merge (anything else makes the pass run on home alone):

==============================================================  =======================================
hook (auto-round 0.16.1 / 0.17)                                 merge
==============================================================  =======================================
``AlgorithmComposer._register_act_max_hooks`` collect_act_max   ``act_max``: max (bitwise)
``OptimizedRTNQuantizer._register_imatrix_hooks``               ``imatrix``: sum, ``imatrix_cnt``: count
``SignRoundV2Quantizer._register_imatrix_hooks``                ``imatrix``: sum
``AWQTransform._register_awq_hooks`` (activation, parent args)  ordered sink: lanes run in sample order
==============================================================  =======================================

Several processes (torchrun, the config's ``processes``): a collection pass without hooks runs
over the global lanes (``ShardedRunner._across_processes``, :mod:`dpq.shard_processes`); a pass
with any of the hooks above runs on each rank's home alone (``refusals.PASS_HOOKS_PROCESSES``:
these merges follow lane order inside one process and have no canonical order across processes
yet), and AWQ's grid replays too (``refusals.PASS_DIST_ACTIVE``). Per-item searches (RTN,
init-scale) use this process's own lanes only; every rank searches every item.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpq import refusals
from dpq.plan import PlanRequest
from dpq.session import lanes_for

from . import patches

__all__ = ["ParallelLaneError", "PhaseRecord", "SeamRun", "config", "log_once", "phase_seconds",
           "plan_lanes", "records", "scratch", "world"]

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


class ParallelLaneError(RuntimeError):
    """A lane failed mid-block under an explicit world; the home block was restored first.

    ``block``: the block that failed; ``completed``: the blocks quantized before it in this run
    (in place, in the model object, in this process only)."""

    def __init__(self, message: str, *, block: str = "", completed: list[str] | None = None) -> None:
        super().__init__(message)
        self.block = block
        self.completed = list(completed or [])


@dataclass
class PhaseRecord:
    """One sharded (or home-alone) phase of one block."""

    block: str
    phase: str  # "collection" | "search" | "tune"
    world: int  # lanes used; 0 for a "tune" record (the tuner's own plan decides, see integration)
    seconds: float
    detail: str = ""  # the hooks merged / the items per lane
    reasons: list[str] = field(default_factory=list)  # why home alone, or why fewer lanes
    fell_back: bool = False
    nested: bool = False  # a detail inside another record's time (not summed by phase_seconds)


@dataclass
class SeamRun:
    """The seams' scratch for one install (one frame of the patch table)."""

    records: list[PhaseRecord] = field(default_factory=list)
    logged: set = field(default_factory=set)
    init_scales: dict = field(default_factory=dict)  # id(home layer) -> (key, init_scale) precomputed on lanes
    current_layer: object = None  # the layer whose SignRoundV2 wrapper is being built
    init_scale_hits: int = 0
    block_name: str = ""  # the block whose quantize_block is running (for nested records)
    awq_grid: object = None  # the AWQ grid search running now (None: serial)
    awq_clips: dict = field(default_factory=dict)  # id(home layer) -> (key, clip range) precomputed on lanes
    awq_clip_hits: int = 0


_IDLE = SeamRun()  # what scratch() gives when nothing is installed (never read back)


def config():
    """The installed config (``world``, ``devices``), or None."""
    return patches.current()


def scratch(frame=None) -> SeamRun:
    """The seams' scratch in ``frame`` (default: the top frame; after the run, the last one)."""
    frame = frame or patches.frame() or patches.last()
    if frame is None:
        return _IDLE
    return frame.scratch.setdefault("seams", SeamRun())


def world() -> int | str:
    return getattr(config(), "world", "off")


def records() -> list[PhaseRecord]:
    return list(scratch().records)


def phase_seconds(frame=None) -> dict[str, float]:
    """Seconds per phase summed over every block recorded in the run.

    "tune" is the block quantizer's ``quantize_block`` of a tuning algorithm minus the searches
    timed inside it (SignRoundV2 init-scale searches, counted as "search"); at ``iters=0`` the
    whole ``quantize_block`` is "search"."""
    recs = scratch(frame).records
    out = {"collection": 0.0, "search": 0.0, "tune": 0.0}
    tuned_blocks = {r.block for r in recs if r.phase == "tune" and not r.nested}
    for r in recs:
        if not r.nested:
            out[r.phase] = out.get(r.phase, 0.0) + r.seconds
        elif r.phase == "search" and r.block in tuned_blocks:
            out["search"] += r.seconds
            out["tune"] -= r.seconds
    return out


def log_once(key, message: str) -> None:
    r = scratch()
    if key not in r.logged:
        r.logged.add(key)
        from auto_round.logger import logger

        logger.info(message)


def lane_devices():
    devices = getattr(config(), "devices", None)
    if devices is not None:
        return devices
    from auto_round.utils.device_manager import device_manager

    dl = [d for d in (device_manager.device_list or []) if d is not None]
    return [str(d) for d in dl] if len(dl) > 1 else None


def plan_lanes(units: int, price: int | None, reasons: list[str]):
    """Lanes for a pass of ``units`` indivisible pieces (batches, layers), or None for home alone.

    The same plan the tuner gets (``dpq.session.lanes_for``: world, devices, memory), with the world
    capped at ``units`` (a pass cannot use more lanes than it has pieces). An explicit world
    that cannot be served raises :class:`dpq.plan.PlanRefused` here, before the block's work.
    """
    w = world()
    if w == "off" or w == 1 or units < 2 or reasons:
        return None
    from auto_round.utils.device_manager import device_manager

    capped = min(w, units) if isinstance(w, int) else w
    plan, lanes = lanes_for(PlanRequest(world=capped, devices=lane_devices(), samples_per_iter=units,
                                        home=torch.device(device_manager.device), mirror_bytes=price))
    reasons.extend(plan.reasons)
    return lanes


def mirror_refusals(module: torch.nn.Module, label: str) -> list[str]:
    """Why ``module`` cannot be mirrored onto lanes (empty: it can)."""
    reasons = []
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        reasons.append(refusals.weights_span(label, len(devices)))
    elif devices and next(iter(devices)).type == "meta":
        reasons.append(refusals.on_meta(label))
    if any(hasattr(m, "_hf_hook") for m in module.modules()):
        reasons.append(refusals.dispatch_hooks(label))
    for name, m in module.named_modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and getattr(fwd, "__self__", m) is not m:
            # a mirror would deep-copy whatever the replacement forward is bound to
            reasons.append(refusals.forward_replaced(name or "the " + label, type(fwd).__name__))
            break
    return reasons


def pool_device_refusals(*pools, text) -> list[str]:
    """auto-round 0.17's ``--calibration_data_device`` may spread a pool over several devices: the
    tune's lanes bring each sample from where it lives (``dpq.mirror.LaneData``), a no-grad pass
    over such a pool runs on home alone; ``text`` says so (``refusals.pool_spread_devices``)."""
    devices = {t.device for pool in pools if isinstance(pool, list) for t in pool if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        return [text(len(devices), sorted(map(str, devices)))]
    return []


def hook_name(fn) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", type(fn).__name__)
