"""What the per-phase seams share: the run they are handed, the per-pass lane plan, the one phase runner.

The seams (``seams_collection``, ``seams_rtn``, ``seams_init_scale``, ``seams_awq``) run
auto-round's no-grad phases over lanes with :mod:`dpq.sharded.shard`; every one is bitwise serial.
Each patched function is handed its :class:`dpq.autoround.run.Run` as its first argument (the
patch table's top frame: Note [each replacement is handed its run] in :mod:`dpq.autoround.patches`;
:func:`or_idle` when nothing is installed) and passes it down: its settings (``world``,
``devices``, ``processes``), its phase records and the seams' scratch (``Run.seams``: precomputed
search results, the AWQ grid in progress). With ``world == 'off'`` every replacement passes
straight through to auto-round's own function.
Every phase runs through :func:`run_phase`: the lane plan, the serial and the sharded path, the
answer to a lane failure, the record and the log line are its alone.

Hooks whose statistics merge (anything else makes the pass run on home alone):

==============================================================  =======================================
hook (auto-round 0.16.1 / 0.17)                                 merge
==============================================================  =======================================
``AlgorithmComposer._register_act_max_hooks`` collect_act_max   ``act_max``: max (bitwise)
``OptimizedRTNQuantizer._register_imatrix_hooks``               ``imatrix``: sum, ``imatrix_cnt``: count
``SignRoundV2Quantizer._register_imatrix_hooks``                ``imatrix``: sum
``AWQTransform._register_awq_hooks`` (activation, parent args)  ordered sink: lanes run in sample order
==============================================================  =======================================

Several processes (torchrun, the run's ``processes``): a collection pass without hooks runs
over the global lanes (``run_phase(processes=...)``, :mod:`dpq.sharded.shard_processes`); a pass
with any of the hooks above runs on each rank's home alone (``refusals.PASS_HOOKS_PROCESSES``:
these merges follow lane order inside one process and have no canonical order across processes
yet), and AWQ's grid replays too (``refusals.PASS_DIST_ACTIVE``). Per-item searches (RTN,
init-scale) use this process's own lanes only; every rank searches every item.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from dpq import refusals
from dpq.planning.distributed import ProcessSet, Topology, peer_lost
from dpq.planning.plan import PlanRefused, PlanRequest
from dpq.session import lanes_for
from dpq.sharded.shard_processes import agree_lanes
from dpq.streams import make_lanes

from . import patches
from .run import PhaseRecord, Run

__all__ = [
    "OnLaneFailure",
    "ParallelLaneError",
    "PhaseSpec",
    "or_idle",
    "phase_seconds",
    "plan_lanes",
    "records",
    "reported",
    "run_phase",
]

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
T = TypeVar("T")


class ParallelLaneError(RuntimeError):
    """A lane failed mid-block under an explicit world; the home block was restored first.

    ``block``: the block that failed; ``completed``: the blocks quantized before it in this run
    (in place, in the model object, in this process only)."""

    def __init__(self, message: str, *, block: str = "", completed: list[str] | None = None) -> None:
        super().__init__(message)
        self.block = block
        self.completed = list(completed or [])


def or_idle(run: Run | None) -> Run:
    """The run a seam was handed, or with nothing installed (a replacement left under someone else's
    patch) a fresh idle one (world 'off': everything passes through)."""
    return Run() if run is None else run


def reported() -> Run:
    """The run whose phase records are read: the top frame's, else (after the outermost
    uninstall) the last run's; an empty one when nothing ever ran."""
    return or_idle(patches.reported(seams=True))


def records() -> list[PhaseRecord]:
    return list(reported().phases)


def phase_seconds() -> dict[str, float]:
    """Seconds per phase summed over every block recorded in the run.

    "tune" is the block quantizer's ``quantize_block`` of a tuning algorithm minus the searches
    timed inside it (SignRoundV2 init-scale searches, counted as "search"); at ``iters=0`` the
    whole ``quantize_block`` is "search"."""
    recs = reported().phases
    out = {"collection": 0.0, "search": 0.0, "tune": 0.0}
    tuned_blocks = {r.block for r in recs if r.phase == "tune" and not r.nested}
    for r in recs:
        if not r.nested:
            out[r.phase] = out.get(r.phase, 0.0) + r.seconds
        elif r.phase == "search" and r.block in tuned_blocks:
            out["search"] += r.seconds
            out["tune"] -= r.seconds
    return out


def plan_lanes(run: Run, units: int, price: int | None, reasons: list[str]):
    """Lanes for a pass of ``units`` indivisible pieces (batches, layers), or None for home alone.

    The same plan the tuner gets (``dpq.session.lanes_for``: world, devices, memory), with the world
    capped at ``units`` (a pass cannot use more lanes than it has pieces). An explicit world
    that cannot be served raises :class:`dpq.planning.plan.PlanRefused` here, before the block's work.
    """
    w = run.world
    if w == "off" or w == 1 or units < 2 or reasons:
        return None
    from auto_round.utils.device_manager import device_manager

    capped = min(w, units) if isinstance(w, int) else w
    plan, lanes = lanes_for(PlanRequest(world=capped, devices=run.lane_devices(), samples_per_iter=units,
                                        home=torch.device(device_manager.device), mirror_bytes=price))
    reasons.extend(plan.reasons)
    return lanes


def _process_lanes(run: Run, units: int, price: int | None, reasons: list[str]):
    """This process's lanes for a pass over global lanes (None: it must run home alone, ``reasons``
    extended). Its own plan (``plan_lanes``), or the home device alone where that plans one lane
    (world 1: the processes are the lanes); an explicit world it cannot serve makes it run alone
    (the block's tune agreement then refuses with every rank's reasons)."""
    notes: list[str] = []  # plan_lanes' notes say why fewer lanes: the agreed count says it for every rank
    try:
        lanes = plan_lanes(run, units, price, notes)
    except PlanRefused as err:
        reasons.extend(err.reasons)
        return None
    if lanes is not None:
        return lanes
    from auto_round.utils.device_manager import device_manager

    return make_lanes([device_manager.device])


@dataclass(frozen=True)
class OnLaneFailure:
    """A phase that answers a lane failure (its ``sharded`` run has put home back before it raises):
    under ``auto`` a warning (``what`` failed, ``restored`` was put back) and the serial rerun,
    under an explicit world :class:`ParallelLaneError` with ``refused(lanes, repr(err))``."""

    what: str
    restored: str
    refused: Callable[[int, str], str]


@dataclass(frozen=True)
class PhaseSpec(Generic[T]):
    """What one no-grad phase is, as a seam describes it to :func:`run_phase`.

    ``phase``: its record's phase ("collection", "search"); ``serial()``: the phase on home, as
    auto-round runs it; ``sharded(lanes)`` (several processes: ``sharded(lanes, topology)``): the
    phase over lanes. ``units``: its indivisible pieces (the lanes planned are capped at them),
    ``price``: a lane's bytes. ``detail``: the sharded run's record text (a callable gets the lane
    count after the run); ``log(world, detail, reasons)`` -> (key, message): its log line, said
    once per key. ``home``: the record text of a home-alone run (None: none recorded), recorded
    when refused, or with ``every_run`` always (and logged: collection passes say where they ran);
    ``time_home`` False: that record has no seconds of its own (its run is timed by an enclosing
    one). ``failure``: how a lane failure is answered (None: it propagates). ``nested``: every
    record of it is a detail inside another record's time."""

    phase: str
    serial: Callable[[], T]
    sharded: Callable[..., T]
    units: int = 0
    price: int | None = None
    detail: str | Callable[[int], str] = ""
    home: str | None = None
    every_run: bool = False
    time_home: bool = True
    log: Callable[[int, str, list[str]], tuple[Hashable, str]] | None = None
    failure: OnLaneFailure | None = None
    nested: bool = False

    def detail_for(self, world: int) -> str:
        return self.detail if isinstance(self.detail, str) else self.detail(world)


def run_phase(run: Run, block: str, spec: PhaseSpec[T], *, reasons: list[str],
              processes: ProcessSet | None = None) -> T:
    """One no-grad phase of ``block`` (``spec``: :class:`PhaseSpec`): planned, run sharded or
    serially, recorded, logged once.

    ``reasons`` (why home alone; empty: plan lanes for ``spec.units`` pieces at ``spec.price``
    bytes, the plan's notes appended) decide the path: ``spec.serial()`` on home, or
    ``spec.sharded(lanes)``, recorded with ``spec.detail`` and logged with ``spec.log``. A
    home-alone run is recorded with ``spec.home`` when refused, or with ``spec.every_run`` always
    (and then logged too); with ``spec.time_home`` False that record is written before
    ``serial()`` with no seconds of its own.

    A lane failure: with ``spec.failure``, as :class:`OnLaneFailure` says (the rerun recorded with
    the lane failure as its reason, ``fell_back``); without, it propagates as raised. ``processes``
    (several processes): the pass runs over the global lanes, ``spec.sharded(lanes, topology)``
    with the lane count every rank agreed (0 anywhere: every rank runs it home alone, every rank's
    reasons recorded); every rank reaches this for the same passes and calls ``agree_lanes`` once,
    and a failure anywhere in the agreement or the sharded run is fatal on every rank
    (``ProcessSet.stop``: no serial rerun across processes, the ranks could not agree on one).
    """
    t0 = time.perf_counter()

    def report(world: int, text: str, why: list[str], *, fell_back: bool = False, logged: bool = True) -> None:
        run.record_phase(block, spec.phase, world, time.perf_counter() - t0, text, why, fell_back=fell_back,
                         nested=spec.nested)
        if logged and spec.log is not None:
            key, message = spec.log(world, text, why)
            if key not in run.seams.logged:
                run.seams.logged.add(key)
                from auto_round.logger import logger

                logger.info(message)

    def home_alone(why: list[str]) -> T:
        recorded = spec.home is not None and (spec.every_run or bool(why))
        if recorded and not spec.time_home:
            run.record_phase(block, spec.phase, 1, 0.0, spec.home, why, nested=spec.nested)
        out = spec.serial()
        if recorded and spec.time_home:
            report(1, spec.home, why, logged=spec.every_run)
        return out

    if processes is not None:
        try:
            lanes = None if reasons else _process_lanes(run, spec.units, spec.price, reasons)
            agreed, alone = agree_lanes(processes, 0 if lanes is None else len(lanes), reasons)
            if agreed:
                # no more global lanes than pieces (a lane without a piece would only build a mirror)
                topology = Topology(processes.size, processes.rank,
                                    max(1, min(agreed, spec.units // processes.size)))
                out = spec.sharded(lanes[: topology.lanes], topology)
        except BaseException as err:
            stopped = processes.stop(err, peer_lost(err))
            if not isinstance(err, Exception):
                raise  # an interrupt stays an interrupt; the peers were told
            raise stopped from err
        if not agreed:
            return home_alone(alone or reasons)
        report(topology.world, f"{spec.detail_for(topology.world)}; {topology.describe()}", [])
        return out
    lanes = plan_lanes(run, spec.units, spec.price, reasons)
    if lanes is None:
        return home_alone(reasons)
    try:
        out = spec.sharded(lanes)
    except Exception as err:
        failure = spec.failure
        if failure is None:
            raise
        if run.world != "auto":
            raise ParallelLaneError(failure.refused(len(lanes), repr(err))) from err
        from auto_round.logger import logger

        logger.warning(refusals.pass_lane_failed_rerun(failure.what, repr(err), failure.restored))
        out = spec.serial()
        report(1, spec.home or "", [refusals.lane_failure(repr(err))], fell_back=True, logged=spec.every_run)
        return out
    report(len(lanes), spec.detail_for(len(lanes)), reasons)
    return out


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
