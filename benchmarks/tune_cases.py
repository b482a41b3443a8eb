"""One real auto-round block and the three ways to tune it, shared by bench_tune.py and report.py.

The block is recorded mid-run from ``AutoRound(...).quantize()`` on the tiny Llama
(``dpqlab.autoround_blocks.record_autoround_blocks``), so it carries exactly what auto-round's
``SignRoundQuantizer.quantize_block`` receives. Every run tunes a fresh deep copy of it with
the RNG restored to the recorded state, so the serial run and dpq's runs draw the same
sample indices and do the same work.

- serial: auto-round's own ``quantize_block`` (what runs without dpq)
- dpq world W: ``dpq.parallel_tune`` with W lanes (the engine; at W = 1 bitwise serial)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

# DESIGN.md's tiny Llama: 32 samples x 128 tokens, auto-round's default batch of 8.
NSAMPLES, SEQLEN, BATCH_SIZE = 32, 128, 8


@contextlib.contextmanager
def _autoround_device_map(device: str) -> Iterator[None]:
    """Make ``AutoRound(...)`` built inside the block recorder use ``device_map=device``.

    ``record_autoround_blocks`` fixes ``device_map="cpu"``; for accelerator lanes the block must
    be recorded where auto-round tunes it (its quantizer uses the global device manager).
    """
    import auto_round

    orig = auto_round.AutoRound

    def on_device(*args, **kwargs):
        kwargs["device_map"] = device
        return orig(*args, **kwargs)

    auto_round.AutoRound = on_device
    try:
        yield
    finally:
        auto_round.AutoRound = orig


def record_block(device: str | torch.device = "cpu", iters: int = 20, index: int = 0, **shape):
    """Record the tiny Llama's blocks as auto-round tunes them; return block ``index``."""
    from dpqlab.autoround_blocks import record_autoround_blocks

    kw = {"nsamples": NSAMPLES, "seqlen": SEQLEN, "batch_size": BATCH_SIZE, **shape}
    device = torch.device(device)
    ctx = contextlib.nullcontext() if device.type == "cpu" else _autoround_device_map(str(device))
    with ctx:  # stopped once block ``index`` is recorded: auto-round's own tuning of the blocks is not needed
        recs = record_autoround_blocks(iters=iters, stop_after=index + 1, **kw)
    rec = recs[index]
    # Serial caches the mask on the quantizer during the recorded run; dpq's (a cached property)
    # is computed here, outside any timed region, so neither side pays for it per run.
    _ = rec.valid_token_mask
    return rec


@contextlib.contextmanager
def iterations(rec, iters: int) -> Iterator[None]:
    """Run ``iters`` iterations instead of the recorded count (both serial and dpq read
    ``quantizer.iters``; the learning rate stays the recorded one)."""
    q = rec.quantizer
    old = q.iters
    q.iters = iters
    try:
        yield
    finally:
        q.iters = old


def fresh_block(rec, device: str | torch.device) -> torch.nn.Module:
    """A deep copy of the recorded block on ``device``, with the RNG at the recorded state."""
    block = rec.fresh_block().to(device)
    rec.restore_rng()
    return block


def run_serial(rec, block: torch.nn.Module) -> dict:
    """auto-round's own serial ``SignRoundQuantizer.quantize_block``; returns its best params."""
    return rec.serial_quantize_block(block)


def run_dpq(rec, block: torch.nn.Module, devices: Sequence[str | torch.device]):
    """``dpq.parallel_tune`` on ``len(devices)`` lanes with the recorded run's settings (the recorded
    RNG state, restored by fresh_block)."""
    return rec.dpq_parallel_tune(block, devices)


def synchronize(devices: Sequence[str | torch.device]) -> None:
    """Wait for every accelerator in ``devices`` (a no-op for CPU)."""
    from dpq.streams import backend

    for dev in {str(d): torch.device(d) for d in devices}.values():
        if dev.type != "cpu":
            backend(dev).synchronize(dev)


def timed(fn, devices: Sequence[str | torch.device]):
    """(seconds, result) of ``fn()``, with the devices synchronized before and after."""
    synchronize(devices)
    t0 = time.perf_counter()
    out = fn()
    synchronize(devices)
    return time.perf_counter() - t0, out
