"""One block's data-parallel run, from an explicit config and the task an adapter describes.

::

    run(config, task)
      plan     block_plan: dpq.planning.plan.resolve -> Plan(lanes, communicator, exchange, reasons), frozen
      ran      LaneRun: what the block's lanes run, read by the task and the records (the plan stays
               as resolved): the lanes and their Topology (P = 1 in one process) as agreed across
               processes, then as 'auto' kept them; the communicator as built; the optimizer step
      serial   the plan says one lane and the tuner has its own serial run: that runs, untouched
      start    task.start(ran): the adapter readies the block (wraps it) -> TuneSpec
      lanes    make_lanes(ran.devices); the plan's communicator and exchange policy
      replicas ReplicaSet(block, lanes, spec.tuned)
      engine   TuneEngine; run_loop (dpq.tune_loop)
      teardown replicas.close() (joins the lanes, drops the mirrors)
      finish   task.finish(outcome, ran): the adapter puts the best values home (unwraps)

The failure policy, in this one place: any failure after the plan (start, lanes, loop,
finish) puts the home block back exactly as it was when ``run`` was called
(:class:`BlockSnapshot`), lets go of everything the failed run held
(:func:`release_run`: its frames, so its mirrors, engine and optimizers, are freed before
anything else runs), then under ``world='auto'`` reruns the block with the tuner's serial
run from the same RNG state, and under an explicit world raises the task's error (``task.lane_error``;
the error itself when the task has none). Interrupts are restored and re-raised.

Several processes (``SessionConfig.processes``, torchrun): every rank plans its own lanes and
the plans are agreed first (:func:`dpq.planning.distributed.agree`: one refusal stops every rank before
any work, with every rank's reasons); the communicator is ``ProcessGroupCommunicator`` over this
process's lanes. Any failure there is fatal on every rank: no serial rerun (the ranks could not
agree on it), home restored exactly as above, and a :class:`dpq.planning.distributed.RankFailure` naming
the rank it started on (``ProcessSet.stop``).
"""

from __future__ import annotations

import copy
import itertools
import random
import socket
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from dpq import cancel, refusals
from dpq.comm.comm_streams import CommStreams, comm_lanes
from dpq.comm.communicators import build_planned, select_communicator
from dpq.comm.process_group import ProcessGroupCommunicator
from dpq.engine import phases
from dpq.engine.compiles import CompileWatch
from dpq.engine.exchange import exchange_for
from dpq.engine.watchdog import GRACE_S
from dpq.mirror import ReplicaSet, release_cached_memory
from dpq.planning.cost_model import AutoWorld
from dpq.planning.distributed import ProcessSet, RankPlan, Topology, agree, in_collective, peer_lost
from dpq.planning.plan import ONE_LANE_EXCHANGE, BlockPrice, Plan, PlanRefused, PlanRequest, resolve
from dpq.planning.spec import ParallelSpec, SpecSettings
from dpq.streams import Lane, make_lanes
from dpq.tune_loop import LanesHung, LoopOutcome, TuneEngine, TuneSpec, run_loop

__all__ = ["BlockRun", "BlockSnapshot", "BlockTask", "LaneRun", "SessionConfig", "agree_plan", "block_plan",
           "lanes_for", "release_run", "run"]


DEFAULT_TIMEOUT_S = 600.0  # auto-round-dp's --parallel_timeout default
# ProcessGroupNCCL's watchdog acts at the group's timeout (the same setting) and, with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default: "tearing down process without aborting NCCL
# communicator", https://pytorch.org/docs/stable/torch_nccl_environment_variables.html), ends the
# process before any rank could be named; dpq's watchdog fires at this fraction of it first.
PG_WATCHDOG_LEAD = 0.9
OVERLAP_NOTE = "; on a second stream per lane (overlap)"  # the communicator reason's, with CommStreams


@dataclass
class SessionConfig(SpecSettings):
    """What the user asked for, as ``spec`` (:class:`dpq.planning.spec.ParallelSpec`, validated where it came in:
    the CLI, ``enable()``, ``parallel_tune``), read through :class:`dpq.planning.spec.SpecSettings`: ``world``
    ('auto', 'off' or an int), ``devices`` (None: the plan's default), ``debug_identical`` (check the
    lanes bitwise after every step), ``overlap`` and ``timeout``. With ``processes`` (more than one),
    ``world``/``devices`` are each process's local lanes and the global world is the processes times
    the agreed local lane count (:func:`dpq.planning.distributed.agree`). ``auto_world``: under 'auto', the run's
    cost model; after the memory check it keeps the first W of the fitting lanes, W by predicted time
    (None: every fitting lane)."""

    spec: ParallelSpec = field(default_factory=lambda: ParallelSpec("auto"))
    auto_world: AutoWorld | None = None  # one per run: 'auto' picks the world by predicted time
    # Several processes (torchrun): the group this run spans, given explicitly
    # (dpq.planning.distributed.ProcessSet.detect()); ``world`` and ``devices`` are then this process's lanes.
    processes: ProcessSet | None = None
    caller: str = "cli"  # how a refusal's fix names settings (dpq.planning.plan.PlanRequest.caller)

    def watchdog_s(self) -> float:
        """The readback's deadline: the timeout in one process; across processes a little less
        (:data:`PG_WATCHDOG_LEAD`), so that dpq's watchdog fires before ProcessGroupNCCL's own."""
        several = self.processes is not None and self.processes.size > 1
        return self.timeout * PG_WATCHDOG_LEAD if several else self.timeout


@dataclass(frozen=True)
class LaneRun:
    """What one block's lanes run, beside the :class:`dpq.planning.plan.Plan` they came from (``plan``, as
    resolved). ``devices``: this process's lanes (the plan's, as many as the processes agreed on,
    then as many as 'auto''s cost model kept; lane 0 home); ``topology``: the processes x these
    lanes (:meth:`dpq.planning.distributed.Topology.alone` in one process, or where every rank runs the
    block alone), its ``lanes`` always ``len(devices)``. ``in_process``/``in_process_reason``: the
    communicator among this process's lanes as built, and why (the plan's choice, or the one made on the lanes);
    ``across``: the process-group communicator's name across processes ("" in one process);
    ``overlap``: the exchange on a second stream per lane (:mod:`dpq.comm.comm_streams`). ``notes``: what
    the run said beyond the plan's notes (the agreement, 'auto''s choice); ``step``: the optimizer
    step the lanes run, and why (the engine's). Built anew at each of these points
    (``dataclasses.replace``), never changed."""

    plan: Plan
    devices: list[torch.device]
    topology: Topology
    in_process: str = "local"
    in_process_reason: str = ONE_LANE_EXCHANGE
    across: str = ""
    overlap: bool = False
    notes: list[str] = field(default_factory=list)
    step: str = ""

    def __post_init__(self) -> None:
        if self.topology.lanes != len(self.devices):
            raise ValueError(f"dpq: a topology of {self.topology.lanes} local lanes for {len(self.devices)} devices")

    @classmethod
    def planned(cls, plan: Plan, topology: Topology | None = None, notes: Sequence[str] = ()) -> LaneRun:
        """The plan's lanes (as many as ``topology`` agreed on; None: this process alone, every
        lane of the plan) and its communicator choice."""
        topology = topology if topology is not None else Topology.alone(plan.local_lanes)
        return cls(plan, list(plan.devices[: topology.lanes]), topology, plan.communicator,
                   plan.communicator_reason, notes=list(notes))

    def first_lanes(self, lanes: int) -> LaneRun:
        """The first ``lanes`` of this process's lanes, the topology's local lanes with them (what
        'auto''s cost model kept)."""
        return replace(self, devices=self.devices[:lanes], topology=replace(self.topology, lanes=lanes))

    @property
    def local_lanes(self) -> int:
        """This process's lanes."""
        return len(self.devices)

    @property
    def world(self) -> int:
        """The lanes over every process (``topology.world``)."""
        return self.topology.world

    @property
    def communicator(self) -> str:
        """The exchange's communicator by name: the process group's across processes, else the
        in-process one; ``+comm-streams`` with overlap (:class:`dpq.comm.comm_streams.CommStreams`)."""
        name = self.across or self.in_process
        return name + CommStreams.SUFFIX if self.overlap else name

    @property
    def communicator_reason(self) -> str:
        reason = self.in_process_reason
        if self.across:
            reason = (f"{self.topology.processes} processes: {self.in_process} inside each, {self.across} across "
                      f"them ({reason})")
        why = f" ({self.plan.overlap_reason})" if self.plan.overlap_reason else ""
        if self.overlap:
            return reason + OVERLAP_NOTE + why
        if self.plan.exchange.overlap and self.world > 1:  # host lanes (Note [host lanes exchange during the backward])
            return reason + f"; the exchange during the backward{why}"
        return reason + (f"; the exchange after the backward{why}" if why and self.world > 1 else "")

    @property
    def said(self) -> list[str]:
        """The plan's reasons and notes, then the run's notes."""
        return [*self.plan.said, *self.notes]


@dataclass
class BlockTask:
    """One block as the adapter describes it.

    ``start(ran)`` readies the block for tuning (e.g. wraps it) and returns the
    :class:`dpq.tune_loop.TuneSpec`, or None when there is nothing to tune; ``finish(outcome,
    ran)`` puts the tuned values home (``outcome`` None when nothing was tuned) and returns the
    adapter's result (``ran``: :class:`LaneRun`, the lanes as they ran). ``serial()``: the tuner's
    own serial run of the block (run when the plan says serial, and as ``auto``'s fallback); None:
    the session's engine runs even at world 1. ``lane_error(err, ran)``: the error an explicit world
    raises when the run fails (``ran``: the lanes as planned and agreed).
    ``samples_per_iter``, ``price`` (the block's lane prices, :class:`dpq.planning.plan.BlockPrice`) or
    ``mirror_bytes`` (a flat one per mirror), ``extra_reasons`` (tuner features the lanes cannot
    split) and ``pure_sign`` (the update needs only sign(sum of grads)) go to the plan."""

    name: str
    block: torch.nn.Module
    start: Callable[[LaneRun], TuneSpec | None]
    finish: Callable[[LoopOutcome | None, LaneRun], object]
    samples_per_iter: int
    pool_samples: int | None = None  # the calibration samples there are (a refusal names the limit)
    asked_samples: int | None = None  # the calibration samples asked for (the data may give fewer)
    home: torch.device | str | None = None  # None: the device the block's first parameter is on
    pure_sign: bool = False
    mirror_bytes: int | None = None
    price: BlockPrice | None = None
    extra_reasons: Sequence[str] = ()
    serial: Callable[[], object] | None = None
    lane_error: Callable[[BaseException, LaneRun], BaseException] | None = None
    on_fallback: Callable[[BaseException], None] | None = None  # e.g. log a warning before the rerun


@dataclass
class BlockRun:
    """What ``run`` did: the lanes (``ran``; its plan as resolved), the adapter's result, the loop's
    outcome (None when the tuner's serial run ran or nothing was tuned), and whether a lane failure
    made ``auto`` fall back."""

    ran: LaneRun
    result: object
    outcome: LoopOutcome | None
    seconds: float
    serial: bool = False
    fell_back: bool = False
    failure: str = ""  # repr of the lane failure when fell_back
    # torch.compile during the lanes' forwards and backwards, per local lane (dpq.engine.compiles); None: serial
    compiles: CompileWatch | None = None

    @property
    def plan(self) -> Plan:
        return self.ran.plan

    @property
    def topology(self) -> Topology:
        """The processes x lanes the block ran on (``topology.describe()`` across processes)."""
        return self.ran.topology


def block_device(block: torch.nn.Module) -> torch.device | None:
    """Where the block is: its first parameter's (or buffer's) device; None for a block that holds
    neither (the plan then takes the machine's default accelerator)."""
    first = next(block.parameters(), None)
    if first is None:
        first = next(block.buffers(), None)
    return None if first is None else first.device


def block_plan(config: SessionConfig, task: BlockTask) -> Plan:
    """The block's plan (raises :class:`dpq.planning.plan.PlanRefused` for an explicit world it cannot serve)."""
    return resolve(PlanRequest(world=config.world, devices=config.devices, samples_per_iter=task.samples_per_iter,
                               pool_samples=task.pool_samples, asked_samples=task.asked_samples, caller=config.caller,
                               home=task.home if task.home is not None else block_device(task.block),
                               extra_reasons=list(task.extra_reasons),
                               mirror_bytes=task.mirror_bytes, pure_sign=task.pure_sign, price=task.price,
                               processes=config.processes.size if config.processes is not None else 1,
                               overlap=config.overlap, order=config.order))


def lanes_for(request: PlanRequest) -> tuple[Plan, list[Lane] | None]:
    """A no-grad pass's plan and lanes (None: home alone). The sharded passes' entry point: the
    same plan as the tuner's; their teardown is ``dpq.sharded.shard``'s (``ReplicaSet.close``)."""
    plan = resolve(request)
    return plan, (make_lanes(plan.devices) if plan.local_lanes >= 2 else None)


def run(config: SessionConfig, task: BlockTask, *, plan: Plan | None = None) -> BlockRun:
    """Run one block (see the module docstring). ``plan``: one already resolved by the caller."""
    t0 = time.perf_counter()
    procs = config.processes if config.processes is not None and config.processes.size > 1 else None
    if procs is not None:  # PlanRefused on every rank, or a lost rank's RankFailure: nothing started
        ran = _agreed_plan(config, task, procs, plan)
        if not ran.topology.several:
            procs = None  # serial on every rank: each runs the block alone, the same way
    else:
        ran = LaneRun.planned(plan if plan is not None else block_plan(config, task))  # PlanRefused: nothing started
    if ran.world == 1 and task.serial is not None and (config.world != 1 or ran.plan.reasons):
        return BlockRun(ran, task.serial(), None, time.perf_counter() - t0, serial=True)
    rng = (random.getstate(), torch.get_rng_state())
    snapshot = BlockSnapshot(task.block)
    watch = CompileWatch(ran.local_lanes)
    try:
        with watch:
            outcome, result, done = _run_lanes(config, ran, task, procs, watch)
    except BaseException as err:
        if isinstance(err, LanesHung) and err.stuck:
            # dpq.tune_loop.LanesHung: work queued on the lanes' devices never ends, so any wait on them
            # (the restore's copies, a serial rerun) would hang too; the error says so and what to do.
            raise
        snapshot.restore()
        del snapshot
        # read before the traceback is released; a watchdog expiry across processes waited for a peer
        lost = procs is not None and (peer_lost(err) or (isinstance(err, LanesHung) and err.peer_lost))
        release_run(err, task.name if task.name.startswith("dpq") else f"dpq ({task.name})")
        release_cached_memory(ran.devices)  # what only the failed run's frames held is free now
        if procs is not None:  # fatal on every rank: ranks could not agree on a serial rerun
            del rng
            _stop_every_rank(procs, err, lost)
        fall_back = isinstance(err, Exception) and config.world == "auto" and task.serial is not None
        if fall_back:
            if task.on_fallback is not None:
                task.on_fallback(err)
            random.setstate(rng[0])
            torch.set_rng_state(rng[1])
        del rng  # this frame stays in the error's traceback: it holds nothing of the run
        if not isinstance(err, Exception):
            raise  # an interrupt: the block is back, nothing reruns
        if fall_back:
            result = task.serial()
            return BlockRun(ran, result, None, time.perf_counter() - t0, serial=True, fell_back=True,
                            failure=repr(err))
        if task.lane_error is not None:  # (an explicit world: 'auto' alone changes the lanes in the run)
            raise task.lane_error(err, ran) from err
        raise
    return BlockRun(done, result, outcome, time.perf_counter() - t0, compiles=watch)


def _stop_every_rank(procs: ProcessSet, err: BaseException, lost: bool) -> None:
    """Several processes: this rank's failure (or a peer's, seen as a failed collective) stops
    every rank (dpq.planning.distributed: reports, the rank it started on named). Raises."""
    failure = procs.stop(err, lost)
    if not isinstance(err, Exception):
        raise err  # an interrupt stays an interrupt; the peers were told
    raise failure from err


def _agreed_plan(config: SessionConfig, task: BlockTask, procs: ProcessSet, plan: Plan | None) -> LaneRun:
    """The task's plan (``plan``, or planned here) agreed with every other rank's (:func:`agree_plan`)."""
    return agree_plan(config, procs, task.samples_per_iter, bool(task.extra_reasons),
                      lambda: plan if plan is not None else block_plan(config, task), task.pool_samples or 0,
                      task.asked_samples or 0)


def agree_plan(config: SessionConfig, procs: ProcessSet, samples_per_iter: int, cannot_split: bool,
               make_plan: Callable[[], Plan], pool_samples: int = 0, asked_samples: int = 0) -> LaneRun:
    """This rank's plan (``make_plan()``; :class:`dpq.planning.plan.PlanRefused` counts as this rank's
    refusal) agreed with every other rank's (dpq.planning.distributed.agree): the same local lane count
    everywhere, or the same refusal everywhere (raised on every rank), or serial everywhere
    (each rank alone: ``topology.several`` False; ``cannot_split``: the tuner has features the lanes
    cannot split). Returns the plan's lanes as agreed, with the agreement's notes. An adapter calls
    it before a block's work to refuse an explicit world there; the session, to run it."""
    plan = None
    try:
        try:
            plan = make_plan()
            mine = RankPlan(config.world, plan.local_lanes, list(plan.reasons),
                            serial=config.world == "off" or cannot_split, host=socket.gethostname(),
                            # not one physical device across processes: cpu (the host's), hpu (the bridge
                            # gives each process the Gaudi of its LOCAL_RANK, which it sees as hpu:0)
                            devices=[str(d) for d in plan.devices if d.type not in ("cpu", "hpu")])
        except PlanRefused as err:
            mine = RankPlan(config.world, 0, err.reasons, refused=True)
        except Exception as err:  # a rank that cannot plan refuses, so every rank hears why
            mine = RankPlan(config.world, 0, [f"planning failed: {err!r}"], refused=True)
        topology, notes = agree(procs, mine, samples_per_iter, pool_samples, asked_samples)
    except PlanRefused:
        raise
    except BaseException as err:  # a rank lost while agreeing
        _stop_every_rank(procs, err, peer_lost(err))
    return LaneRun.planned(plan, topology, notes)


def _run_lanes(config: SessionConfig, ran: LaneRun, task: BlockTask, procs: ProcessSet | None,
               watch: CompileWatch) -> tuple[LoopOutcome | None, object, LaneRun]:
    """Everything between the plan and the result, and the lanes as they ran. Its frame and those
    below hold the run (mirrors, wrappers, optimizers): on failure ``run`` clears them from the traceback."""
    lanes = make_lanes(ran.devices)
    phases.notify.lanes_made(lanes)
    # the plan's choice (Note [overlap where the wire is slow]) on lanes that have streams, known before
    # the task starts: the adapter then gives the lanes a block forward whose backward fills the buckets
    # as it runs (Note [overlap needs gradients during the backward])
    ran = replace(ran, overlap=ran.plan.exchange.second_stream and any(lane.stream is not None for lane in lanes))
    spec = task.start(ran)
    if spec is None:
        return None, task.finish(None, ran), ran
    comm, ran = _exchange_communicator(config, ran, lanes, procs)
    # Across processes the cost model is not run: each rank would choose alone (every agreed lane runs).
    auto = config.auto_world if config.world == "auto" and ran.local_lanes > 1 and procs is None else None
    if auto is not None:
        keep, note = _choose_world(auto, comm, ran, task, spec)
        ran = replace(ran, notes=[*ran.notes, note])
        if keep < ran.local_lanes:  # the first `keep` fitting lanes; the others are not used
            lanes = lanes[:keep]
            del watch.lanes[keep:]
            ran = ran.first_lanes(keep)
            if keep == 1:
                ran = replace(ran, in_process="local", in_process_reason=ONE_LANE_EXCHANGE)
            comm.close()
            comm, ran = _exchange_communicator(config, ran, lanes)
    exchange = exchange_for(comm, ran.plan.exchange)  # the plan's, as given (Note [host lanes exchange during
    # the backward] in dpq.planning.plan: CPU lanes overlap without a second stream)
    t_loop = time.perf_counter()
    replicas = ReplicaSet(task.block, lanes, spec.tuned)  # lanes wait for the current stream first (R1)
    engine, stuck = None, False
    try:
        engine = TuneEngine(
            replicas, watch.lane_loss(spec.lane_loss), spec.make_optimizer, exchange,
            reduction=spec.reduction, micro_batch=spec.micro_batch, loss_scale=spec.loss_scale,
            sample_numel=spec.sample_numel, debug_identical=config.debug_identical,
            one_op_sign_step=spec.one_op_sign_step, timeout_s=config.watchdog_s(), name=task.name,
            on_stuck=_end_stuck_run(procs), in_collective=_issuer_in_collective(procs),
        )
        ran = replace(ran, step=engine.step_note)
        outcome = run_loop(engine, spec)
        if auto is not None:
            on_devices = lanes[0].accelerator  # on CPU the forward's host time is the compute itself
            auto.measured(task.name, time.perf_counter() - t_loop, iters=spec.iters, world=ran.world,
                          issue_s=outcome.issue_s if on_devices else None)
    except BaseException as err:
        stuck = isinstance(err, LanesHung) and err.stuck  # the watchdog could not end the lanes' work: no wait on them
        raise
    finally:
        # R5, on success and on failure alike: the current stream and every lane join before
        # the mirrors go and before the adapter unwraps (or the session restores) the home block;
        # the lanes first join their communication streams (dpq.comm.comm_streams, C4).
        comm.join()
        # Teardown order: the engine's optimizers (which hold the mirrors' tuned values), flat gradient
        # buffers and exchange scratch go first, so that the cache the replicas empty next holds them
        # too (a failed run's frames still reference the engine: close() empties it in place).
        if engine is not None:
            engine.close()
        replicas.close(release_cache=not stuck)  # emptying the cache frees device memory: a device sync
    return outcome, task.finish(outcome, ran), ran


def _end_stuck_run(procs: ProcessSet | None) -> Callable[[str], None] | None:
    """How the iteration watchdog ends a run whose issuing thread does not come back (dpq.engine.watchdog):
    only the command's process is ended (:func:`dpq.cancel.installed`; a library caller's never is,
    None), its hang first reported to the other ranks, then said, reported, the staging folder
    removed (:func:`dpq.cancel.end_process`), exit status 1."""
    if not cancel.installed():
        return None

    def end(hung: str) -> None:
        said = "dpq: " + refusals.hung_process_ends(hung.removeprefix("dpq: "), GRACE_S)
        if procs is not None:
            procs.report_failure(said.removeprefix("dpq: "))
        cancel.end_process(1, "hung", said)

    return end


def _issuer_in_collective(procs: ProcessSet | None) -> Callable[[], bool] | None:
    """Several processes: whether this (the issuing) thread waits in a collective for other ranks."""
    if procs is None:
        return None
    issuer = threading.get_ident()
    return lambda: in_collective(issuer)


def _exchange_communicator(config: SessionConfig, ran: LaneRun, lanes: list[Lane],
                           procs: ProcessSet | None = None) -> tuple[object, LaneRun]:
    """The run's communicator, and ``ran`` with it as built; with ``ran.overlap`` (asked for, on
    lanes that have streams): over a second stream per lane, so the exchange runs beside the
    backward (dpq.comm.comm_streams), in one process and across processes alike (the process-group
    communicator over the communication lanes: its legs inside the process and its transfers across)."""
    comm, ran = _communicator(config, ran, comm_lanes(lanes) if ran.overlap else lanes, procs)
    comm = CommStreams(comm, lanes) if ran.overlap else comm
    phases.notify.communicator_made(comm, ran.in_process_reason)
    return comm, ran


def _communicator(config: SessionConfig, ran: LaneRun, lanes: list[Lane],
                  procs: ProcessSet | None = None) -> tuple[object, LaneRun]:
    """The communicator over ``lanes`` (``ran``'s in-process choice, or one chosen on the lanes when it
    has none or it cannot start), and ``ran`` with it as built."""
    if ran.in_process:  # a kind whose set-up failed (e.g. NCCL's, remembered for the run): chosen again
        comm, reason = build_planned(ran.in_process, ran.in_process_reason, lanes, ran.plan.order)
    else:
        comm, reason = select_communicator(lanes)
    ran = replace(ran, in_process=comm.name, in_process_reason=reason, across="")
    if procs is not None:  # the in-process legs as planned; torch.distributed across processes
        comm = ProcessGroupCommunicator(lanes, group=procs.group, inner=comm)
        ran = replace(ran, across=comm.name)
    wrap = config.auto_world.wrap if config.world == "auto" and config.auto_world is not None else None
    return (wrap(comm) if wrap is not None else comm), ran


def _choose_world(auto, comm, ran: LaneRun, task: BlockTask, spec: TuneSpec) -> tuple[int, str]:
    """'auto': the world by predicted block time over the fitting lanes (dpq.planning.cost_model), with
    the link probed on these lanes, and the note saying the choice and its prediction (the run's notes)."""
    params = dict(task.block.named_parameters(remove_duplicate=False))
    tuned = [params[n] for n in spec.tuned if n in params]
    elems = sum(p.numel() for p in tuned)
    # FLOPs (first block only): 6 x tokens x the weight-shaped tuned values; tokens = the
    # iteration's elements over the hidden size (the first weight-shaped value's input width).
    weights = [p for p in tuned if p.dim() >= 2]
    hidden = weights[0].shape[-1] if weights else 1
    tokens = sum(spec.sample_numel(i) for i in range(min(spec.batch_size, spec.nsamples))) / max(1, hidden)
    compute_s, where = auto.estimate_compute(flops=6.0 * tokens * sum(p.numel() for p in weights),
                                             device_type=ran.devices[0].type)
    choice = auto.choose(comm, iters=spec.iters, compute_s=compute_s, tuned_elems=elems, label=task.name)
    return choice.world, f"auto: {choice.reason}; {where}"


# -- putting the block back, letting the failed run go ------------------------------------------


class BlockSnapshot:
    """What it takes to put a block back exactly as it was: every submodule's attributes (the
    same objects; containers such as ``_modules`` and ``_parameters`` with the same contents, so
    wrapped layers get their original layer objects back and added attributes such as
    ``bits``/``scale``/``zp``/``iters`` go) and every parameter's and buffer's bytes, kept on the
    CPU (a tuner's unwrap writes quantized weights in place). ``restore`` is bitwise."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.modules = []
        for m in block.modules():
            attrs = dict(m.__dict__)
            contents = {k: copy.copy(v) for k, v in attrs.items() if type(v) in (dict, OrderedDict, list, set)}
            self.modules.append((m, attrs, contents))
        self.tensors = []
        seen: set[int] = set()
        for t in itertools.chain(block.parameters(), block.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                self.tensors.append((t, t.data, t.detach().to("cpu", copy=True), t.requires_grad, t.grad))

    @torch.no_grad()
    def restore(self) -> None:
        for m, attrs, contents in self.modules:
            d = m.__dict__
            for k in [k for k in d if k not in attrs]:
                del d[k]
            for k, v in attrs.items():
                if k in contents:
                    if isinstance(v, list):
                        v[:] = contents[k]
                    else:
                        v.clear()
                        v.update(contents[k])
                d[k] = v
        for t, data, saved, requires_grad, grad in self.tensors:
            now = t.data
            if (now.data_ptr(), now.shape, now.dtype, now.device) != (data.data_ptr(), data.shape, data.dtype,
                                                                      data.device):
                t.data = data  # moved or replaced (e.g. .to('meta')): the original storage back
            data.copy_(saved)
            if t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
            if t.grad is not grad:
                t.grad = grad


def release_run(err: BaseException, label: str = "dpq") -> None:
    """Let go of everything the failed run's frames hold while ``err`` lives.

    Call it in the ``except`` that caught ``err``. A caught error keeps its traceback, the
    traceback every frame below the catch, and each frame its locals and its function, whose
    closure can hold the run too (a lane-loss closure holds the pool; torch's hook-calling
    closure holds the module it ran: a mirror). So the frames below the catching frame are
    cleared and cut off ``err``'s traceback; where it failed stays readable as a note (headed
    ``label``). Errors chained to ``err`` inside the run are released the same way; the
    caller's own (an error being handled when the run started) are left alone.
    """
    run_tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    run_frames = set()
    tb = run_tb
    while tb is not None:
        run_frames.add(id(tb.tb_frame))
        tb = tb.tb_next
    pending, seen = [err], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        inner = run_tb if e is err else e.__traceback__
        if e is not err and (inner is None or id(inner.tb_frame) not in run_frames):
            continue  # not raised inside the run
        if inner is not None:
            e.add_note(f"{label}: where it failed (the failed run's frames were released with its "
                       "memory):\n" + "".join(traceback.format_tb(inner)).rstrip())
            traceback.clear_frames(inner)
        if e is err:
            if err.__traceback__ is not None:
                err.__traceback__.tb_next = None
        else:
            e.__traceback__ = None
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
