"""The timeline model's scenarios: a real auto-round block tuned on logical GPUs (``dpqlab.timeline.record``).

:func:`record_block` runs auto-round's own ``quantize()`` on a tiny bf16 Llama of one layer whose every
size stands for one role (:data:`dpqlab.timeline.shapes.RECORDED`), with torch.compile on (auto-round's
default) or off, and records the block's ``quantize_block`` call; :func:`run_adapter` replays that call through
``dpq.autoround.enable`` (the adapter: auto-round's wrapper, ``block_forward`` and ``_get_loss``)
and :func:`run_api` through ``dpq.parallel_tune``, both inside a :class:`TimelineModel` with the
block on logical device 1 and the pool where the scenario says:

* ``home``: on the block's device (auto-round's default: the pool cached on the GPU);
* ``host``: in host memory (``--low_gpu_mem_usage``; auto-round keeps its best parameters there too,
  ``cache='host'``, unless the scenario says ``cache='device'``);
* ``spread``: sample i on lane ``i * W // n``'s device (auto-round 0.17's ``--calibration_data_device
  auto`` for a pool that does not fit one GPU).

The defects ``tests/test_timeline.py`` re-introduces to show that its checks fail (the data path before
it was lane-local) patch the runtime, so they live with the tests (``tests/timeline_mutants.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from dpqlab.timeline.compiled import capture
from dpqlab.timeline.record import TimelineModel, device_of_place
from dpqlab.timeline.shapes import RECORDED

RECORD_SEQLEN = RECORDED.seqlen  # prime: an activation's element count is a multiple of it, a weight's never
RECORD_SAMPLES = 16
RECORD_BATCH = RECORDED.batch


@contextlib.contextmanager
def bf16_cpu() -> Iterator[None]:
    """auto-round's CPU device reports bf16 support: the model runs under bf16 autocast as on a GPU,
    whatever this CPU's branch (the record models a GPU's run, not this CPU's)."""
    from auto_round.utils.device_manager import get_ar_device

    cls = type(get_ar_device("cpu"))
    real = cls.supports_bf16
    cls.supports_bf16 = lambda self: True
    try:
        yield
    finally:
        cls.supports_bf16 = real


@functools.cache
def record_block(compile: bool = True):
    """The recorded block (:data:`dpqlab.timeline.shapes.RECORDED`: a tiny bf16 Llama layer with
    seeded weights) as auto-round tunes it, a ``dpqlab.autoround_blocks.RecordedBlock``;
    ``compile``: auto-round's default torch.compile on (its functions compiled under
    :func:`dpqlab.timeline.compiled.capture`), else ``--disable_torch_compile``."""
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpqlab.autoround_blocks import record_autoround_blocks

    shape = RECORDED
    model = build_tiny_llama(TinyLlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                             num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                             num_hidden_layers=1)).to(torch.bfloat16)
    data = calibration_samples(RECORD_SAMPLES, RECORD_SEQLEN)
    with bf16_cpu(), (capture(RECORD_SEQLEN) if compile else contextlib.nullcontext()):
        # auto-round compiles only from 10 iterations on; the replays set their own count
        return record_autoround_blocks(iters=10, nsamples=RECORD_SAMPLES, seqlen=RECORD_SEQLEN,
                                       batch_size=RECORD_BATCH, stop_after=1, model=model,
                                       tokenizer=build_tokenizer(), dataset=data, enable_torch_compile=compile)[0]


@functools.cache
def shared_block(compile: bool = True):
    """:func:`record_block`, made once per process: what the tests that replay the same block share
    (a recording is an auto-round run; each replay takes the block's ``fresh_block()`` and restores
    its RNG, so sharing changes no record)."""
    return record_block(compile)


@functools.cache
def recorded_run(compile: bool, world: int, iters: int = 2) -> TimelineModel:
    """:func:`run_adapter` of :func:`shared_block` at ``world``, made once per process (the tests and
    the benchmarks that replay the same record share it)."""
    return run_adapter(shared_block(compile), world, iters=iters)


def compiles(rec) -> bool:
    """The record was made with auto-round's torch.compile on."""
    return bool(rec.quantizer.compress_context.enable_torch_compile)


def _pool_tensors(rec) -> list[list[torch.Tensor]]:
    pools = [rec.fp_inputs, rec.fp_outputs] + ([rec.q_inputs] if rec.q_inputs is not None else [])
    return [list(p) for p in pools]


def _place_pool(model: TimelineModel, rec, pool: str, world: int) -> None:
    others = [t for v in rec.input_others.values() for t in _flat(v)]
    if pool == "home":
        for p in _pool_tensors(rec):
            model.place(p, "cpu:1")
        model.place(others, "cpu:1")
    elif pool == "spread":
        for p in _pool_tensors(rec):
            for i, t in enumerate(p):
                model.place(t, device_of_place(1 + i * world // len(p)))
        model.place(others, "cpu:1")
    elif pool != "host":
        raise ValueError(f"pool must be home, host or spread, got {pool!r}")


def _flat(value) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _settings(rec, cache: str, iters: int) -> Iterator[None]:
    """auto-round's own device settings as on a GPU machine: the major device is the block's (logical
    device 1); best parameters kept there (``cache='device'``) or on the host (``--low_gpu_mem_usage``)."""
    from auto_round.utils.device_manager import device_manager

    q = rec.quantizer
    saved = (device_manager.device, q.compress_context.cache_device, q.iters)
    device_manager.device = "cpu:1"
    q.compress_context.cache_device = torch.device("cpu") if cache == "host" else torch.device("cpu", 1)
    q.iters = iters
    try:
        with bf16_cpu():
            yield
    finally:
        device_manager.device, q.compress_context.cache_device, q.iters = saved


def _compiled(rec) -> contextlib.AbstractContextManager:
    """Compiled functions booked as inductor's kernels while replaying a compile-on record."""
    return capture(RECORD_SEQLEN) if compiles(rec) else contextlib.nullcontext()


def lane_devices(world: int) -> list[str]:
    return [f"cpu:{k + 1}" for k in range(world)]


def run_adapter(rec, world: int, *, pool: str = "home", cache: str | None = None, iters: int = 4,
                overlap: bool | None = None, order: str = "canonical") -> TimelineModel:
    """``rec``'s block through ``dpq.autoround.enable(world)`` on logical GPUs; the model's record.
    Under torchrun (a process group initialised), ``world`` is this rank's lanes. ``cache``: where
    auto-round keeps the best iteration's values (default: the host for a host pool, else the device)."""
    from dpq import autoround as dpq_ar

    block = rec.fresh_block()
    cache = cache or ("host" if pool == "host" else "device")
    with _compiled(rec), TimelineModel(world, seqlen=RECORD_SEQLEN) as model, _settings(rec, cache, iters):
        model.place(block, "cpu:1")
        _place_pool(model, rec, pool, world)
        dpq_ar.enable(world, lane_devices(world), parallel_overlap=overlap, parallel_order=order)
        try:
            rec.restore_rng()
            rec.serial_quantize_block(block)
        finally:
            dpq_ar.disable()
    return model


def run_api(rec, world: int, *, pool: str = "home", iters: int = 4) -> TimelineModel:
    """``rec``'s block through ``dpq.parallel_tune`` on logical GPUs (its own reproduction of the loss)."""
    block = rec.fresh_block()
    q = rec.quantizer
    saved = q.iters
    q.iters = iters
    try:
        with _compiled(rec), TimelineModel(world, seqlen=RECORD_SEQLEN) as model:
            model.place(block, "cpu:1")
            _place_pool(model, rec, pool, world)
            rec.restore_rng()
            rec.dpq_parallel_tune(block, lane_devices(world))
    finally:
        q.iters = saved
    return model


__all__ = ["RECORD_SEQLEN", "bf16_cpu", "compiles", "lane_devices", "record_block",
           "recorded_run", "run_adapter", "run_api"]
