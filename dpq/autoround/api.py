"""``dpq.parallel_tune``: SignRound-tune one block data-parallel, no auto-round orchestration."""

from __future__ import annotations

import itertools
import math
import random
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from auto_round.algorithms.block_runner import BlockForwardRunner
from auto_round.compressors.utils import IndexSampler
from auto_round.schemes import preset_name_to_scheme
from auto_round.utils.common import SHARED_CACHE_KEYS, SUPPORTED_LAYER_TYPES
from auto_round.wrapper import unwrapper_block, wrapper_block

from dpq import refusals, session
from dpq.mirror import tensors_in
from dpq.planning.cost_model import AutoWorld
from dpq.planning.plan import PlanRefused
from dpq.planning.spec import ParallelSpec, SpecError

from .tune import BlockData, SignRoundSettings, is_pure_sign, signround_spec

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
    step: str  # which optimizer step the lanes ran (dpq.engine.sign_step's one op, or each lane's), and why
    issue_s: float  # the issuing thread's host time per lane-iteration (on accelerators: the issue cost)
    plan_reasons: list[str]  # why the plan kept fewer lanes or ran serial, and what it noted (unused devices)
    indices: list[list[int]]  # the sample indices drawn each iteration


_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _problem_list(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"dpq.parallel_tune: {problems[0]}"
    return f"dpq.parallel_tune: {len(problems)} problems, all listed:\n" + "\n".join(f"  - {p}" for p in problems)


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
    dtypes = ", ".join(sorted({str(t.dtype) for t in samples}))
    if any(not t.is_floating_point() for t in samples):
        problems.append(refusals.pool_not_float(name, dtypes))
    elif any(t.dtype not in _POOL_DTYPES for t in samples):
        problems.append(refusals.pool_dtype(name, dtypes))
    devices = {t.device for t in samples}
    if any(d.type == "meta" for d in devices):
        problems.append(refusals.pool_on_meta(name))
        return problems
    if len(devices) > 1:
        problems.append(refusals.pool_spread_over(name, ", ".join(sorted(map(str, devices)))))
    elif home is not None and home.type != "meta" and devices and (dev := next(iter(devices))) not in (
            home, torch.device("cpu")):
        problems.append(refusals.pool_device(name, str(dev), str(home)))
    if all(t.is_floating_point() for t in samples):
        bad = _nonfinite(samples)
        if bad:
            problems.append(refusals.pool_nonfinite(name, bad, len(samples)))
    return problems


def _check_inputs(inputs, outputs, input_others, home: torch.device | None) -> list[str]:
    problems = []
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        return [refusals.INPUTS_NOT_TENSORS]
    shape0 = tuple(inputs[0].shape)
    bad = [i for i, t in enumerate(inputs) if tuple(t.shape) != shape0]
    if bad:
        problems.append(refusals.samples_mismatched(shape0, bad, tuple(inputs[bad[0]].shape)))
    problems += _check_pool("inputs", inputs, home)
    if outputs is not None:
        if not isinstance(outputs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in outputs):
            problems.append(refusals.OUTPUTS_NOT_TENSORS)
        elif len(outputs) != len(inputs):
            problems.append(refusals.outputs_count(len(outputs), len(inputs)))
        else:
            bad = [i for i, (a, b) in enumerate(zip(inputs, outputs, strict=True)) if a.shape != b.shape]
            if bad:
                problems.append(refusals.outputs_shape(bad))
            problems += _check_pool("outputs", outputs, home)
    in_dev = inputs[0].device
    # auto-round's block forward moves input_others with the inputs, and only when the inputs move:
    # next to inputs already on the block's device, every other tensor must be there too.
    allowed = {in_dev} if in_dev == home or home is None else {in_dev, home}
    for key, val in (input_others if isinstance(input_others, dict) else {}).items():
        if key == "positional_inputs":
            pass  # auto-round's extra positional arguments, handed whole to every forward (empty: none)
        elif isinstance(val, (list, tuple)) and not val:
            problems.append(refusals.others_empty(key))  # the forward would unpack (or index) nothing
        elif isinstance(val, list) and len(val) not in (1, len(inputs)):
            problems.append(refusals.others_count(key, len(val)))
        elif key == "position_embeddings" and not _pairs(val):
            problems.append(refusals.others_not_pairs(key))
        devs = {t.device for t in tensors_in(val, levels=3)}
        if any(d.type == "meta" for d in devs):
            problems.append(refusals.others_on_meta(key))
        elif wrong := sorted(map(str, devs - allowed)):
            problems.append(refusals.others_device(key, ", ".join(wrong), str(in_dev)))
    return problems


def _check_fits_block(block: torch.nn.Module, inputs, input_others) -> list[str]:
    """The pool's shape against the block, each problem with its fix: the samples' hidden size (their
    last dimension) is the input width of one of the block's Linear layers (the hidden states entering
    a decoder layer feed its attention's projections), and rotary ``position_embeddings`` cover the
    samples' sequence length. Without a Linear layer there is nothing to compare (``_check_block``
    says so). A pool of another floating dtype than the block's is not refused: auto-round's runner
    casts it."""
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        return []  # _check_inputs said it
    widths = sorted({m.in_features for m in block.modules() if isinstance(m, torch.nn.Linear)})
    sample = inputs[0]
    problems = []
    if widths and sample.dim() >= 1 and sample.shape[-1] not in widths:
        problems.append(refusals.hidden_size_mismatch(int(sample.shape[-1]), [str(w) for w in widths]))
    embeddings = input_others.get("position_embeddings") if isinstance(input_others, dict) else None
    if sample.dim() >= 2 and embeddings and _pairs(embeddings):
        cos = embeddings[0] if isinstance(embeddings[0], torch.Tensor) else embeddings[0][0]  # one pair, or per sample
        if cos.dim() >= 2 and cos.shape[-2] != sample.shape[-2]:
            problems.append(refusals.rotary_length_mismatch(int(cos.shape[-2]), int(sample.shape[-2])))
    return problems


def _check_forward(block: torch.nn.Module, inputs, input_others, home: torch.device | None, amp: bool,
                   amp_dtype: torch.dtype, shared_cache_keys: Sequence[str]) -> list[str]:
    """The block's forward on the first sample, with ``input_others`` as given, as auto-round's runner
    calls it (no gradients, the caller's random generators as they were): a block that needs what
    ``input_others`` lacks (a Llama layer's rotary ``position_embeddings``) fails here, named, before
    the block is touched, instead of deep in the tune. Costs one sample's forward."""
    runner = BlockForwardRunner(batch_size=1, device=home, cache_device="cpu", amp=amp, amp_dtype=amp_dtype,
                                enable_torch_compile=False, shared_cache_keys=tuple(shared_cache_keys))
    devices = [home] if home is not None and home.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            runner.forward(block, _detached(list(inputs)), _detached(dict(input_others or {})), indices=[0])
    except Exception as err:
        import inspect

        given = set(input_others or {})
        try:
            takes = list(inspect.signature(block.forward).parameters)[1:]
        except (TypeError, ValueError):
            takes = []
        missing = [name for name in takes if name not in given and name not in ("args", "kwargs")]
        return [refusals.block_forward_fails(type(block).__name__, f"{type(err).__name__}: {err}", sorted(given),
                                             missing)]
    return []


def _pairs(val) -> bool:
    """``position_embeddings`` as auto-round caches them: one (cos, sin) pair, or a list of them (one per sample)."""
    def pair(v) -> bool:
        return isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(t, torch.Tensor) for t in v)

    return val is None or pair(val) or (isinstance(val, list) and all(pair(v) for v in val))


def _inference_tensors(block: torch.nn.Module, inputs, outputs, input_others) -> list[str]:
    """What holds tensors made under ``torch.inference_mode()``: autograd cannot save them for the
    backward, and the unwrap cannot write the block's weights in place outside that mode."""
    where = [name for name, value in (("inputs", inputs), ("outputs", outputs))
             if any(t.is_inference() for t in tensors_in(value or [], levels=1))]
    where += [f"input_others[{key!r}]" for key, val in (input_others if isinstance(input_others, dict) else {}).items()
              if any(t.is_inference() for t in tensors_in(val, levels=3))]
    if any(t.is_inference() for t in itertools.chain(block.parameters(), block.buffers())):
        where.append("the block's weights")
    return where


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_settings(iters, batch_size, gradient_accumulate_steps, dynamic_max_gap, seed, bits, group_size, lr,
                    minmax_lr, momentum) -> list[str]:
    """The numeric settings' types and ranges, each problem with its fix (a wrong type would otherwise
    surface as a TypeError from deep inside the run)."""
    problems = []
    for name, value in (("iters", iters), ("batch_size", batch_size),
                        ("gradient_accumulate_steps", gradient_accumulate_steps)):
        if not _is_int(value):
            problems.append(refusals.setting_type(name, repr(value), "count"))
    if _is_int(iters) and iters < 1:
        problems.append(refusals.bad_count(iters=iters))
    if _is_int(batch_size) and _is_int(gradient_accumulate_steps) and min(batch_size, gradient_accumulate_steps) < 1:
        problems.append(refusals.bad_count(batch_size=batch_size, accumulate=gradient_accumulate_steps))
    if not _is_int(dynamic_max_gap):
        problems.append(refusals.setting_type("dynamic_max_gap", repr(dynamic_max_gap), "int"))
    if seed is not None and not _is_int(seed):
        problems.append(refusals.setting_type("seed", repr(seed), "int or None"))
    if bits is not None and not (_is_int(bits) and bits >= 1):  # 0 or less: every weight non-finite
        problems.append(refusals.setting_type("bits", repr(bits), "bits"))
    if group_size is not None and not (_is_int(group_size) and group_size >= -1):
        problems.append(refusals.setting_type("group_size", repr(group_size), "group"))
    for name, value, positive in (("lr", lr, True), ("minmax_lr", minmax_lr, True), ("momentum", momentum, False)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and not (number and (value > 0 if positive else value >= 0)):
            problems.append(refusals.setting_type(name, repr(value), "positive" if positive else "non-negative"))
    return problems


def _detached(value):
    """``value`` with every tensor detached (the same storage): the tune's autograd graph never
    reaches the caller's tensors, so one passed with ``requires_grad=True`` gets no ``.grad``."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _check_block(block: torch.nn.Module, scheme: str, bits: int | None) -> list[str]:
    """What makes ``block`` untunable, each with its fix (nothing is touched)."""
    params = list(block.parameters())
    if not params:
        return [refusals.BLOCK_NO_PARAMS]
    if type(block) in SUPPORTED_LAYER_TYPES:
        return [refusals.block_is_a_layer(type(block).__name__)]
    problems = []
    devices = {p.device for p in params}
    if any(d.type == "meta" for d in devices):
        problems.append(refusals.BLOCK_ON_META)
    elif len(devices) > 1:
        problems.append(refusals.block_on_devices(", ".join(sorted(map(str, devices)))))
    wrapped = [n for n, m in block.named_modules() if hasattr(m, "orig_layer")]
    if wrapped:
        problems.append(refusals.block_already_wrapped(wrapped))
    layers = {n: m for n, m in block.named_modules() if type(m) in SUPPORTED_LAYER_TYPES}
    quantized = [n for n, m in layers.items() if "scale" in m.__dict__ and "zp" in m.__dict__]
    packed = [n for n, m in block.named_modules() if hasattr(m, "qweight")]
    if quantized or packed:
        problems.append(refusals.block_already_quantized(quantized or packed, packed=not quantized))
    if not layers:
        problems.append(refusals.block_no_linear(sorted({type(m).__name__ for m in block.modules() if m._parameters})))
    else:
        try:
            scheme_bits = preset_name_to_scheme(scheme).bits
        except (KeyError, AttributeError, TypeError):  # not a preset's name (None, a number: no .upper())
            problems.append(refusals.unknown_scheme(scheme))
            return problems
        eff = {n: bits if bits is not None else getattr(m, "bits", scheme_bits if isinstance(m, torch.nn.Linear)
                                                          else None) for n, m in layers.items()}
        if all(b is None or int(b) > 8 for b in eff.values()):
            problems.append(refusals.no_quantized_layer(sorted({str(b) for b in eff.values()})))
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
    auto_world: AutoWorld | None = None,
    overlap: bool | str | None = None,
    timeout: float = session.DEFAULT_TIMEOUT_S,
    order: str = "canonical",
) -> ParallelTuneResult:
    """SignRound-tune ``block`` data-parallel and apply the best rounding/scales to it.

    ``inputs`` are the block's cached inputs, one tensor per sample; ``outputs`` its fp
    reference outputs (computed from ``inputs`` when omitted); ``input_others`` the extra
    forward kwargs, per sample lists or shared values, as auto-round caches them. Defaults are
    auto-round's (iters 200, batch 8, W4A16 = 4 bits, group 128, lr 1/iters). ``world`` is an
    int or ``'auto'``; ``devices`` a device list (``'0,1'``, ``['cpu', 'cpu']``). ``seed``: the
    sample indices are auto-round's sampler's draws after ``random.seed(seed)``, from a generator
    of this call's own (Python's global one is neither read nor changed), and torch's global
    generator is seeded with it (auto-round seeds both); ``None`` draws from Python's global
    generator as it stands. ``shared_cache_keys`` name the ``input_others`` entries that are one
    value for every sample (auto-round's default for decoder LLMs).

    Calls may run in several threads at once (each on its own block): with a seed each draws what
    it draws alone. Torch's global generator is shared, but only stochastic-rounding data types
    draw from it during a tune; run those one after another. The caller's grad mode does not
    matter (the tune enables autograd for itself, also under ``torch.no_grad()`` or
    ``torch.inference_mode()``), and the caller's tensors get no ``.grad``: the pool is used
    detached. Tensors made under ``torch.inference_mode()`` are refused (autograd cannot use them).

    ``auto_world``: under ``world='auto'``, the cost model that picks the world by predicted
    time (``dpq.planning.cost_model.AutoWorld``; None: a fresh one for this call). ``overlap``: exchange
    gradient buckets during the backward: None or 'auto' (CPU lanes on; GPU lanes as
    :func:`dpq.planning.plan.overlap_choice` decides: on where some lane GPU pair has no peer access), True
    or 'on' (on accelerators the exchange on a second stream per lane, ``dpq.comm.comm_streams``: checked
    for stream order on CPU; on one H200's lanes bitwise the plain run, not yet on several GPUs),
    False or 'off'.
    ``timeout``: seconds the host waits for an iteration's work on the lanes before the run stops as
    hung (``dpq.tune_loop``: the watchdog). ``order``: 'canonical' (the sums in dpq's lane order: the
    bits depend on the world alone) or 'native' (NCCL's own reduce-scatter on distinct GPUs: the same bits
    on every lane, which depend on NCCL's algorithm; Note [canonical or native order] in ``dpq.planning.plan``).

    Bad arguments (block, pool, settings, lanes) raise one ``ValueError`` listing every problem
    with its fix, before the block is touched. Any later failure (an exception or out-of-memory
    on any lane, an interrupt) puts the block back exactly as it was passed in (same module
    objects, same attributes, bitwise the same weights) and re-raises; the error's traceback
    keeps its line numbers but not the failed run's locals, so holding on to the error does
    not hold the run's mirrors, wrappers or optimizer state.
    """
    if not isinstance(block, torch.nn.Module):
        raise ValueError(_problem_list([refusals.block_not_module(type(block).__name__)]))
    if input_others is not None and not isinstance(input_others, dict):
        raise ValueError(_problem_list([refusals.others_not_dict(type(input_others).__name__)]))
    home = _block_device(block)
    home = None if home is not None and home.type == "meta" else home  # said once, by _check_block
    problems = _check_block(block, scheme, bits) + _check_inputs(inputs, outputs, input_others, home)
    if valid_token_mask is not None and isinstance(inputs, (list, tuple)) and (
            not isinstance(valid_token_mask, (list, tuple)) or len(valid_token_mask) != len(inputs)):
        kind = (f"{len(valid_token_mask)} masks" if isinstance(valid_token_mask, (list, tuple)) else
                f"a {type(valid_token_mask).__name__}")
        problems.append(refusals.mask_count(kind, len(inputs)))
    problems += _check_fits_block(block, inputs, input_others)
    problems += _check_settings(iters, batch_size, gradient_accumulate_steps, dynamic_max_gap, seed, bits, group_size,
                                lr, minmax_lr, momentum)
    if isinstance(inputs, (list, tuple)) and (held := _inference_tensors(block, inputs, outputs, input_others)):
        problems.append(refusals.inference_tensors(held))
    if not problems:  # the pool and the block agree on paper: one sample through the forward
        problems += _check_forward(block, inputs, input_others, home, amp, amp_dtype, shared_cache_keys)
    settings = SignRoundSettings(
        iters=iters, batch_size=batch_size, gradient_accumulate_steps=gradient_accumulate_steps,
        enable_minmax_tuning=enable_minmax_tuning, not_use_best_mse=not_use_best_mse,
        dynamic_max_gap=dynamic_max_gap, momentum=momentum, amp=amp, amp_dtype=amp_dtype,
        cache_device=home if home is not None else "cpu",  # the best iteration's values stay with the block
    )
    # the caller's tensors detached: the tune's graph starts at the pool, whatever requires_grad they carry
    task = _Task(block, _detached(list(inputs)) if isinstance(inputs, (list, tuple)) else [], _detached(outputs),
                 _detached(dict(input_others or {})), home, settings, scheme=scheme, bits=bits, group_size=group_size,
                 sym=sym, lr=lr, minmax_lr=minmax_lr, valid_token_mask=valid_token_mask,
                 shared_cache_keys=shared_cache_keys, seed=seed, progress=progress)
    spec = config = plan = None
    try:  # the lane settings, valid by construction (Note [a spec cannot exist invalid]), in this call's names
        spec = ParallelSpec(world, devices, debug_identical, overlap, timeout, order=order, caller="api")
    except SpecError as err:
        problems += err.problems
    if spec is not None and isinstance(inputs, (list, tuple)) and inputs and _is_int(batch_size) and _is_int(
            gradient_accumulate_steps):
        try:  # the plan needs the samples per iteration
            if auto_world is None and spec.world == "auto":
                auto_world = AutoWorld()  # one per call: the link probed once, the world by predicted time
            config = session.SessionConfig(spec, auto_world=auto_world, caller="api")
            plan = session.block_plan(config, task.describe())
        except PlanRefused as refused:
            problems += refused.reasons
    if problems or plan is None:
        raise ValueError(_problem_list(problems))
    # Nothing above touched the block. From here on the session puts it back exactly as it was
    # passed in on any failure, and drops what the failed run held before the error reaches the caller.
    # The block's own weights are frozen while it tunes, as in auto-round's run (its model is
    # frozen): only the wrappers' values need gradients, and a lane sharing home's frozen weights
    # must not accumulate into the caller's ``.grad``. Put back as they were afterwards.
    trainable = [p for p in block.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        # tuning needs autograd whatever mode the caller is in (torch.no_grad(), torch.inference_mode())
        with torch.inference_mode(False), torch.enable_grad():
            return session.run(config, task.describe(), plan=plan).result
    finally:
        for p in trainable:
            p.requires_grad_(True)
        task.close()


def _private_sampler(rng: random.Random) -> type:
    """auto-round's ``IndexSampler``, its own code, drawing from ``rng`` instead of Python's global
    generator. Its methods call ``random.shuffle``, a bound method of the global ``random.Random``;
    here the same code runs with the name ``random`` bound to ``rng``, so a sampler of
    ``random.Random(seed)`` draws bitwise what ``IndexSampler`` draws after ``random.seed(seed)``, and
    two calls in two threads each draw their own (no call sees the other's, or anyone else's, draws)."""
    methods = {}
    for name, fn in vars(IndexSampler).items():
        if isinstance(fn, types.FunctionType):
            scope = dict(fn.__globals__, random=rng)
            methods[name] = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    return type("PrivateIndexSampler", (IndexSampler,), methods)


def _block_device(block: torch.nn.Module) -> torch.device | None:
    """The device of the block's first weight (None for a block without any)."""
    for p in block.parameters():
        return p.device
    return None


class _Task:
    """``parallel_tune``'s block as the session's task: seed, reference outputs, quantization
    attributes and auto-round's wrapper in ``start``; auto-round's unwrap in ``finish``."""

    def __init__(self, block, inputs, outputs, others, home, settings: SignRoundSettings, *, scheme, bits, group_size,
                 sym, lr, minmax_lr, valid_token_mask, shared_cache_keys, seed, progress) -> None:
        self.block, self.inputs, self.outputs, self.others, self.home = block, inputs, outputs, others, home
        self.settings, self.scheme, self.bits, self.group_size, self.sym = settings, scheme, bits, group_size, sym
        self.lr, self.minmax_lr, self.valid_token_mask = lr, minmax_lr, valid_token_mask
        self.shared_cache_keys, self.seed, self.progress = shared_cache_keys, seed, progress

    def describe(self) -> session.BlockTask:
        s = self.settings
        per_iter = max(1, min(len(self.inputs), s.batch_size * s.gradient_accumulate_steps))
        return session.BlockTask(name="dpq.parallel_tune", block=self.block, start=self.start, finish=self.finish,
                                 samples_per_iter=per_iter, pool_samples=len(self.inputs), home=self.home,
                                 pure_sign=is_pure_sign(s.optimizer_cls, s.momentum))

    def start(self, ran: session.LaneRun):
        """The work before the loop. Its frame and everything below it hold the run (wrappers,
        the pool's closures): on failure the session clears them from the traceback."""
        s = self.settings
        if self.seed is not None:
            torch.manual_seed(self.seed)  # torch's global generator (only stochastic-rounding data types draw)
        runner = BlockForwardRunner(
            batch_size=s.batch_size, device=self.home, cache_device="cpu", amp=s.amp, amp_dtype=s.amp_dtype,
            enable_torch_compile=False, shared_cache_keys=tuple(self.shared_cache_keys),
        )
        outputs = self.outputs
        if outputs is None:
            outputs = _reference_outputs(self.block, runner, self.inputs, self.others)
        lr = self.lr if self.lr is not None else 1.0 / s.iters
        minmax_lr = self.minmax_lr if self.minmax_lr is not None else lr
        _mark_for_quantization(self.block, self.scheme, self.bits, self.group_size, self.sym)
        wrapper_block(self.block, s.enable_minmax_tuning, False, enable_torch_compile=False, device=self.home)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=s.iters, desc=f"dpq tune (world {ran.world})", leave=False)
        self._bar = bar
        spec = signround_spec(self.block, BlockData(self.inputs, self.others, list(outputs), self.valid_token_mask),
                              s, runner, lambda m: (lr, minmax_lr),
                              progress=(lambda i, loss: bar.update(1)) if bar else None)
        if self.seed is not None:  # this call's own generator: the draws of random.seed(seed), unshared
            spec.sampler = _private_sampler(random.Random(self.seed))
        self.snapshot = spec.best_params  # finish() waits for its copies (it holds nothing of the run)
        return spec

    def finish(self, outcome, ran: session.LaneRun) -> ParallelTuneResult:
        self.close_bar()
        self.snapshot.wait()  # the snapshot's copies to the host (dpq.autoround.tune.BestSnapshot)
        with torch.no_grad():
            unwrapper_block(self.block, outcome.best_params)
        return ParallelTuneResult(
            best_params=outcome.best_params,
            losses=outcome.losses,
            best_iter=outcome.best_iter,
            best_loss=outcome.best_loss,
            seconds=outcome.seconds,
            world=ran.world,
            devices=[str(d) for d in ran.devices],
            communicator=ran.communicator,
            communicator_reason=ran.communicator_reason,
            wire_bytes=outcome.wire_bytes,
            step=ran.step,
            issue_s=outcome.issue_s,
            plan_reasons=ran.said,
            indices=outcome.indices,
        )

    def close_bar(self) -> None:
        bar, self._bar = getattr(self, "_bar", None), None
        if bar is not None:
            bar.close()

    def close(self) -> None:
        """The call is over: the progress bar closed, and the pool let go (the detached views of the
        caller's tensors: a failed call's error keeps this task in its traceback's frames)."""
        self.close_bar()
        self.inputs, self.outputs, self.others, self.valid_token_mask = [], None, {}, None
