"""``dpq.parallel_tune``: SignRound-tune one block data-parallel, no auto-round orchestration."""

from __future__ import annotations

import copy
import itertools
import random
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from dpq.fallback_p2p import select_communicator
from dpq.plan import Plan, PlanRefused, PlanRequest, resolve
from dpq.streams import make_lanes

from .compat import check_auto_round_version

check_auto_round_version()

from auto_round.algorithms.block_runner import BlockForwardRunner  # noqa: E402
from auto_round.schemes import preset_name_to_scheme  # noqa: E402
from auto_round.utils.common import SHARED_CACHE_KEYS, SUPPORTED_LAYER_TYPES  # noqa: E402
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
    plan_reasons: list[str]  # why the plan kept fewer lanes or ran serial, and what it noted (unused devices)
    indices: list[list[int]]  # the sample indices drawn each iteration


_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _problem_list(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"dpq.parallel_tune: {problems[0]}"
    return f"dpq.parallel_tune: {len(problems)} problems, all listed:\n" + "\n".join(f"  - {p}" for p in problems)


def _tensors_in(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)


def _nonfinite(samples: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the samples holding a NaN or an inf (one host sync per device, not per sample)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(samples):
        by_device.setdefault(t.device, []).append(i)
    bad = []
    for idx in by_device.values():
        finite = torch.stack([torch.isfinite(samples[i]).all() for i in idx]).tolist()
        bad += [i for i, ok in zip(idx, finite, strict=True) if not ok]
    return sorted(bad)


def _check_pool(name: str, samples: Sequence[torch.Tensor], home: torch.device | None) -> list[str]:
    """dtype, device and finiteness of ``inputs`` / ``outputs``, each problem with its fix."""
    problems = []
    dtypes = sorted({str(t.dtype) for t in samples})
    if any(not t.is_floating_point() for t in samples):
        problems.append(f"{name} are {', '.join(dtypes)}: parallel_tune takes the block's hidden states (floating "
                        "point), not token ids. Fix: capture the layer's inputs and outputs, e.g. with "
                        "dpq.demo.model.capture_block_inputs or from auto-round's cache")
    elif any(t.dtype not in _POOL_DTYPES for t in samples):
        problems.append(f"{name} are {', '.join(dtypes)}: blocks are tuned in float32, float16 or bfloat16. Fix: cast "
                        f"them to the block's dtype, e.g. [t.to(torch.float32) for t in {name}]")
    devices = {t.device for t in samples}
    if any(d.type == "meta" for d in devices):
        problems.append(f"{name} are on the meta device: they have no values. Fix: pass the tensors captured from a "
                        "real forward of the model")
        return problems
    if len(devices) > 1:
        problems.append(f"{name} are spread over {', '.join(sorted(map(str, devices)))}. Fix: put every sample on "
                        "one device: the block's, or the CPU")
    elif home is not None and home.type != "meta" and devices and (dev := next(iter(devices))) not in (
            home, torch.device("cpu")):
        problems.append(f"{name} are on {dev} but the block is on {home}. Fix: move them to {home}, or keep them on "
                        "the CPU (each batch is copied to the lanes)")
    if all(t.is_floating_point() for t in samples):
        bad = _nonfinite(samples)
        if bad:
            problems.append(f"{name} {bad[:5]}{' ...' if len(bad) > 5 else ''} contain NaN or inf ({len(bad)} of "
                            f"{len(samples)} samples): every loss would be NaN. Fix: recompute them from the fp "
                            "model (an fp16 overflow upstream? run it in bfloat16 or float32)")
    return problems


def _check_inputs(inputs, outputs, input_others, home: torch.device | None) -> list[str]:
    problems = []
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        return ["inputs must be a non-empty list of tensors. Fix: pass one [1, seq, hidden] tensor per sample"]
    shape0 = tuple(inputs[0].shape)
    bad = [i for i, t in enumerate(inputs) if tuple(t.shape) != shape0]
    if bad:
        problems.append(
            f"inputs have mismatched shapes: sample 0 is {shape0} but samples {bad[:5]} differ "
            f"(e.g. {tuple(inputs[bad[0]].shape)}). Fix: pad or truncate every sample to one sequence length"
        )
    problems += _check_pool("inputs", inputs, home)
    if outputs is not None:
        if not isinstance(outputs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in outputs):
            problems.append("outputs must be a list of tensors. Fix: one reference output per input, or None to "
                            "compute them from the fp block")
        elif len(outputs) != len(inputs):
            problems.append(f"outputs has {len(outputs)} samples but inputs has {len(inputs)}. Fix: give one "
                            "output per input")
        else:
            bad = [i for i, (a, b) in enumerate(zip(inputs, outputs, strict=True)) if a.shape[:-1] != b.shape[:-1]]
            if bad:
                problems.append(f"outputs {bad[:5]} do not match their inputs' batch/sequence shape. Fix: pass each "
                                "input's own block output, in the same order")
            problems += _check_pool("outputs", outputs, home)
    in_dev = inputs[0].device
    # auto-round's block forward moves input_others with the inputs, and only when the inputs move:
    # next to inputs already on the block's device, every other tensor must be there too.
    allowed = {in_dev} if in_dev == home or home is None else {in_dev, home}
    for key, val in (input_others if isinstance(input_others, dict) else {}).items():
        if isinstance(val, list) and len(val) not in (0, 1, len(inputs)):
            problems.append(f"input_others[{key!r}] has {len(val)} entries. Fix: give one per sample, or one shared")
        devs = {t.device for t in _tensors_in(val)}
        if any(d.type == "meta" for d in devs):
            problems.append(f"input_others[{key!r}] is on the meta device. Fix: pass the values captured from a real "
                            "forward")
        elif wrong := sorted(map(str, devs - allowed)):
            problems.append(f"input_others[{key!r}] is on {', '.join(wrong)} but the inputs are on {in_dev}. Fix: "
                            f"move it to {in_dev}")
    return problems


def _check_block(block: torch.nn.Module, scheme: str, bits: int | None) -> list[str]:
    """What makes ``block`` untunable, each with its fix (nothing is touched)."""
    params = list(block.parameters())
    if not params:
        return ["the block has no parameters: there is nothing to tune. Fix: pass a block with its weights, e.g. a "
                "decoder layer (model.model.layers[i])"]
    problems = []
    devices = {p.device for p in params}
    if any(d.type == "meta" for d in devices):
        problems.append("the block's weights are on the meta device (not loaded: an empty-weights or offloaded "
                        "model). Fix: load the block's weights onto its device first")
    elif len(devices) > 1:
        problems.append(f"the block's weights span {', '.join(sorted(map(str, devices)))}. Fix: move the block to one "
                        "device, e.g. block.to('cuda:0')")
    wrapped = [n for n, m in block.named_modules() if hasattr(m, "orig_layer")]
    if wrapped:
        problems.append(f"the block is already wrapped for tuning ({', '.join(wrapped[:3])}"
                        f"{', ...' if len(wrapped) > 3 else ''}: auto-round's wrapper_block put wrappers around them). "
                        "Fix: pass the block as it was before wrapping (each wrapper's .orig_layer is the original "
                        "layer)")
    layers = {n: m for n, m in block.named_modules() if type(m) in SUPPORTED_LAYER_TYPES}
    quantized = [n for n, m in layers.items() if "scale" in m.__dict__ and "zp" in m.__dict__]
    packed = [n for n, m in block.named_modules() if hasattr(m, "qweight")]
    if quantized or packed:
        names = quantized or packed
        what = "carry the scale/zp that auto-round's unwrap leaves" if quantized else "are packed (qweight)"
        problems.append(f"the block is already quantized ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''} "
                        f"{what}): tuning it again would round already rounded weights. Fix: pass the fp block "
                        "(a copy taken before quantizing, or the reloaded model's layer)")
    if not layers:
        kinds = sorted({type(m).__name__ for m in block.modules() if m._parameters})
        problems.append(f"the block has no Linear layer to quantize (its weights are in {', '.join(kinds[:5])}): "
                        "SignRound tunes Linear weights. Fix: pass a block with Linear layers, e.g. a decoder layer")
    else:
        try:
            scheme_bits = preset_name_to_scheme(scheme).bits
        except KeyError:
            problems.append(f"unknown scheme {scheme!r}. Fix: one of auto-round's preset names, e.g. 'W4A16'")
            return problems
        eff = {n: bits if bits is not None else getattr(m, "bits", scheme_bits if isinstance(m, torch.nn.Linear)
                                                          else None) for n, m in layers.items()}
        if all(b is None or int(b) > 8 for b in eff.values()):
            problems.append(f"no layer of the block would be quantized: bits {sorted({str(b) for b in eff.values()})} "
                            "(auto-round quantizes bits <= 8 only). Fix: bits <= 8, e.g. scheme='W4A16'")
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
    for every sample (auto-round's default for decoder LLMs).

    Bad arguments (block, pool, settings, lanes) raise one ``ValueError`` listing every problem
    with its fix, before the block is touched. Any later failure (an exception or out-of-memory
    on any lane, an interrupt) puts the block back exactly as it was passed in (same module
    objects, same attributes, bitwise the same weights) and re-raises; the error's traceback
    keeps its line numbers but not the failed run's locals, so holding on to the error does
    not hold the run's mirrors, wrappers or optimizer state.
    """
    home = _block_device(block)
    home = None if home is not None and home.type == "meta" else home  # said once, by _check_block
    problems = _check_block(block, scheme, bits) + _check_inputs(inputs, outputs, input_others, home)
    if not isinstance(iters, int) or iters < 1:
        problems.append(f"iters must be >= 1, got {iters!r}. Fix: e.g. iters=200 (auto-round's default)")
    if batch_size < 1 or gradient_accumulate_steps < 1:
        problems.append(f"batch_size and gradient_accumulate_steps must be >= 1, got {batch_size} and "
                        f"{gradient_accumulate_steps}. Fix: e.g. batch_size=8, gradient_accumulate_steps=1")
    plan = None
    if isinstance(inputs, (list, tuple)) and inputs:
        per_iter = max(1, min(len(inputs), batch_size * gradient_accumulate_steps))
        try:
            plan = resolve(PlanRequest(world=world, devices=devices, samples_per_iter=per_iter, home=home))
        except PlanRefused as refused:
            problems += refused.reasons
        except ValueError as err:  # the world itself
            problems.append(str(err).removeprefix("dpq: "))
    if problems or plan is None:
        raise ValueError(_problem_list(problems))
    # Nothing above touched the block. From here on every failure puts it back exactly as it was
    # passed in, and drops what the failed run held before the error reaches the caller.
    snapshot = _BlockSnapshot(block)
    try:
        return _run(block, list(inputs), outputs, dict(input_others or {}), plan, home, iters=iters,
                    batch_size=batch_size, gradient_accumulate_steps=gradient_accumulate_steps, scheme=scheme,
                    bits=bits, group_size=group_size, sym=sym, lr=lr, minmax_lr=minmax_lr,
                    enable_minmax_tuning=enable_minmax_tuning, momentum=momentum, not_use_best_mse=not_use_best_mse,
                    dynamic_max_gap=dynamic_max_gap, amp=amp, amp_dtype=amp_dtype,
                    valid_token_mask=valid_token_mask, shared_cache_keys=shared_cache_keys, seed=seed,
                    debug_identical=debug_identical, progress=progress)
    except BaseException as err:
        snapshot.restore()
        del snapshot
        _release_run(err)
        raise


def _block_device(block: torch.nn.Module) -> torch.device | None:
    """The device of the block's first weight (None for a block without any)."""
    for p in block.parameters():
        return p.device
    return None


def _run(block, inputs, outputs, others, plan: Plan, home, *, iters, batch_size, gradient_accumulate_steps, scheme,
         bits, group_size, sym, lr, minmax_lr, enable_minmax_tuning, momentum, not_use_best_mse, dynamic_max_gap,
         amp, amp_dtype, valid_token_mask, shared_cache_keys, seed, debug_identical, progress) -> ParallelTuneResult:
    """The work of ``parallel_tune`` on a checked block. Its frame and everything below it hold the
    run (mirrors, wrappers, optimizers): on failure the caller clears them from the traceback."""
    lanes = make_lanes(plan.devices)
    comm, comm_reason = select_communicator(lanes)
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)

    runner = BlockForwardRunner(
        batch_size=batch_size, device=home, cache_device="cpu", amp=amp, amp_dtype=amp_dtype,
        enable_torch_compile=False, shared_cache_keys=tuple(shared_cache_keys),
    )
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
        plan_reasons=plan.reasons + plan.notes,
        indices=outcome.indices,
    )


class _BlockSnapshot:
    """What it takes to put a block back exactly as it was: every submodule's attributes (the
    same objects; containers such as ``_modules`` and ``_parameters`` with the same contents, so
    wrapped layers get their original layer objects back and added attributes such as
    ``bits``/``scale``/``zp``/``iters`` go) and every parameter's and buffer's bytes, kept on the
    CPU (auto-round's unwrap writes quantized weights in place). ``restore`` is bitwise."""

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


def _release_run(err: BaseException) -> None:
    """Let go of everything the failed run's frames hold while ``err`` lives.

    A caught error keeps its traceback, the traceback every frame below the catch, and each
    frame its locals and its function, whose closure can hold the run too (a lane-loss closure
    holds the pool; torch's hook-calling closure holds the module it ran: a mirror). So the
    frames below ``parallel_tune`` are cleared and cut off ``err``'s traceback; where it failed
    stays readable as a note. Errors chained to ``err`` inside the run are released the same way;
    the caller's own (an error being handled when ``parallel_tune`` was called) are left alone.
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
            e.add_note("dpq.parallel_tune: where it failed (the failed run's frames were released with its "
                       "memory):\n" + "".join(traceback.format_tb(inner)).rstrip())
            traceback.clear_frames(inner)
        if e is err:
            if err.__traceback__ is not None:
                err.__traceback__.tb_next = None
        else:
            e.__traceback__ = None
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
