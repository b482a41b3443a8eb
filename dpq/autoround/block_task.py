"""One auto-round block as the session's task (:class:`dpq.session.BlockTask`).

:class:`AutoRoundBlock` describes a ``SignRoundQuantizer.quantize_block`` call to the session:
auto-round's wrapper in ``start`` (with the quantizer's own lr per layer, loss, runner,
optimizer class, lr schedule and early-stop settings: :func:`dpq.autoround.tune.signround_spec`),
its unwrap and logging in ``finish``; what the quantizer or block uses that the lanes cannot
split (:func:`feature_refusals`, texts in :mod:`dpq.refusals`) and the error an explicit world
raises when a lane fails (:func:`lane_error`). :mod:`.integration` decides when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer
from auto_round.compressors.utils import block_forward as uncompiled_block_forward
from auto_round.logger import logger
from auto_round.utils import set_amax_for_all_moe_layers
from auto_round.utils.device_manager import device_manager
from auto_round.wrapper import unwrapper_block

from dpq import refusals, session
from dpq.planning.distributed import ProcessSet
from dpq.planning.plan import BlockPrice

from .compat import prepare_block_for_tuning
from .seams_common import ParallelLaneError
from .tune import BlockData, SignRoundSettings, is_pure_sign, signround_spec

__all__ = ["AutoRoundBlock", "feature_refusals", "lane_error", "loss_scale", "task_plan_fields"]


def feature_refusals(q: SignRoundQuantizer, block, fp_inputs, processes: ProcessSet | None = None) -> list[str]:
    """What this quantizer/block uses that the delegated loop cannot split, each with the fix.
    ``processes``: the run's process set (None: the run is this process alone)."""
    reasons = []
    if _unclaimed_group(processes):
        reasons.append(refusals.DIST_ACTIVE)
    if not isinstance(fp_inputs, list) or not all(isinstance(t, torch.Tensor) for t in fp_inputs):
        reasons.append(refusals.DICT_POOL)
    if q._get_scaler() is not None:
        reasons.append(refusals.GRAD_SCALER)
    if q.enable_lfq:
        reasons.append(refusals.LFQ_LOSS)
    if loss_scale(q) is None:
        reasons.append(refusals.custom_backward(type(q).__name__))
    devices = {p.device for p in block.parameters()}
    if len(devices) > 1:
        reasons.append(refusals.block_spans_devices(len(devices), sorted(map(str, devices))))
    return reasons


def _unclaimed_group(processes: ProcessSet | None) -> bool:
    """A group of several processes is initialised but the run holds no process set of several
    (``enable()`` ran before ``init_process_group``): the run would not span the processes."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    return processes is None or processes.size < 2


def loss_scale(q: SignRoundQuantizer) -> float | None:
    from auto_round.algorithms.quantization.adam_round.adam import AdamRoundQuantizer

    impl = type(q)._scale_loss_and_backward
    if impl is SignRoundQuantizer._scale_loss_and_backward:
        return 1000.0
    if impl is AdamRoundQuantizer._scale_loss_and_backward:
        return 1.0
    return None


def task_plan_fields(q, block, fp_inputs, processes: ProcessSet | None) -> dict:
    """What the plan needs from the tuner for this block (the session task's plan fields);
    ``processes``: the run's process set."""
    home = torch.device(device_manager.device)
    per_iter = min(len(fp_inputs) if isinstance(fp_inputs, list) else 1,
                   q.calibration_context.batch_size * q.gradient_accumulate_steps)
    return dict(
        samples_per_iter=per_iter,
        pool_samples=len(fp_inputs) if isinstance(fp_inputs, list) else None,
        asked_samples=getattr(q.calibration_context, "nsamples", None),  # (auto-round's field; absent: not said)
        home=home,
        extra_reasons=feature_refusals(q, block, fp_inputs, processes),
        price=(BlockPrice(block, fp_inputs, per_iter, compute_dtype=q.model_context.amp_dtype)
               if isinstance(fp_inputs, list) else None),
        pure_sign=is_pure_sign(q.optimizer, q.momentum),
    )


def lane_error(block: str, world: int, err: BaseException, where: str = "while tuning", *,
               records: Sequence = ()) -> ParallelLaneError:
    """The error an explicit world raises when a lane fails in ``block``, saying exactly what is
    kept: ``block`` is back as it was before its work started; the blocks finished before it
    (``records``: the run's) are quantized in place in the model object (this process only:
    auto-round saves at the end), and auto-round cannot continue a run from the middle."""
    done = [r.name for r in records if r.name != block]
    return ParallelLaneError(refusals.lane_failed(where, block, world, repr(err), done), block=block, completed=done)


def lane_block_forward(ran: session.LaneRun, torch_compile: bool):
    """What the lanes call for the block's forward: auto-round's own (None) unless the exchange
    overlaps the backward with torch.compile on, where it is the block forward uncompiled.

    Note [overlap needs gradients during the backward]
    auto-round compiles the block forward as one region, so its backward is one autograd node: every
    gradient is written when that node ends, and an exchange "during the backward" starts only
    after it (what the timeline model shows: nothing hidden). With overlap on, the lanes call the
    block forward uncompiled; the quantize-dequantize functions inside each wrapped layer stay
    compiled (auto-round's ``wrapper_block`` compiled them), so a layer's gradients are written when
    its own backward ends and the buckets go out while the earlier layers' backward runs. The price
    is the block's elementwise work eager (norms, activations, residuals: more kernels and more host
    ops per lane-iteration), which is why ``auto`` turns overlap on only where the link is slow (Note
    [overlap where the wire is slow] in ``dpq.planning.plan``).
    Overlap happens only on lanes with streams (accelerators; ``ran.overlap``), so CPU lanes and
    world 1 (auto-round's serial path) keep the compiled block forward. The values differ from the
    compiled forward's by rounding only, as between any two worlds (contract 1: statistical parity)."""
    return uncompiled_block_forward if ran.overlap and torch_compile else None


class AutoRoundBlock:
    """One auto-round block as the session's task: auto-round's wrapper in ``start``, its unwrap
    (and logging) in ``finish``; the quantizer's own lr per layer, loss, runner, optimizer class,
    lr schedule and early-stop settings."""

    def __init__(self, q, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids) -> None:
        self.q, self.block, self.fp_inputs, self.input_others = q, block, fp_inputs, input_others
        self.fp_outputs, self.q_inputs, self.block_ctx, self.input_ids = fp_outputs, q_inputs, block_ctx, input_ids
        self.progress: _Progress | None = None
        self.layers: tuple = ([], [])
        self.snapshot = None

    def describe(self, serial, records: Sequence, processes: ProcessSet | None) -> session.BlockTask:
        name = self.block_ctx.block_name
        return session.BlockTask(
            name=name, block=self.block, start=self.start, finish=self.finish, serial=serial,
            lane_error=lambda err, ran: lane_error(name, ran.world, err, "while tuning", records=records),
            on_fallback=lambda err: logger.warning(refusals.lane_failed_rerun(name, repr(err))),
            **task_plan_fields(self.q, self.block, self.fp_inputs, processes),
        )

    def start(self, ran: session.LaneRun):
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
            optimizer_cls=q.optimizer, lr_scheduler=q.lr_scheduler, loss_scale=loss_scale(q),
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

        self.progress = _Progress(self.block_ctx.block_name, q.iters, ran.world)
        spec = signround_spec(
            block, BlockData(active_inputs, self.input_others, self.fp_outputs, valid_token_mask), settings,
            q.block_forward, lr_of,
            loss_fn=lambda pred, ref, idx, mse, dev, masks: q._get_loss(pred, ref, idx, mse, dev, masks),
            progress=self.progress.update,
            lane_block_forward=lane_block_forward(ran, q.compress_context.enable_torch_compile),
        )
        self.snapshot = spec.best_params  # finish() waits for its copies (it holds nothing of the run)
        return spec

    def finish(self, outcome, ran: session.LaneRun) -> dict:
        self.close()
        q, block = self.q, self.block
        if outcome is None:  # nothing to tune in this block
            unwrapper_block(block, {})
            return {}
        q.compress_context.clear_memory()
        self.snapshot.wait()  # the snapshot's copies to the host (dpq.autoround.tune.BestSnapshot)
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
            f"[dpq world {ran.world}, {ran.communicator}]"
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
