"""Parity with auto-round's own serial ``SignRoundQuantizer.quantize_block`` on real blocks.

World 1: bitwise (best params and every per-iteration loss). World 2..4 on CPU lanes: the
same sample indices every iteration, identical mirrors after every step, best loss within
2% of serial (contract 1 of DESIGN.md: split batches round differently under bf16 autocast).
"""

from __future__ import annotations

import pytest
import torch

import dpq
from dpq.autoround import tune as dp_tune
from tests.conftest import RecordedBlock, record_autoround_blocks


def serial_run(rec: RecordedBlock, monkeypatch) -> tuple[dict, list[float], list[list[int]]]:
    """auto-round's own quantize_block on a fresh copy; returns best params, losses, indices."""
    import auto_round.algorithms.quantization.sign_round.quantizer as q_mod
    from auto_round.compressors import utils as ar_utils

    losses, drawn = [], []
    orig_debug = q_mod.logger.debug

    def debug(msg, *args, **kw):
        if msg.startswith("iter %d loss"):
            losses.append(args[1])
        return orig_debug(msg, *args, **kw)

    orig_next = ar_utils.IndexSampler.next_batch

    def next_batch(self):
        out = orig_next(self)
        drawn.append(list(out))
        return out

    monkeypatch.setattr(q_mod.logger, "debug", debug)
    monkeypatch.setattr(ar_utils.IndexSampler, "next_batch", next_batch)
    rec.restore_rng()
    block = rec.fresh_block()
    best = rec.serial_quantize_block(block)
    monkeypatch.undo()
    return best, losses, drawn


def dp_run(rec: RecordedBlock, world: int, **kw) -> dpq.ParallelTuneResult:
    rec.restore_rng()
    return rec.dpq_parallel_tune(rec.fresh_block(), ["cpu"] * world, **kw)


def assert_params_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for layer in a:
        assert a[layer].keys() == b[layer].keys(), layer
        for key in a[layer]:
            x, y = a[layer][key], b[layer][key]
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), f"{layer}.{key} differs"


@pytest.mark.parametrize("block_index", [0, 1])
def test_world1_is_bitwise_serial(recorded_blocks, monkeypatch, block_index):
    rec = recorded_blocks[block_index]
    best, losses, drawn = serial_run(rec, monkeypatch)
    result = dp_run(rec, 1)
    assert result.world == 1
    assert result.indices == drawn
    assert result.losses == losses  # python floats, compared exactly
    assert_params_bitwise(best, result.best_params)


@pytest.fixture(scope="module")
def longer_blocks():
    # 30 iterations, 32 samples: enough steps for best-loss comparisons to mean something.
    return record_autoround_blocks(iters=30, nsamples=32, seqlen=64, batch_size=8)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_world_n_statistical_parity(longer_blocks, monkeypatch, world):
    rec = longer_blocks[0]
    _, serial_losses, drawn = serial_run(rec, monkeypatch)
    result = dp_run(rec, world, debug_identical=True)  # checks mirrors bitwise after every step
    assert result.world == world
    assert result.indices == drawn
    serial_best = min(serial_losses)
    rel = abs(result.best_loss - serial_best) / serial_best
    print(f"world {world}: serial best {serial_best:.6e} parallel best {result.best_loss:.6e} rel {rel:.4%}")
    assert rel < 0.02


def test_tuned_names_cover_wrapper_params(recorded_blocks):
    from auto_round.wrapper import wrapper_block

    block = recorded_blocks[0].fresh_block()
    wrapper_block(block, True, False, enable_torch_compile=False, device="cpu")
    rounds, minmax, names = dp_tune.tuned_parameter_groups(block, lambda m: (0.1, 0.1))
    named = dict(block.named_parameters())
    for _, ps in list(rounds.items()) + list(minmax.items()):
        for p in ps:
            assert named[names[id(p)]] is p
