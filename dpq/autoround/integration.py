"""``enable()``: auto-round's SignRound tune loop delegates each block to dpq's engine.

Patches ``SignRoundQuantizer.quantize_block`` (inherited by SignRoundV2 and AdamRound).
Per block: the plan decides (``dpq.planning.plan``); when it says serial, auto-round's own method runs
unchanged (contract 5). When it says parallel, the block is tuned by
:mod:`dpq.session` (the task: :func:`dpq.autoround.tune.signround_spec`) with the quantizer's own wrapper, lr per layer,
loss (``_get_loss``), runner, optimizer class, lr schedule and early-stop settings.

Refuse loudly, lose nothing (contract 6): a failure inside the parallel lanes restores the
home block exactly (wrappers removed, original layer objects back, tuned values dropped),
then under ``auto`` reruns the block serially from the same RNG state, and under an explicit
world raises :class:`ParallelLaneError`. Blocks already quantized are untouched either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator, Sequence
from types import MappingProxyType

import torch
from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
from auto_round.logger import logger
from auto_round.utils.device_manager import device_manager

from dpq import refusals, session
from dpq.comm.nccl_lifecycle import close_communicators
from dpq.planning.cost_model import AutoWorld
from dpq.planning.distributed import ProcessSet, Topology
from dpq.planning.plan import Plan, PlanRequest, price_mirror, resolve
from dpq.planning.spec import DEFAULTS, ParallelSpec, SpecError
from dpq.streams import release_run_streams

from . import patches
from .block_task import AutoRoundBlock, task_plan_fields
from .run import BlockRecord, Run

__all__ = ["auto_world_report", "disable", "enable", "enable_spec", "parallel_quantization", "run_summary"]


def _ORIGINAL(self, *args, **kwargs):
    """What dpq's quantize_block replaced, as the patch table recorded it (before any install: what
    is there now). The serial path and every pass-through call it."""
    return patches.original(SignRoundQuantizer, "quantize_block")(self, *args, **kwargs)


def _ORIGINAL_DISPATCH(self, *args, **kwargs):
    return patches.original(SignRoundQuantizer, "dispatch_block")(self, *args, **kwargs)


def enable(parallel_quantization: int | str, parallel_devices=None, *,
           parallel_debug: bool = DEFAULTS["parallel_debug"],
           parallel_overlap: bool | str | None = DEFAULTS["parallel_overlap"],
           parallel_timeout: float = DEFAULTS["parallel_timeout"],
           parallel_order: str = DEFAULTS["parallel_order"],
           auto_world: AutoWorld | None = None, processes: ProcessSet | None = None, **former) -> Run:
    """Make every later ``AutoRound(...).quantize()`` in this process tune blocks data-parallel.

    The settings are auto-round-dp's flags under their own names, with their defaults
    (:data:`dpq.planning.spec.FLAGS`); only the world has none (the command's absent flag is ``'off'``, plain
    auto-round: here say which). ``parallel_quantization``: 'off', 'auto' (use what fits; never
    refuses) or an int world (refuses before the block starts when it cannot be served).
    ``parallel_devices``: lane devices (``'0,1,2,3'``, ``'cpu,cpu'``); default: auto-round's device
    list when it has several, else every visible device of the home device's type.
    ``parallel_debug``: check after every step that the lanes hold bitwise-identical tuned values.
    ``parallel_overlap``: 'auto' (the default), 'on' or 'off', as :func:`dpq.parallel_tune`'s
    ``overlap``. ``parallel_order``: 'canonical' (the default) or 'native', as its ``order``.
    ``parallel_timeout`` (seconds, 10 to 604800): how long the host waits for an
    iteration's work on the lanes before the run is stopped as hung (``dpq.tune_loop``: the watchdog),
    and across processes how long a collective waits for the other ranks. Malformed arguments raise
    ``ValueError`` naming every problem, before anything is patched.

    Under an initialised ``torch.distributed`` group of several processes (``torchrun``; the
    CLI initialises it), every block's tune spans them: each process runs its local lanes
    (``parallel_quantization`` and ``parallel_devices`` are per process), the plans are agreed on every
    rank, the global world is the processes times the local lanes, and rank 0 alone saves
    (:mod:`dpq.autoround.ranks`). Call it on every rank, after ``init_process_group``.

    ``auto_world`` (``'auto'`` only): the cost model that picks each block's world by predicted
    time (:class:`dpq.planning.cost_model.AutoWorld`); default: a fresh one for this ``enable()``, used
    where the lanes are on distinct devices (lanes sharing one device keep every fitting lane:
    the model divides compute over devices). A given one is used for any lanes. ``processes``:
    the group's :class:`dpq.planning.distributed.ProcessSet` when the caller made one for the job already
    (auto-round-dp does, to agree on the job and report a cancel through it; default: detected).

    Calls nest like a stack: each ``enable()`` is undone by one ``disable()``, which brings
    back the settings of the ``enable()`` before it (or, after the outermost, auto-round's
    methods as they were when the outermost ``enable()`` patched them). Returns the run, whose
    records fill as blocks are quantized; ``disable()`` returns it too, and the records of the last
    run stay readable after it (:func:`run_summary`, :func:`auto_world_report`).

    ``former``: the keywords' names before they were the flags' (:data:`FORMER_NAMES`), still taken
    with a ``DeprecationWarning`` while callers move.
    """
    if former:
        named = _former(former)
        parallel_devices = named.pop("parallel_devices", parallel_devices)
        parallel_debug = named.pop("parallel_debug", parallel_debug)
        parallel_overlap = named.pop("parallel_overlap", parallel_overlap)
        parallel_timeout = named.pop("parallel_timeout", parallel_timeout)
    problems: list[str] = []
    try:
        spec = ParallelSpec.build(parallel_quantization, parallel_devices, parallel_debug=parallel_debug,
                                  parallel_overlap=parallel_overlap, parallel_timeout=parallel_timeout,
                                  parallel_order=parallel_order, caller="enable")
    except SpecError as err:
        problems, spec = err.problems, None
    if auto_world is not None and not (isinstance(parallel_quantization, str)
                                       and parallel_quantization.strip().lower() == "auto"):
        problems.append(refusals.auto_world_needs_auto(parallel_quantization))
    if problems:
        raise SpecError(problems)
    return enable_spec(spec, auto_world=auto_world, processes=processes)


FORMER_NAMES = MappingProxyType({"devices": "parallel_devices", "debug_identical": "parallel_debug",
                                 "overlap": "parallel_overlap", "timeout": "parallel_timeout"})


def _former(former: dict) -> dict:
    """``enable()``'s keywords under their former names, renamed (an unknown one raises ``TypeError``)."""
    unknown = sorted(set(former) - set(FORMER_NAMES))
    if unknown:
        raise TypeError(f"enable() got unexpected keyword arguments {unknown}")
    warnings.warn(f"dpq.autoround.enable(): {', '.join(f'{k}= is now {FORMER_NAMES[k]}=' for k in former)} "
                  "(the flags' names)", DeprecationWarning, stacklevel=3)
    return {FORMER_NAMES[k]: v for k, v in former.items()}


def enable_spec(spec: ParallelSpec, *, auto_world: AutoWorld | None = None,
                processes: ProcessSet | None = None) -> Run:
    """:func:`enable` with settings validated already (auto-round-dp's, :meth:`ParallelSpec.build`); returns
    the run (its records fill as blocks are quantized; :func:`disable` returns it too)."""
    world = spec.world
    model = auto_world if auto_world is not None else (AutoWorld() if world == "auto" else None)
    procs = (processes if processes is not None else ProcessSet.detect()) if world != "off" else None
    new = Run(spec, auto_world=model, auto_given=auto_world is not None,
              processes=procs if procs is not None and procs.size > 1 else None)
    patches.install(new)  # the outermost install checks and patches the whole table (PatchMismatch: nothing done)
    return new


def disable() -> Run | None:
    """Undo the innermost ``enable()`` and return its run (records, ``auto``'s cost model); None, doing
    nothing, when nothing is enabled. A seams-only run installed above it ends with it."""
    run, outermost = patches.uninstall_enabled()
    if outermost:
        _release_run_resources()
    return run


def _release_run_resources() -> None:
    """End of the outermost run: free what the run kept across blocks. NCCL communicators are
    created once per device tuple per run (ncclCommInitAll costs seconds) and destroyed here; the
    run's lane streams (dpq.streams: one fixed set per device) are forgotten."""
    close_communicators()
    release_run_streams()


def _auto_split_requested() -> bool:
    from auto_round.utils import is_auto_device_mapping

    return is_auto_device_mapping(device_manager.device_map) and len(device_manager.device_list) > 1


def _whole_block_dispatch(run: Run | None, self, block, input_ids, input_others):
    """``--device_map 0,1,2,3`` asks auto-round to split each block over those GPUs for memory.
    With dpq on, those GPUs are lanes instead: a block whose mirror fits the home device stays
    whole there (and runs data-parallel); a block that does not fit keeps auto-round's split
    placement, and the plan then runs it serially (weights span several devices). ``run``: the run
    (Note [each replacement is handed its run] in ``dpq.autoround.patches``)."""
    if run is None or run.world == "off":
        return _ORIGINAL_DISPATCH(self, block, input_ids, input_others)
    block = _dispatch(self, block, input_ids, input_others)
    if isinstance(run.world, int):
        run.at = _block_name(self, block) or run.at  # a refusal here stopped in this block (the report's "where")
        _preflight(run, self, block, input_ids)
    return block


def _block_name(q, block: torch.nn.Module) -> str:
    """``block``'s name in the quantizer's model ("" where the model is not at hand): dispatch is handed
    the module alone, before ``quantize_block`` gets its name."""
    model = getattr(getattr(q, "model_context", None), "model", None)
    if isinstance(model, torch.nn.Module):
        return next((name for name, m in model.named_modules() if m is block), "")
    return ""


def _dispatch(self, block, input_ids, input_others):
    if not _auto_split_requested() or self.model_context.is_diffusion or not isinstance(input_ids, list):
        return _ORIGINAL_DISPATCH(self, block, input_ids, input_others)
    home = torch.device(device_manager.device)
    per_iter = min(len(input_ids), self.calibration_context.batch_size * self.gradient_accumulate_steps)
    if price_mirror(block, input_ids, per_iter, compute_dtype=self.model_context.amp_dtype) > backend_free(home):
        return _ORIGINAL_DISPATCH(self, block, input_ids, input_others)
    from auto_round.utils.model import move_to_device_preserving_cpu_pinned, place_ngram_embeddings_for_tuning_

    place_ngram_embeddings_for_tuning_(block)
    block = move_to_device_preserving_cpu_pinned(block, device_manager.device)
    self._card_0_in_high_risk, self._loss_device = False, device_manager.device
    return block


def backend_free(device: torch.device) -> int:
    from dpq.streams import backend

    return backend(device).mem_get_info(device)[0]


@contextlib.contextmanager
def parallel_quantization(*args, **kw) -> Iterator[list[BlockRecord]]:
    """``with parallel_quantization(2): AutoRound(...).quantize()`` (:func:`enable`'s arguments); yields
    the block records (the run's own list: still readable after the ``with``)."""
    run = enable(*args, **kw)
    try:
        yield run.records
    finally:
        disable()


def run_summary() -> list[BlockRecord]:
    """The block records of the innermost enabled run, or after it, of the last run."""
    run = patches.reported()
    return list(run.records) if run is not None else []


def auto_world_report() -> list[dict]:
    """``'auto'``'s predicted vs measured seconds per block of that run (``AutoWorld.report``;
    [] when no block chose its world by the cost model)."""
    run = patches.reported()
    return run.auto_world.report() if run is not None and run.auto_world is not None else []


def _preflight(run: Run, q, block, inputs) -> None:
    """An explicit world's plan for this block, resolved before any of the block's work (the
    collection passes come first): raises :class:`dpq.planning.plan.PlanRefused` with every reason at
    once, the tuner's feature reasons included. Several processes: agreed by every rank
    (:func:`dpq.session.agree_plan`, as the tune's plan is), so a refusal on any rank (more lanes
    over the processes than samples per iteration among them) stops every rank here."""
    request = _tuner_request(run, q, block, inputs)
    if run.processes is None:
        resolve(request)
    else:
        session.agree_plan(_session_config(run, None), run.processes, request.samples_per_iter,
                           bool(request.extra_reasons), lambda: resolve(request), request.pool_samples or 0,
                           request.asked_samples or 0)


def _session_config(run: Run, auto_world: AutoWorld | None) -> session.SessionConfig:
    """``auto_world``: this block's cost model (:func:`_auto_world_for`; None across processes: the
    session plans and agrees there and runs no cost model)."""
    return session.SessionConfig(dataclasses.replace(run.spec, devices=run.lane_devices()), auto_world=auto_world,
                                 processes=run.processes)


def _auto_world_for(run: Run, plan: Plan) -> tuple[AutoWorld | None, Plan]:
    """The run's cost model for this block's lanes, and the plan to run. The default one models one
    device per lane (compute divided by W): for lanes sharing a device it has no basis, so every
    fitting lane runs (as without it), and the plan to run notes why."""
    if run.auto_world is None or plan.local_lanes < 2:
        return None, plan
    if not run.auto_given and len(set(plan.devices)) < len(plan.devices):
        note = refusals.auto_shared_device(len(plan.devices), sorted({str(d) for d in plan.devices}))
        return None, dataclasses.replace(plan, notes=[*plan.notes, note])
    return run.auto_world, plan


def _tuner_request(run: Run, q, block, fp_inputs) -> PlanRequest:
    return PlanRequest(world=run.world, devices=run.lane_devices(), overlap=run.overlap, order=run.order,
                       **task_plan_fields(q, block, fp_inputs, run.processes))


def _block_plan(run: Run, q, block, fp_inputs, block_ctx) -> Plan:
    plan = resolve(_tuner_request(run, q, block, fp_inputs))
    _log_plan(run, plan.devices, Topology.alone(plan.local_lanes), plan.said, block, block_ctx)
    return plan


def _log_plan(run: Run, devices: Sequence[torch.device], topology: Topology, reasons: Sequence[str], block,
              block_ctx) -> None:
    """The plan (its lanes ``devices`` over ``topology``, its ``reasons`` and notes), once per block
    shape (several processes: on rank 0, with the agreed topology)."""
    if run.processes is not None and run.processes.rank != 0:
        return
    key = (type(block).__name__, tuple(p.shape for p in block.parameters()))
    if key not in run.shapes_logged:
        run.shapes_logged.add(key)
        lanes = ", ".join(map(str, devices))
        where = f"{topology.describe()}, each process's lanes" if topology.several else f"world {topology.world}"
        said = topology.describe() if topology.several else None
        logger.info(f"dpq plan for {block_ctx.block_name} ({type(block).__name__}): {where} on [{lanes}]"
                    + "".join(f"\n  - {r}" for r in reasons if r != said))
    if len(devices) > 1 and devices[0].type == "cpu" and not run.cpu_logged:
        run.cpu_logged = True
        logger.info("dpq: CPU lanes share the CPU: no speedup, but the parallel path and its parity run here")


def _delegated_quantize_block(run: Run | None, self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx,
                              input_ids=None, **kwargs):
    if run is None:  # left under someone else's patch after disable(): pass through
        return _ORIGINAL(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)
    t0 = time.perf_counter()
    run.at = block_ctx.block_name  # a failure from here on stopped in this block (the report's "where")
    # PlanRefused propagates: nothing started. Several processes: the session plans and agrees
    # on every rank (a refusal anywhere stops every rank there, with every rank's reasons).
    plan = _block_plan(run, self, block, fp_inputs, block_ctx) if run.processes is None else None

    def serial():
        return _ORIGINAL(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)

    chosen = len(run.auto_world.records) if run.auto_world is not None else 0
    block_run = _parallel_block(run, self, plan, block, fp_inputs, input_others, fp_outputs, q_inputs,
                                block_ctx, input_ids, serial)
    name, algorithm = block_ctx.block_name, type(self).__name__
    ran = block_run.ran
    if run.processes is not None:
        _log_plan(run, ran.devices, ran.topology, ran.said, block, block_ctx)
    if block_run.fell_back:
        run.records.append(BlockRecord(name, 1, time.perf_counter() - t0,
                                       reasons=[refusals.lane_failure(block_run.failure)], fell_back=True,
                                       algorithm=algorithm))
    elif block_run.serial:
        run.records.append(BlockRecord(name, 1, time.perf_counter() - t0, reasons=ran.said, algorithm=algorithm))
    elif block_run.outcome is not None:
        out = block_run.outcome
        run.records.append(BlockRecord(name, ran.world, time.perf_counter() - t0, out.wire_bytes, out.best_loss,
                                       ran.communicator, [*ran.said, ran.communicator_reason, f"step: {ran.step}"],
                                       algorithm=algorithm, losses=out.losses, best_iter=out.best_iter,
                                       issue_s=out.issue_s, devices=[str(d) for d in ran.devices],
                                       **_compile_fields(block_run.compiles), **_prediction(run, chosen)))
    run.at = ""
    return block_run.result


def _compile_fields(watch) -> dict:
    """The block's compiles per lane (dpq.engine.compiles.CompileWatch) as record fields."""
    if watch is None or not watch.watched:
        return {}
    return {"recompiles": watch.recompiles(), "compiles": watch.compiles(), "compile_s": watch.compile_s()}


def _prediction(run: Run, before: int) -> dict:
    """The cost model's prediction and measurement for the block just run: the record its
    choice added after the first ``before`` (none: the block's world was not chosen by it)."""
    new = run.auto_world.records[before:] if run.auto_world is not None else []
    if not new:
        return {}
    return {"predicted_s": dict(new[-1]["predicted_s"]), "measured_s": new[-1]["measured_s"]}


def _parallel_block(run: Run, q, plan, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx,
                    input_ids, serial) -> session.BlockRun:
    """The block through the session: auto-round's own ``serial`` when the plan says one lane
    (an explicit world 1 runs the engine: bitwise serial, the CLI's '1 == off' test checks the
    engine end to end), else the lanes; on a lane failure the session restores the block, then
    reruns ``serial`` (auto) or raises :func:`lane_error` (explicit world)."""
    task = AutoRoundBlock(q, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids)
    auto_world = None
    if plan is not None:
        auto_world, plan = _auto_world_for(run, plan)
    try:
        described = task.describe(serial, run.records, run.processes)
        return session.run(_session_config(run, auto_world), described, plan=plan)
    finally:
        task.close()
