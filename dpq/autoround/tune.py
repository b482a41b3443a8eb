"""SignRound's per-block tune, described for dpq's session.

:func:`signround_spec` turns a wrapped block, its pool and auto-round 0.16's
``SignRoundQuantizer.quantize_block`` settings into a :class:`dpq.tune_loop.TuneSpec`: the
same parameter groups and per-layer lr, optimizer class and lr schedule, ``IndexSampler``
draws, loss (``_get_loss``, masked and unmasked), ``collect_best_params`` snapshot. The session
(``dpq.session``) runs it on the plan's lanes with ``dpq.tune_loop.run_loop``. At world 1 it is
bitwise the serial loop (``tests/test_parity.py`` holds it to that).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD
from auto_round.compressors.utils import IndexSampler, collect_best_params
from auto_round.logger import logger

from dpq import refusals
from dpq.mirror import LaneData
from dpq.streams import Lane, backend, map_tensors
from dpq.tune_loop import TuneSpec

from .patches import reproduced_changes


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
    """auto-round 0.16 ``SignRoundQuantizer._get_loss``, op for op (``valid_token_mask``: the lane's own)."""
    autocast_ctx = nullcontext() if not amp else torch.autocast(device_type=str(device).split(":")[0], dtype=amp_dtype)
    if valid_token_mask:
        mask = torch.cat([valid_token_mask[i] for i in indices], dim=0).to(device)
        mask.unsqueeze_(-1)
        with autocast_ctx:
            return mse((pred * mask).to(torch.float32), (ref * mask).to(torch.float32))
    with autocast_ctx:
        return mse(pred.to(torch.float32), ref.to(torch.float32))


def _index_tensor(batch: list[int], lane: Lane, staged: LaneData) -> torch.Tensor:
    """``batch`` as an index tensor on ``lane`` without a host sync (pinned, async copy on accelerators)."""
    return staged.bring(lane, torch.tensor(batch, dtype=torch.long))


def _select_others(runner, input_others: dict, batch: list[int], lane: Lane, staged: LaneData) -> dict:
    """auto-round 0.16 ``BlockForwardRunner._select_batch`` for ``input_others``, with host-side
    indices, every value on ``lane`` (R7: shared values brought once per block, per-sample ones
    from where they live)."""
    shared = runner.shared_cache_keys
    selected = {"positional_inputs": staged.once(lane, "positional_inputs", input_others.get("positional_inputs"))}
    for key, val in input_others.items():
        if "positional_inputs" in key:
            continue
        if key in shared:
            if isinstance(val, list) and len(val) == 1:
                selected[key] = staged.once(lane, f"{key}[0]", val[0])
            elif isinstance(val, list) and len(val) > 1:
                idx = batch[0] if len(batch) == 1 else 0
                idx = idx if idx < len(val) else 0
                selected[key] = staged.once(lane, f"{key}[{idx}]", val[idx])
            else:
                selected[key] = staged.once(lane, key, val)
        elif isinstance(val, list):
            if len(batch) == 1:
                selected[key] = map_tensors(val[batch[0]], lambda t: staged.bring(lane, t))
            else:
                selected[key] = staged.gather(lane, val, batch, dim=runner.batch_dim)
        elif isinstance(val, torch.Tensor):
            whole = staged.once(lane, key, val)
            selected[key] = torch.index_select(whole, runner.batch_dim, _index_tensor(batch, lane, staged))
        else:
            selected[key] = staged.once(lane, key, val)
    return selected


def lane_forward(runner, module: torch.nn.Module, inputs: list, input_others: dict, indices: list[int],
                 lane: Lane, staged: LaneData):
    """auto-round 0.16 ``BlockForwardRunner.forward(block, inputs, others, indices)`` for a list
    pool, op for op (same batches, same ``block_forward`` call, same concatenation), except:

    * samples are picked with host-side ints: the runner turns ``indices`` into a device tensor
      and reads every sample's index back with ``.item()``, a host sync per sample;
    * every input reaches the lane through ``staged`` (R7 of ``dpq.streams``): nothing is
      copied on another lane's stream, nothing from pageable host memory;
    * the output stays on the runner's device (the lane's) instead of going through
      ``cache_device`` and back;
    * one batch's output is returned itself, not a concatenation of it (a copy: the same values,
      one op fewer per lane-iteration; Note [one sample, no concatenation] in ``dpq.mirror``).
    """
    outputs = []
    for start in range(0, len(indices), runner.batch_size):
        batch = indices[start : start + runner.batch_size]
        batch_inputs = staged.gather(lane, inputs, batch, dim=runner.batch_dim)
        batch_others = _select_others(runner, input_others, batch, lane, staged)
        raw = runner.block_forward(module, batch_inputs, batch_others, runner.amp, runner.amp_dtype,
                                   runner.device, None)
        outputs.append(runner._normalize_output(raw, module))
    # one batch (a lane's share fits the runner's batch size): the block's own output, no copy
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=runner.batch_dim)


def make_lane_loss(data: BlockData, runner, settings: SignRoundSettings, reduction: str, loss_fn=None,
                   block_forward: Callable | None = None):
    """A LaneLoss closing over the pool: one BlockForwardRunner per lane device.

    Everything a lane computes (forward output, reference slice, loss and so its backward)
    lives on the lane's device; nothing goes through the runner's ``cache_device``, and every
    input, reference output and loss mask reaches the lane through one :class:`LaneData` (R7).
    ``loss_fn(pred, ref, indices, mse, device, masks)`` overrides the loss (the integration passes
    the quantizer's own ``_get_loss``, given the lane's masks); the default reproduces it.
    ``block_forward``: the function every lane's runner calls for the block (None: the runner's own,
    auto-round's compiled one when torch.compile is on).
    """
    runners: dict[torch.device, object] = {}
    staged = LaneData()

    def runner_for(device: torch.device):
        if device not in runners:
            r = copy.copy(runner)
            r.device = device
            r.cache_device = device  # anything that still asks the runner keeps lane data on the lane
            if block_forward is not None:
                r.block_forward = block_forward
            runners[device] = r
        return runners[device]

    mses: dict[torch.device, torch.nn.Module] = {}

    def lane_loss(lane: Lane, module: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        dev = lane.device
        mse = mses.setdefault(dev, torch.nn.MSELoss(reduction=reduction).to(dev))
        masks = staged.once(lane, "valid_token_mask", data.valid_token_mask) if data.valid_token_mask else None
        ref = staged.gather(lane, data.outputs, indices)
        pred = lane_forward(runner_for(dev), module, data.inputs, data.input_others, indices, lane, staged)
        if loss_fn is not None:
            return loss_fn(pred, ref, indices, mse, dev, masks)
        return _mse(pred, ref, mse, indices, dev, settings.amp, settings.amp_dtype, masks)

    return lane_loss


class BestSnapshot:
    """Serial's ``collect_best_params(home, cache_device)`` snapshot of the best iteration, without a
    host wait inside the iteration (R6 of ``dpq.streams``).

    auto-round's snapshot copies every tuned tensor to ``cache_device``; with the block on an
    accelerator and ``cache_device`` the host (``--low_gpu_mem_usage``; ``dpq.parallel_tune``'s
    default) each copy goes to pageable memory and makes the host wait. Here auto-round's
    function makes the copies on the block's device (the same structure, the same values), and
    each is copied on into pinned host memory asynchronously, on the current stream. Call
    :meth:`wait` before anything reads the snapshot on the host (one wait per block, after the
    loop); device-side readers on the current stream (the unwrap) are ordered after the copies anyway.
    """

    def __init__(self, cache_device) -> None:
        self.cache_device = torch.device(cache_device)
        self._event = None

    def __call__(self, home: torch.nn.Module) -> dict:
        device = next((p.device for p in home.parameters()), self.cache_device)
        src, dst = backend(device), backend(self.cache_device)
        if not (dst.host_memory(self.cache_device) and not src.host_memory(device)):
            return collect_best_params(home, self.cache_device)

        def to_host(t: torch.Tensor) -> torch.Tensor:
            buf = src.pinned_empty(t.shape, t.dtype)
            buf.copy_(t.data, non_blocking=True)
            return buf

        # auto-round's structure and keys (copies on the meta device: no memory, no copy), each
        # entry then copied straight from the tuned tensor it names into pinned memory
        out: dict = {}
        for name, entry in collect_best_params(home, "meta").items():
            if isinstance(entry, dict):
                module = home.get_submodule(name) if name else home
                out[name] = {key: to_host(module.params[key]) for key in entry}
            else:  # home itself is one wrapped layer
                out[name] = to_host(home.params[name])
        stream = src.current_stream(device)
        self._event = stream.record_event() if stream is not None else None
        return out

    def wait(self) -> None:
        """The host may read the last snapshot from here on."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()


def is_pure_sign(optimizer_cls: type, momentum: float | None) -> bool:
    """Pure SignSGD (no momentum; serial always passes weight_decay=0) needs only the sign of
    the summed gradient; anything with state needs the full sums."""
    return optimizer_cls is SignSGD and not momentum


@functools.cache
def _sign_sgd_unchanged() -> bool:
    """The installed SignSGD's source is the one dpq reproduces (checked, and warned about, once per process)."""
    changed = reproduced_changes()
    if changed:
        logger.warning(refusals.SIGN_STEP_UPSTREAM_CHANGED + f" (changed: {', '.join(changed)})")
    return not changed


def one_op_sign_step(optimizer_cls: type, momentum: float | None) -> bool:
    """True when dpq's one-op step (:mod:`dpq.engine.sign_step`) may replace each lane's ``SignSGD.step``:
    pure SignSGD itself (not a subclass) and its upstream source the one dpq reproduces (the
    series' ``REPRODUCED``, :mod:`dpq.autoround.versions`); else every lane runs auto-round's own
    step (warned once)."""
    return is_pure_sign(optimizer_cls, momentum) and _sign_sgd_unchanged()


def signround_spec(
    block: torch.nn.Module,
    data: BlockData,
    settings: SignRoundSettings,
    runner,
    lr_of: Callable[[torch.nn.Module], tuple[float, float]],
    *,
    loss_fn=None,
    progress: Callable[[int, float], None] | None = None,
    lane_block_forward: Callable | None = None,
) -> TuneSpec:
    """The tune of an already wrapped block (auto-round's ``wrapper_block`` done). The caller
    unwraps with the outcome's ``best_params`` afterwards, as serial does. ``lane_block_forward``:
    what the lanes call for the block instead of ``runner``'s own (:func:`make_lane_loss`)."""
    round_groups, minmax_groups, names = tuned_parameter_groups(block, lr_of)
    groups = list(round_groups.items()) + (list(minmax_groups.items()) if settings.enable_minmax_tuning else [])
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

    def set_cur_iter(i: int, modules) -> None:  # SignRoundV2 "dq" data types read the iteration off the modules
        for module in modules:
            for m in module.modules():
                m.cur_iter = i

    # Serial counts each iteration's unmasked tokens with count_nonzero(...).item() per sample;
    # counted once here (the same ints) so an iteration holds no host sync but the readback.
    mask = data.valid_token_mask
    return TuneSpec(
        tuned=[names[id(p)] for _, ps in groups for p in ps],
        make_optimizer=make_optimizer,
        lane_loss=make_lane_loss(data, runner, settings, mse_reduction, loss_fn, lane_block_forward),
        sampler=IndexSampler,
        best_params=BestSnapshot(settings.cache_device),
        nsamples=len(data.inputs),
        sample_numel=lambda i: data.inputs[i].numel(),
        iters=settings.iters,
        batch_size=settings.batch_size,
        gradient_accumulate_steps=settings.gradient_accumulate_steps,
        not_use_best_mse=settings.not_use_best_mse,
        dynamic_max_gap=settings.dynamic_max_gap,
        loss_scale=settings.loss_scale,
        token_counts=[int(torch.count_nonzero(m)) for m in mask] if mask else None,
        on_iteration=set_cur_iter if settings.dq_cur_iter else None,
        progress=progress,
        one_op_sign_step=one_op_sign_step(settings.optimizer_cls, settings.momentum) and not settings.optimizer_kwargs,
    )
