"""SignRound's per-block tune loop, driven by dpq's engine.

This is auto-round 0.16's ``SignRoundQuantizer.quantize_block`` loop with every iteration's
forward/backward handed to :class:`dpq.tune_loop.TuneEngine`: the same wrapper, parameter
groups and per-layer lr, the same ``IndexSampler`` draws, loss normalisation (masked and
unmasked), lr schedule, best-iteration snapshot, early stop and unwrap. At world 1 it is
bitwise the serial loop (``tests/test_parity.py`` holds it to that).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from dpq.exchange import FullSumExchange, SignExchange
from dpq.mirror import ReplicaSet
from dpq.streams import Lane
from dpq.tune_loop import TuneEngine

from .compat import check_auto_round_version

check_auto_round_version()

from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD  # noqa: E402
from auto_round.compressors.utils import IndexSampler, collect_best_params  # noqa: E402


@dataclass
class SignRoundSettings:
    """The knobs of auto-round's SignRound loop that the delegated loop reproduces."""

    iters: int = 200
    batch_size: int = 8
    gradient_accumulate_steps: int = 1
    enable_minmax_tuning: bool = True
    not_use_best_mse: bool = False
    dynamic_max_gap: int = -1
    momentum: float | None = None
    optimizer_cls: type = SignSGD
    optimizer_kwargs: dict = field(default_factory=dict)
    lr_scheduler: object | None = None
    loss_scale: float = 1000.0
    amp: bool = True
    amp_dtype: torch.dtype = torch.bfloat16
    cache_device: str | torch.device = "cpu"
    low_gpu_mem_usage: bool = False
    dq_cur_iter: bool = False  # SignRoundV2 "dq" data types read the iteration off the modules


@dataclass
class BlockData:
    """The block's pool: what serial quantize_block receives."""

    inputs: list[torch.Tensor]
    input_others: dict
    outputs: list[torch.Tensor]
    valid_token_mask: list[torch.Tensor] | None = None


@dataclass
class TuneOutcome:
    best_params: dict
    losses: list[float]
    best_iter: int
    best_loss: float
    init_loss: float | None
    iters_run: int
    wire_bytes: int
    seconds: float
    indices: list[list[int]]


def tuned_parameter_groups(block: torch.nn.Module, lr_of: Callable[[torch.nn.Module], tuple[float, float]]):
    """Serial's parameter grouping: round params grouped by lr, then min/max params by lr.

    Returns (round_groups, minmax_groups, names): dicts lr -> [param], and for each param its
    name in ``block.named_parameters()`` (the names every lane uses for the same param).
    """
    round_groups: dict[float, list] = {}
    minmax_groups: dict[float, list] = {}
    names: dict[int, str] = {}
    for n, m in block.named_modules():
        if not hasattr(m, "orig_layer"):
            continue
        layer_lr, layer_minmax_lr = lr_of(m)
        for key in m.params.keys():
            p = m.params[key]
            names[id(p)] = f"{n}.{key}" if n else key
            if "min" in key or "max" in key:
                minmax_groups.setdefault(float(layer_minmax_lr), []).append(p)
            else:
                round_groups.setdefault(float(layer_lr), []).append(p)
    return round_groups, minmax_groups, names


def _mse(pred: torch.Tensor, ref: torch.Tensor, mse, indices, device, amp, amp_dtype, valid_token_mask):
    """auto-round 0.16 ``SignRoundQuantizer._get_loss``, op for op."""
    autocast_ctx = nullcontext() if not amp else torch.autocast(device_type=str(device).split(":")[0], dtype=amp_dtype)
    if valid_token_mask:
        mask = torch.cat([valid_token_mask[i] for i in indices], dim=0).to(device)
        mask.unsqueeze_(-1)
        with autocast_ctx:
            return mse((pred * mask).to(torch.float32), (ref * mask).to(torch.float32))
    with autocast_ctx:
        return mse(pred.to(torch.float32), ref.to(torch.float32))


def _index_tensor(batch: list[int], device: torch.device) -> torch.Tensor:
    """``batch`` as an index tensor on ``device`` without a host sync (pinned, async copy)."""
    index = torch.tensor(batch, dtype=torch.long)
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _select_others(runner, input_others: dict, batch: list[int]) -> dict:
    """auto-round 0.16 ``BlockForwardRunner._select_batch`` for ``input_others``, with host-side indices."""
    shared = runner.shared_cache_keys
    selected = {"positional_inputs": input_others.get("positional_inputs")}
    for key, val in input_others.items():
        if "positional_inputs" in key:
            continue
        if key in shared:
            if isinstance(val, list) and len(val) == 1:
                selected[key] = val[0]
            elif isinstance(val, list) and len(val) > 1:
                idx = batch[0] if len(batch) == 1 else 0
                selected[key] = val[idx] if idx < len(val) else val[0]
            else:
                selected[key] = val
        elif isinstance(val, list):
            vals = [val[i] for i in batch]
            selected[key] = vals[0] if len(vals) == 1 else torch.cat(vals, dim=runner.batch_dim)
        elif isinstance(val, torch.Tensor):
            selected[key] = torch.index_select(val, runner.batch_dim, _index_tensor(batch, val.device))
        else:
            selected[key] = val
    return selected


def lane_forward(runner, module: torch.nn.Module, inputs: list, input_others: dict, indices: list[int]):
    """auto-round 0.16 ``BlockForwardRunner.forward(block, inputs, others, indices)`` for a list
    pool, op for op (same batches, same ``block_forward`` call, same concatenation), except:

    * samples are picked with host-side ints: the runner turns ``indices`` into a device tensor
      and reads every sample's index back with ``.item()``, a host sync per sample (item 8);
    * the output stays on the runner's device (the lane's) instead of going through
      ``cache_device`` and back (item 7).
    """
    outputs = []
    for start in range(0, len(indices), runner.batch_size):
        batch = indices[start : start + runner.batch_size]
        batch_inputs = torch.cat([inputs[i] for i in batch], dim=runner.batch_dim)
        batch_others = _select_others(runner, input_others, batch)
        raw = runner.block_forward(module, batch_inputs, batch_others, runner.amp, runner.amp_dtype,
                                   runner.device, None)
        outputs.append(runner._normalize_output(raw, module))
    return torch.cat(outputs, dim=runner.batch_dim)


def make_lane_loss(data: BlockData, runner, settings: SignRoundSettings, reduction: str, loss_fn=None):
    """A LaneLoss closing over the pool: one BlockForwardRunner per lane device.

    Everything a lane computes (forward output, reference slice, loss and so its backward)
    lives on the lane's device; nothing goes through the runner's ``cache_device``.
    ``loss_fn(pred, ref, indices, mse, device)`` overrides the loss (the integration passes the
    quantizer's own ``_get_loss``); the default reproduces it.
    """
    runners: dict[torch.device, object] = {}

    def runner_for(device: torch.device):
        if device not in runners:
            r = copy.copy(runner)
            r.device = device
            r.cache_device = device  # anything that still asks the runner keeps lane data on the lane
            runners[device] = r
        return runners[device]

    mses: dict[torch.device, torch.nn.Module] = {}

    def lane_loss(lane: Lane, module: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        dev = lane.device
        mse = mses.setdefault(dev, torch.nn.MSELoss(reduction=reduction).to(dev))
        ref = torch.cat([data.outputs[i] for i in indices], dim=0).to(dev)
        pred = lane_forward(runner_for(dev), module, data.inputs, data.input_others, indices)
        if loss_fn is not None:
            return loss_fn(pred, ref, indices, mse, dev)
        return _mse(pred, ref, mse, indices, dev, settings.amp, settings.amp_dtype, data.valid_token_mask)

    return lane_loss


def tune_wrapped_block(
    block: torch.nn.Module,
    data: BlockData,
    settings: SignRoundSettings,
    lanes: Sequence[Lane],
    comm,
    runner,
    lr_of: Callable[[torch.nn.Module], tuple[float, float]],
    *,
    loss_fn=None,
    progress: Callable[[int, float], None] | None = None,
    debug_identical: bool = False,
) -> TuneOutcome:
    """Tune an already wrapped block (auto-round's ``wrapper_block`` done) on ``lanes``.

    The caller unwraps with ``best_params`` afterwards, as serial does.
    """
    t0 = time.perf_counter()
    round_groups, minmax_groups, names = tuned_parameter_groups(block, lr_of)
    groups = list(round_groups.items()) + (list(minmax_groups.items()) if settings.enable_minmax_tuning else [])
    tuned_names = [names[id(p)] for _, ps in groups for p in ps]
    nsamples = len(data.inputs)
    mse_reduction = "sum" if settings.gradient_accumulate_steps != 1 else "mean"

    def make_optimizer(module: torch.nn.Module):
        named = dict(module.named_parameters(remove_duplicate=False))
        params = [{"params": [named[names[id(p)]] for p in ps], "lr": torch.tensor(lr)} for lr, ps in groups]
        extra = dict(settings.optimizer_kwargs)
        if settings.momentum is not None:
            extra["momentum"] = settings.momentum
        opt = settings.optimizer_cls(params, lr=torch.tensor(groups[0][0]), weight_decay=0, **extra)
        if settings.lr_scheduler is None:
            sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=settings.iters)
        else:
            sched = copy.deepcopy(settings.lr_scheduler)
        return opt, sched

    replicas = ReplicaSet(block, lanes, tuned_names)  # lanes wait for the current stream first (R1)
    try:
        # Pure SignSGD (no momentum; serial always passes weight_decay=0) only needs the sign
        # of the summed gradient; anything with state needs the full sums.
        pure_sign = settings.optimizer_cls is SignSGD and not settings.momentum
        exchange = SignExchange(comm) if pure_sign else FullSumExchange(comm)
        engine = TuneEngine(
            replicas,
            make_lane_loss(data, runner, settings, mse_reduction, loss_fn),
            make_optimizer,
            exchange,
            reduction=mse_reduction,
            micro_batch=settings.batch_size if settings.gradient_accumulate_steps != 1 else None,
            loss_scale=settings.loss_scale,
            sample_numel=lambda i: data.inputs[i].numel(),
            debug_identical=debug_identical,
        )
        return _signround_loop(engine, replicas, data, settings, nsamples, progress, t0)
    finally:
        # R5, on success and on failure alike: the current stream and every lane join before
        # the mirrors go and before the caller unwraps (or restores) the home block.
        replicas.close()


def _signround_loop(engine, replicas, data, settings, nsamples, progress, t0) -> TuneOutcome:
    """The serial loop's bookkeeping around engine.backward / engine.step (auto-round 0.16)."""
    block = replicas.home
    global_batch_size = min(nsamples, settings.batch_size * settings.gradient_accumulate_steps)
    num_elm = 1
    if settings.gradient_accumulate_steps != 1 and not data.valid_token_mask:
        num_elm = sum(data.inputs[i].numel() for i in range(global_batch_size))
    index_sampler = IndexSampler(nsamples, global_batch_size)
    # Serial counts each iteration's unmasked tokens with count_nonzero(...).item() per sample;
    # counted once here (the same ints) so an iteration holds no host sync but the readback.
    mask_counts = [int(torch.count_nonzero(m)) for m in data.valid_token_mask] if data.valid_token_mask else None
    best_loss = torch.finfo(torch.float).max
    best_params: dict = {}
    last_best_iter, init_loss, total_loss = 0, None, 0
    losses, drawn, wire = [], [], 0
    for i in range(settings.iters):
        if settings.dq_cur_iter:
            for module in replicas.modules:
                for m in module.modules():
                    m.cur_iter = i
        global_indices = index_sampler.next_batch()
        drawn.append(list(global_indices))
        if mask_counts is not None:
            num_elm = sum(mask_counts[j] for j in global_indices)
        num_elm = 1 if num_elm <= 0 else num_elm
        total_loss = 0
        for step_loss in engine.backward(global_indices):
            total_loss += step_loss / num_elm
        wire += engine.last.wire_bytes
        losses.append(total_loss)
        if i == 0:
            init_loss = total_loss
        if progress is not None:
            progress(i, total_loss)
        if total_loss < best_loss:
            best_loss = total_loss
            # The snapshot reads home (lane 0) on the current stream, which is lane 0's stream
            # (R0): lane 0's step below is queued after it, so it cannot overwrite what is read.
            if not settings.not_use_best_mse:
                best_params = collect_best_params(block, settings.cache_device)
                last_best_iter = i
        if settings.not_use_best_mse and i == settings.iters - 1:
            best_params = collect_best_params(block, settings.cache_device)
        if not settings.not_use_best_mse and 0 < settings.dynamic_max_gap <= i - last_best_iter:
            break
        engine.step()
    best_iter = settings.iters if settings.not_use_best_mse else last_best_iter
    reported = total_loss if settings.not_use_best_mse else best_loss
    return TuneOutcome(
        best_params=best_params,
        losses=losses,
        best_iter=best_iter,
        best_loss=float(reported),
        init_loss=init_loss,
        iters_run=len(losses),
        wire_bytes=wire,
        seconds=time.perf_counter() - t0,
        indices=drawn,
    )
