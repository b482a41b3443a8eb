"""``dpq.parallel_tune``: SignRound-tune one block data-parallel, no auto-round orchestration."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from dpq.fallback_p2p import select_communicator
from dpq.plan import Plan, PlanRequest, resolve
from dpq.streams import make_lanes

from .compat import check_auto_round_version

check_auto_round_version()

from auto_round.algorithms.block_runner import BlockForwardRunner  # noqa: E402
from auto_round.schemes import preset_name_to_scheme  # noqa: E402
from auto_round.utils.common import SHARED_CACHE_KEYS  # noqa: E402
from auto_round.wrapper import unwrapper_block, wrapper_block  # noqa: E402

from .tune import BlockData, SignRoundSettings, tune_wrapped_block  # noqa: E402

__all__ = ["ParallelTuneResult", "parallel_tune"]


@dataclass
class ParallelTuneResult:
    """What ``parallel_tune`` did. ``best_params`` are already applied to the block."""

    best_params: dict
    losses: list[float]  # per iteration, serial formula
    best_iter: int
    best_loss: float
    seconds: float
    world: int
    devices: list[str]
    communicator: str
    communicator_reason: str
    wire_bytes: int
    plan_reasons: list[str]
    indices: list[list[int]]  # the sample indices drawn each iteration


def _check_inputs(inputs, outputs, input_others) -> list[str]:
    problems = []
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        return ["inputs must be a non-empty list of tensors, one [1, seq, hidden] tensor per sample"]
    shape0 = tuple(inputs[0].shape)
    bad = [i for i, t in enumerate(inputs) if tuple(t.shape) != shape0]
    if bad:
        problems.append(
            f"inputs have mismatched shapes: sample 0 is {shape0} but samples {bad[:5]} differ "
            f"(e.g. {tuple(inputs[bad[0]].shape)}). Fix: pad or truncate every sample to one sequence length"
        )
    if outputs is not None:
        if len(outputs) != len(inputs):
            problems.append(f"outputs has {len(outputs)} samples but inputs has {len(inputs)}; give one per input")
        else:
            bad = [i for i, (a, b) in enumerate(zip(inputs, outputs, strict=True)) if a.shape[:-1] != b.shape[:-1]]
            if bad:
                problems.append(f"outputs {bad[:5]} do not match their inputs' batch/sequence shape")
    for key, val in (input_others or {}).items():
        if isinstance(val, list) and len(val) not in (0, 1, len(inputs)):
            problems.append(f"input_others[{key!r}] has {len(val)} entries; give one per sample or one shared")
    return problems


def _mark_for_quantization(block: torch.nn.Module, scheme: str, bits, group_size, sym) -> None:
    """Give every Linear that auto-round has not configured the attributes WrapperLinear reads."""
    fields = asdict(preset_name_to_scheme(scheme))
    overrides = {k: v for k, v in {"bits": bits, "group_size": group_size, "sym": sym}.items() if v is not None}
    fields.update(overrides)
    for m in block.modules():
        if isinstance(m, torch.nn.Linear):
            if hasattr(m, "bits"):
                for k, v in overrides.items():
                    setattr(m, k, v)
                continue
            for k, v in fields.items():
                setattr(m, k, v)
            m.scale_dtype = torch.float16


@torch.no_grad()
def _reference_outputs(block, runner, inputs, input_others) -> list[torch.Tensor]:
    return runner.forward(block, inputs, input_others)


def parallel_tune(
    block: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    outputs: Sequence[torch.Tensor] | None = None,
    input_others: dict | None = None,
    world: int | str = "auto",
    devices: Sequence[str | int | torch.device] | str | None = None,
    iters: int = 200,
    batch_size: int = 8,
    gradient_accumulate_steps: int = 1,
    scheme: str = "W4A16",
    bits: int | None = None,
    group_size: int | None = None,
    sym: bool | None = None,
    lr: float | None = None,
    minmax_lr: float | None = None,
    enable_minmax_tuning: bool = True,
    momentum: float | None = None,
    not_use_best_mse: bool = False,
    dynamic_max_gap: int = -1,
    amp: bool = True,
    amp_dtype: torch.dtype = torch.bfloat16,
    valid_token_mask: list[torch.Tensor] | None = None,
    shared_cache_keys: Sequence[str] = SHARED_CACHE_KEYS,
    seed: int | None = 42,
    debug_identical: bool = False,
    progress: bool = False,
) -> ParallelTuneResult:
    """SignRound-tune ``block`` data-parallel and apply the best rounding/scales to it.

    ``inputs`` are the block's cached inputs, one tensor per sample; ``outputs`` its fp
    reference outputs (computed from ``inputs`` when omitted); ``input_others`` the extra
    forward kwargs, per sample lists or shared values, as auto-round caches them. Defaults are
    auto-round's (iters 200, batch 8, W4A16 = 4 bits, group 128, lr 1/iters). ``world`` is an
    int or ``'auto'``; ``devices`` a device list (``'0,1'``, ``['cpu', 'cpu']``). ``seed`` seeds
    Python's ``random`` (auto-round's sampler draws from it) and torch; ``None`` uses the
    current state. ``shared_cache_keys`` name the ``input_others`` entries that are one value
    for every sample (auto-round's default for decoder LLMs). Bad arguments raise ``ValueError`` before any work starts.
    """
    problems = _check_inputs(inputs, outputs, input_others)
    if iters < 1:
        problems.append(f"iters must be >= 1, got {iters}")
    if batch_size < 1 or gradient_accumulate_steps < 1:
        problems.append("batch_size and gradient_accumulate_steps must be >= 1")
    if problems:
        raise ValueError("dpq.parallel_tune: " + "; ".join(problems))
    inputs = list(inputs)
    home = next(block.parameters()).device
    per_iter = min(len(inputs), batch_size * gradient_accumulate_steps)
    plan: Plan = resolve(PlanRequest(world=world, devices=devices, samples_per_iter=per_iter, home=home))
    if plan.devices[0] != home and not (plan.devices[0].type == home.type == "cpu"):
        raise ValueError(
            f"dpq.parallel_tune: the block lives on {home} but the first device is {plan.devices[0]}; "
            "lane 0 is the block itself. Fix: move the block to the first device, or list it first"
        )
    lanes = make_lanes(plan.devices)
    comm, comm_reason = select_communicator(lanes)
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)

    runner = BlockForwardRunner(
        batch_size=batch_size, device=home, cache_device="cpu", amp=amp, amp_dtype=amp_dtype,
        enable_torch_compile=False, shared_cache_keys=tuple(shared_cache_keys),
    )
    others = dict(input_others or {})
    if outputs is None:
        outputs = _reference_outputs(block, runner, inputs, others)
    lr = lr if lr is not None else 1.0 / iters
    minmax_lr = minmax_lr if minmax_lr is not None else lr
    _mark_for_quantization(block, scheme, bits, group_size, sym)
    wrapper_block(block, enable_minmax_tuning, False, enable_torch_compile=False, device=home)
    settings = SignRoundSettings(
        iters=iters,
        batch_size=batch_size,
        gradient_accumulate_steps=gradient_accumulate_steps,
        enable_minmax_tuning=enable_minmax_tuning,
        not_use_best_mse=not_use_best_mse,
        dynamic_max_gap=dynamic_max_gap,
        momentum=momentum,
        amp=amp,
        amp_dtype=amp_dtype,
    )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=iters, desc=f"dpq tune (world {plan.world})", leave=False)
    try:
        outcome = tune_wrapped_block(
            block,
            BlockData(inputs, others, list(outputs), valid_token_mask),
            settings,
            lanes,
            comm,
            runner,
            lambda m: (lr, minmax_lr),
            progress=(lambda i, loss: bar.update(1)) if bar else None,
            debug_identical=debug_identical,
        )
    except BaseException:
        unwrapper_block(block, {})  # home back to its fp weights, wrapper removed
        raise
    finally:
        if bar is not None:
            bar.close()
    with torch.no_grad():
        unwrapper_block(block, outcome.best_params)
    return ParallelTuneResult(
        best_params=outcome.best_params,
        losses=outcome.losses,
        best_iter=outcome.best_iter,
        best_loss=outcome.best_loss,
        seconds=outcome.seconds,
        world=plan.world,
        devices=[str(d) for d in plan.devices],
        communicator=comm.name,
        communicator_reason=comm_reason,
        wire_bytes=outcome.wire_bytes,
        plan_reasons=plan.reasons,
        indices=outcome.indices,
    )
