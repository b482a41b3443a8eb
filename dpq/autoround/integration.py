"""``enable()``: auto-round's SignRound tune loop delegates each block to dpq's engine.

Patches ``SignRoundQuantizer.quantize_block`` (inherited by SignRoundV2 and AdamRound).
Per block: the plan decides (``dpq.plan``); when it says serial, auto-round's own method runs
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dpq import session
from dpq.fallback_p2p import close_communicators
from dpq.plan import Plan, PlanRequest, check_arguments, price_mirror, resolve, validate_world

from . import patches
from .compat import check_auto_round_version, prepare_block_for_tuning, tuner_refusals
from .seams_common import ParallelLaneError

check_auto_round_version()

from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer  # noqa: E402
from auto_round.logger import logger  # noqa: E402
from auto_round.utils import set_amax_for_all_moe_layers  # noqa: E402
from auto_round.utils.device_manager import device_manager  # noqa: E402
from auto_round.wrapper import unwrapper_block  # noqa: E402

from .tune import BlockData, SignRoundSettings, is_pure_sign, signround_spec  # noqa: E402

__all__ = ["BlockRecord", "ParallelLaneError", "disable", "enable", "lane_error", "parallel_quantization",
           "run_summary"]


def _ORIGINAL(self, *args, **kwargs):
    """What dpq's quantize_block replaced, as the patch table recorded it (before any install: what
    is there now). The serial path and every pass-through call it."""
    return patches.original(SignRoundQuantizer, "quantize_block")(self, *args, **kwargs)


def _ORIGINAL_DISPATCH(self, *args, **kwargs):
    return patches.original(SignRoundQuantizer, "dispatch_block")(self, *args, **kwargs)


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


@dataclass
class _State:
    world: int | str = "off"
    devices: object = None
    debug_identical: bool = False
    records: list[BlockRecord] = field(default_factory=list)
    shapes_logged: set = field(default_factory=set)
    cpu_logged: bool = False


_state = _State()  # the innermost enabled state; once every enable() is undone, the last run's
# The enabled states themselves are the patch table's stack (dpq.autoround.patches): enable() pushes,
# disable() pops; _state mirrors its innermost _State for the code below.


def _enabled() -> list[_State]:
    return [f.config for f in patches.frames() if isinstance(f.config, _State)]


def _active() -> bool:
    """An enable() is in effect (ours left under someone else's patch passes calls through when not)."""
    return bool(_enabled())


def enable(parallel_quantization: int | str = "auto", devices=None, *, debug_identical: bool = False) -> None:
    """Make every later ``AutoRound(...).quantize()`` in this process tune blocks data-parallel.

    ``parallel_quantization``: 'off', 'auto' (use what fits; never refuses) or an int world
    (refuses before the block starts when it cannot be served). ``devices``: lane devices
    (``'0,1,2,3'``, ``'cpu,cpu'``); default: auto-round's device list when it has several,
    else every visible device of the home device's type. Malformed arguments raise
    ``ValueError`` naming every problem, before anything is patched.

    Calls nest like a stack: each ``enable()`` is undone by one ``disable()``, which brings
    back the settings of the ``enable()`` before it (or, after the outermost, auto-round's
    methods as they were when the outermost ``enable()`` patched them).
    """
    global _state
    problems = check_arguments(parallel_quantization, devices)
    if problems:
        raise ValueError("dpq: bad arguments:\n" + "\n".join(f"  - {p}" for p in problems))
    world = validate_world(parallel_quantization)
    new = _State(world=world, devices=devices, debug_identical=debug_identical)
    patches.install(new)  # the outermost install checks and patches the whole table (PatchMismatch: nothing done)
    _state = new


def disable() -> None:
    """Undo the innermost ``enable()``; a no-op when nothing is enabled."""
    global _state
    if not _active():
        return
    while not isinstance(patches.uninstall().config, _State):
        pass  # a seams-only install above this enable() ends with it
    if _active():
        _state = _enabled()[-1]
        return
    _release_run_resources()


def _release_run_resources() -> None:
    """End of the outermost run: free what the run kept across blocks. NCCL communicators are
    created once per device tuple per run (ncclCommInitAll costs seconds) and destroyed here."""
    close_communicators()


def _auto_split_requested() -> bool:
    from auto_round.utils import is_auto_device_mapping

    return is_auto_device_mapping(device_manager.device_map) and len(device_manager.device_list) > 1


def _whole_block_dispatch(self, block, input_ids, input_others):
    """``--device_map 0,1,2,3`` asks auto-round to split each block over those GPUs for memory.
    With dpq on, those GPUs are lanes instead: a block whose mirror fits the home device stays
    whole there (and runs data-parallel); a block that does not fit keeps auto-round's split
    placement, and the plan then runs it serially (weights span several devices)."""
    if _state.world == "off" or (not _active() and patches.chained(SignRoundQuantizer, "dispatch_block")):
        return _ORIGINAL_DISPATCH(self, block, input_ids, input_others)
    block = _dispatch(self, block, input_ids, input_others)
    if isinstance(_state.world, int):
        _preflight(self, block, input_ids)
    return block


def _dispatch(self, block, input_ids, input_others):
    if not _auto_split_requested() or self.model_context.is_diffusion or not isinstance(input_ids, list):
        return _ORIGINAL_DISPATCH(self, block, input_ids, input_others)
    home = torch.device(device_manager.device)
    per_iter = min(len(input_ids), self.calibration_context.batch_size * self.gradient_accumulate_steps)
    if price_mirror(block, input_ids, per_iter) > backend_free(home):
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
def parallel_quantization(world: int | str = "auto", devices=None, **kw) -> Iterator[list[BlockRecord]]:
    """``with parallel_quantization(2): AutoRound(...).quantize()``; yields the block records."""
    enable(world, devices, **kw)
    try:
        yield _state.records
    finally:
        disable()


def run_summary() -> list[BlockRecord]:
    return list(_state.records)


def _feature_refusals(q: SignRoundQuantizer, block, fp_inputs, block_ctx=None) -> list[str]:
    """What this quantizer/block uses that the delegated loop cannot split, each with the fix."""
    reasons = []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reasons.append("a torch.distributed group is active (multi-process lanes are not supported yet); "
                       "run one process, or --parallel_quantization off")
    if not isinstance(fp_inputs, list) or not all(isinstance(t, torch.Tensor) for t in fp_inputs):
        reasons.append("calibration inputs are not a flat list of tensors (diffusion-style dict pool); "
                       "use --parallel_quantization off for this model")
    reasons.extend(tuner_refusals(fp_inputs))  # what this auto-round version does that lanes cannot follow yet
    if q._get_scaler() is not None:
        reasons.append("a gradient scaler is in use (AdamRound under fp16 amp); use --disable_amp or "
                       "--parallel_quantization off")
    if q.enable_lfq:
        reasons.append("LFQ loss (--enable_lfq) needs the lm_head on every lane; turn it off or use "
                       "--parallel_quantization off")
    if _loss_scale(q) is None:
        reasons.append(f"{type(q).__name__} overrides the backward step; dpq only knows SignRound's and "
                       "AdamRound's; use --parallel_quantization off")
    devices = {p.device for p in block.parameters()}
    if len(devices) > 1:
        reasons.append(f"the block's weights span {len(devices)} devices ({sorted(map(str, devices))}): a block "
                       "that does not fit one device keeps auto-round's split placement, serially")
    return reasons


def _loss_scale(q: SignRoundQuantizer) -> float | None:
    from auto_round.algorithms.quantization.adam_round.adam import AdamRoundQuantizer

    impl = type(q)._scale_loss_and_backward
    if impl is SignRoundQuantizer._scale_loss_and_backward:
        return 1000.0
    if impl is AdamRoundQuantizer._scale_loss_and_backward:
        return 1.0
    return None


def _preflight(q, block, inputs) -> None:
    """An explicit world's plan for this block, resolved before any of the block's work (the
    collection passes come first): raises :class:`dpq.plan.PlanRefused` with every reason at
    once, the tuner's feature reasons included."""
    resolve(_tuner_request(q, block, inputs))


def _lane_devices(home: torch.device):
    if _state.devices is not None:
        return _state.devices
    dl = [d for d in (device_manager.device_list or []) if d is not None]
    if len(dl) > 1:
        return [str(d) for d in dl]
    return None


def _task_plan_fields(q, block, fp_inputs) -> dict:
    """What the plan needs from the tuner for this block (the session task's plan fields)."""
    home = torch.device(device_manager.device)
    per_iter = min(len(fp_inputs) if isinstance(fp_inputs, list) else 1,
                   q.calibration_context.batch_size * q.gradient_accumulate_steps)
    return dict(
        samples_per_iter=per_iter,
        home=home,
        extra_reasons=_feature_refusals(q, block, fp_inputs),
        mirror_bytes=price_mirror(block, fp_inputs, per_iter) if isinstance(fp_inputs, list) else None,
        pure_sign=is_pure_sign(q.optimizer, q.momentum),
    )


def _session_config() -> session.SessionConfig:
    return session.SessionConfig(world=_state.world, devices=_lane_devices(torch.device(device_manager.device)),
                                 debug_identical=_state.debug_identical)


def _tuner_request(q, block, fp_inputs) -> PlanRequest:
    return PlanRequest(world=_state.world, devices=_session_config().devices, **_task_plan_fields(q, block, fp_inputs))


def _plan_for(q, block, fp_inputs, block_ctx) -> Plan:
    plan = resolve(_tuner_request(q, block, fp_inputs))
    key = (type(block).__name__, tuple(p.shape for p in block.parameters()))
    if key not in _state.shapes_logged:
        _state.shapes_logged.add(key)
        lanes = ", ".join(map(str, plan.devices))
        logger.info(f"dpq plan for {block_ctx.block_name} ({type(block).__name__}): world {plan.world} on [{lanes}]"
                    + "".join(f"\n  - {r}" for r in plan.reasons + plan.notes))
    if plan.world > 1 and plan.devices[0].type == "cpu" and not _state.cpu_logged:
        _state.cpu_logged = True
        logger.info("dpq: CPU lanes share the CPU: no speedup, but the parallel path and its parity run here")
    return plan


def _delegated_quantize_block(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx,
                              input_ids=None, **kwargs):
    if not _active():  # left under someone else's patch after disable(): pass through
        return _ORIGINAL(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)
    t0 = time.perf_counter()
    plan = _plan_for(self, block, fp_inputs, block_ctx)  # PlanRefused propagates: nothing started

    def serial():
        return _ORIGINAL(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)

    run = _parallel_block(self, plan, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids,
                          serial)
    name, algorithm = block_ctx.block_name, type(self).__name__
    if run.fell_back:
        _state.records.append(BlockRecord(name, 1, time.perf_counter() - t0, reasons=[f"lane failure: {run.failure}"],
                                          fell_back=True, algorithm=algorithm))
    elif run.serial:
        _state.records.append(BlockRecord(name, 1, time.perf_counter() - t0, reasons=plan.reasons + plan.notes,
                                          algorithm=algorithm))
    elif run.outcome is not None:
        out = run.outcome
        _state.records.append(BlockRecord(name, plan.world, time.perf_counter() - t0, out.wire_bytes, out.best_loss,
                                          plan.communicator, [*plan.reasons, *plan.notes, plan.communicator_reason],
                                          algorithm=algorithm, losses=out.losses, best_iter=out.best_iter))
    return run.result


def lane_error(block: str, world: int, err: BaseException, where: str = "while tuning") -> ParallelLaneError:
    """The error an explicit world raises when a lane fails in ``block``, saying exactly what is
    kept: ``block`` is back as it was before its work started; the blocks finished before it are
    quantized in place in the model object (this process only: auto-round saves at the end), and
    auto-round cannot continue a run from the middle."""
    done = [r.name for r in _state.records if r.name != block]
    kept = (f"The {len(done)} block(s) finished before it ({_names(done)}) stay quantized in place in the "
            "model object, in this process only (auto-round writes a complete model only when the whole run "
            "ends, and a run cannot resume from the middle).") if done else "No block had been finished before it."
    return ParallelLaneError(
        f"dpq: a lane failed {where} {block} at world {world}: {err!r}. {block} is back as it was before its "
        f"work started. {kept} Fix: rerun the quantization with --parallel_quantization auto (a block whose lane "
        "fails is redone serially) or off",
        block=block, completed=done)


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names) if len(names) <= limit else f"{', '.join(names[:2])}, ..., {names[-1]}"


def _parallel_block(q, plan, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids,
                    serial) -> session.BlockRun:
    """The block through the session: auto-round's own ``serial`` when the plan says one lane
    (an explicit world 1 runs the engine: bitwise serial, the CLI's '1 == off' test checks the
    engine end to end), else the lanes; on a lane failure the session restores the block, then
    reruns ``serial`` (auto) or raises :func:`lane_error` (explicit world)."""
    task = _Task(q, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids)
    try:
        return session.run(_session_config(), task.describe(serial), plan=plan)
    finally:
        task.close()


class _Task:
    """One auto-round block as the session's task: auto-round's wrapper in ``start``, its unwrap
    (and logging) in ``finish``; the quantizer's own lr per layer, loss, runner, optimizer class,
    lr schedule and early-stop settings."""

    def __init__(self, q, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids) -> None:
        self.q, self.block, self.fp_inputs, self.input_others = q, block, fp_inputs, input_others
        self.fp_outputs, self.q_inputs, self.block_ctx, self.input_ids = fp_outputs, q_inputs, block_ctx, input_ids
        self.progress: _Progress | None = None
        self.layers: tuple = ([], [])

    def describe(self, serial) -> session.BlockTask:
        name = self.block_ctx.block_name
        return session.BlockTask(
            name=name, block=self.block, start=self.start, finish=self.finish, serial=serial,
            lane_error=lambda err, plan: lane_error(name, plan.world, err, "while tuning"),
            on_fallback=lambda err: logger.warning(f"dpq: a lane failed on {name} ({err!r}); block restored, "
                                                   "rerunning serially"),
            index=self.block_ctx.block_index, **_task_plan_fields(self.q, self.block, self.fp_inputs),
        )

    def start(self, plan: Plan):
        q, block, device = self.q, self.block, device_manager.device
        valid_token_mask = None
        if self.input_ids is not None:
            if not hasattr(q, "_cached_valid_token_mask"):
                q._cached_valid_token_mask = q._compute_valid_token_mask(self.input_ids)
            valid_token_mask = q._cached_valid_token_mask
        active_inputs = self.q_inputs if (self.q_inputs is not None and q.enable_quanted_input) else self.fp_inputs
        self.layers = q.wrapper_block(
            block, q.enable_minmax_tuning, q.enable_norm_bias_tuning,
            enable_torch_compile=q.compress_context.enable_torch_compile, device=device,
            enable_neuqi=getattr(q.config, "enable_neuqi", False),
        )
        if not any(hasattr(m, "orig_layer") and m.params for m in block.modules()):
            return None
        # 0.17: serial switches the MoE experts implementation here; the mirrors must copy the same block
        prepare_block_for_tuning(q, block, active_inputs, q.calibration_context.batch_size)
        settings = SignRoundSettings(
            iters=q.iters, batch_size=q.calibration_context.batch_size,
            gradient_accumulate_steps=q.gradient_accumulate_steps, enable_minmax_tuning=q.enable_minmax_tuning,
            not_use_best_mse=q.not_use_best_mse, dynamic_max_gap=q.dynamic_max_gap, momentum=q.momentum,
            optimizer_cls=q.optimizer, lr_scheduler=q.lr_scheduler, loss_scale=_loss_scale(q),
            amp=q.model_context.amp, amp_dtype=q.model_context.amp_dtype,
            cache_device=q.compress_context.cache_device, low_gpu_mem_usage=q.compress_context.low_gpu_mem_usage,
            dq_cur_iter=bool(q.enable_alg_ext and q.scheme.data_type.endswith("dq")),
        )

        def lr_of(m):
            bits = getattr(m.orig_layer, "bits", None)
            lr = q._config.compute_lr(bits)
            mm = q._config.compute_minmax_lr(bits)
            q._maybe_log_low_bit_lr(bits)
            return (q.lr if lr is None else lr), (q.minmax_lr if mm is None else mm)

        self.progress = _Progress(self.block_ctx.block_name, q.iters, plan.world)
        return signround_spec(
            block, BlockData(active_inputs, self.input_others, self.fp_outputs, valid_token_mask), settings,
            q.block_forward, lr_of,
            loss_fn=lambda pred, ref, idx, mse, dev: q._get_loss(pred, ref, idx, mse, dev, valid_token_mask),
            progress=self.progress.update,
        )

    def finish(self, outcome, plan: Plan) -> dict:
        self.close()
        q, block = self.q, self.block
        if outcome is None:  # nothing to tune in this block
            unwrapper_block(block, {})
            return {}
        q.compress_context.clear_memory()
        with torch.no_grad():
            unwrapper_block(block, outcome.best_params)
        if q.config.is_act_nv_fp:
            set_amax_for_all_moe_layers(block, attr_name="orig_layer.act_max")
        quantized, unquantized = self.layers
        if unquantized:
            logger.info(f"Unquantized layers: {unquantized}")
        logger.infoclean(
            f"quantized {len(quantized)}/{len(quantized) + len(unquantized)} layers in the block, loss iter 0: "
            f"{outcome.init_loss:.3e} -> iter {outcome.best_iter}: {outcome.best_loss:.3e} "
            f"[dpq world {plan.world}, {plan.communicator}]"
        )
        return outcome.best_params

    def close(self) -> None:
        progress, self.progress = self.progress, None
        if progress is not None:
            progress.close()


class _Progress:
    """Per-block iteration bar, shown only once a block has run for a few seconds."""

    def __init__(self, name: str, iters: int, world: int) -> None:
        self.name, self.iters, self.world = name, iters, world
        self.t0 = time.perf_counter()
        self.bar = None

    def update(self, i: int, loss: float) -> None:
        if self.bar is None and time.perf_counter() - self.t0 > 5.0:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.iters, initial=i, desc=f"{self.name} (dpq world {self.world})", leave=False)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3e}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
