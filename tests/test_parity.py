"""Parity with auto-round's own serial ``SignRoundQuantizer.quantize_block`` on real blocks.

World 1: bitwise (best params and every per-iteration loss). World 2..4 on CPU lanes: the
same sample indices every iteration, identical mirrors after every step, and statistical
parity (contract 1 of DESIGN.md: split batches round differently under bf16 autocast, so the
trajectories drift apart by rounding): means over several (block, seed) runs within bounds
derived from serial's own seed-to-seed spread, and a mutation test proving those bounds catch a
wrong loss weight, a dropped lane gradient and a lane reading another lane's slice.
"""

from __future__ import annotations

import random
import statistics

import pytest
import torch

import dpq
from dpq.autoround import tune as dp_tune
from dpqlab import parity_stats
from dpqlab.autoround_blocks import RecordedBlock, record_autoround_blocks
from tests import mutants


def serial_run(rec: RecordedBlock, monkeypatch, restore: bool = True) -> tuple[dict, list[float], list[list[int]]]:
    """auto-round's own quantize_block on a fresh copy; returns best params, losses, indices.
    ``restore``: start from the recorded RNG state (else from the current one)."""
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
    if restore:
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


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these tiny blocks gain little from a second one, and on a shared 2-core
    box OpenMP spinning under load made this file ~2-3x slower (measured under load: 603 s with two
    threads, 206-246 s with one, the latter with 3 fewer mutant runs). Every
    comparison here is within one setting; conftest restores the thread count after each test."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def longer_blocks():
    torch.set_num_threads(1)  # runs before the per-test fixture; conftest resets it for each test
    # 30 iterations, 32 samples: enough steps for best-loss comparisons to mean something.
    return record_autoround_blocks(iters=30, nsamples=32, seqlen=64, batch_size=8)


# -- statistical parity at world >= 2 ------------------------------------------------------------
#
# The formula and its false-failure rate: dpqlab/parity_stats.py. Per (block, seed) pair, the paired
# relative difference d = (P - S) / S of two quantities of each run: its best loss (what auto-round
# keeps) and the mean of its per-iteration losses (the whole trajectory; far less noisy); the mean
# over n pairs is held to K * sqrt(2) * SPREAD / sqrt(n), K = Phi^-1(1 - 1e-3 / (2 * 2)) = 3.48 for
# the 2 statistics: a correct build fails a test with probability <= 1e-3.
# SPREAD: serial's own seed-to-seed spread, committed (measured: tests/parity_spread.py engine,
# seeds 0..7, python `random` and torch seeded with the seed before auto-round's own
# quantize_block, each block of `longer_blocks`: 2 blocks, 30 iters, 32 samples x 64 tokens,
# batch 8; torch 2.13 CPU, auto-round 0.16.1): best loss 1.17% / trajectory 0.238% (AMD EPYC,
# fp32: no AVX512-BF16), 1.11% / 0.262% (Xeon, bf16 autocast), on 6-8 seeds pooled over the 2
# blocks; the committed values are the larger of each. Paired d at world 2/4 measured: best loss
# mean within +-0.6%, stdev <= 1.4%; trajectory mean within +-0.11%, stdev <= 0.32% (at most
# sqrt(2) x serial's spread, as the bound assumes; under fp32 often exactly 0). The test
# re-measures serial's spread on its own seeds and requires it below 3x the committed value
# (test_serial_spread_matches_committed): a stale constant (another model, other settings) fails
# loudly, not as mis-sized bounds. With 4 pairs the bounds are 3.0% (best loss) and 0.64%
# (trajectory). Mutants at world 2 (tests/mutants.py; mean over pairs, both branches: see
# test_parity_bounds_catch_mutants): a lane weight of 1 moves both by ~+100%, a dropped lane
# gradient by +15% / +9.4%, a lane reading another lane's slice by +12% / +9.5% -- all far
# outside the one-pair bounds (6.0% / 1.29%) the mutant test applies.
SPREAD = {"best": 0.0117, "trajectory": 0.00262}
K = parity_stats.k_for(len(SPREAD))
PARITY_BLOCKS = (0, 1)
PARITY_SEEDS = (0, 1)
MUTANT_PAIR = (1, 0)  # (block, seed)


def _seeded(seed: int) -> None:
    random.seed(seed)  # auto-round's IndexSampler draws from python's random
    torch.manual_seed(seed)


def parity_bound(stat: str, n_pairs: int) -> float:
    return parity_stats.bound(SPREAD[stat], n_pairs, K)


@pytest.fixture(scope="module")
def serial_runs(longer_blocks):
    """Serial (auto-round's own quantize_block) losses and indices per (block, seed), shared."""
    cache = {}

    def get(block: int, seed: int):
        if (block, seed) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                rec = longer_blocks[block]
                _seeded(seed)
                _, losses, drawn = serial_run(rec, mp, restore=False)
            cache[block, seed] = (losses, drawn)
        return cache[block, seed]

    return get


def parity_check(longer_blocks, serial_runs, world: int, pairs) -> dict[str, tuple[float, float]]:
    """Run dpq at ``world`` on each (block, seed) pair; return {stat: (mean rel diff, bound)}."""
    rel: dict[str, list[float]] = {k: [] for k in SPREAD}
    for block, seed in pairs:
        s_losses, drawn = serial_runs(block, seed)
        _seeded(seed)
        result = longer_blocks[block].dpq_parallel_tune(longer_blocks[block].fresh_block(), ["cpu"] * world,
                                                         debug_identical=True)  # mirrors bitwise every step
        assert result.world == world
        assert result.indices == drawn  # the serial run's samples, every iteration
        s, p = parity_stats.loss_stats(s_losses), parity_stats.loss_stats(result.losses)
        for k in SPREAD:
            rel[k].append((p[k] - s[k]) / s[k])
    out = {k: (statistics.fmean(v), parity_bound(k, len(v))) for k, v in rel.items()}
    print(f"world {world}: " + "; ".join(f"{k} {m:+.3%} (bound {b:.3%}, per pair {[f'{x:+.2%}' for x in rel[k]]})"
                                         for k, (m, b) in out.items()))
    return out


def test_serial_spread_matches_committed(serial_runs):
    """The committed SPREAD still describes serial: re-measured on this test's seeds (2 seeds per
    block, nu = 2 degrees of freedom pooled over the blocks) and held below C = 3 x SPREAD. If SPREAD
    is right a statistic fails with P(chi2_2 > 2 C**2) = exp(-9) = 1.2e-4 (dpqlab/parity_stats.py),
    the test (2 statistics) with 2.5e-4. What it catches: a stale SPREAD far too small. One 10x
    too small fails a statistic when the measured spread reaches 0.3x the true one, with
    probability P(chi2_2 > 2 x 0.3**2) = exp(-0.09) = 91%."""
    for stat in SPREAD:
        measured, nu = parity_stats.pooled_relative_spread(
            [[parity_stats.loss_stats(serial_runs(block, seed)[0])[stat] for seed in PARITY_SEEDS]
             for block in PARITY_BLOCKS])
        print(f"serial {stat} spread: measured {measured:.3%} ({nu} dof), committed {SPREAD[stat]:.3%}; "
              f"P(false failure) {parity_stats.chi2_sf(nu * 9, nu):.1e}")
        assert measured < 3 * SPREAD[stat]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_world_n_statistical_parity(longer_blocks, serial_runs, world):
    pairs = [(b, s) for b in PARITY_BLOCKS for s in PARITY_SEEDS]
    for stat, (mean, bound) in parity_check(longer_blocks, serial_runs, world, pairs).items():
        assert abs(mean) <= bound, (stat, mean, bound)


@pytest.mark.parametrize("mutant", mutants.MUTANTS)
def test_parity_bounds_catch_mutants(longer_blocks, serial_runs, monkeypatch, mutant):
    """The statistical check is no rubber stamp: each bug makes it fail, on ONE pair (world 2:
    a lane is half the batch). One pair gives bounds twice as wide as the 4 pairs the parity test
    uses, so a mutant caught here is caught there too (its mean shift does not depend on n)."""
    mutants.apply(monkeypatch.setattr, mutant)
    out = parity_check(longer_blocks, serial_runs, 2, [MUTANT_PAIR])
    print(f"{mutant}: " + ", ".join(f"{k} {m:+.2%} vs bound {b:.2%}" for k, (m, b) in out.items()))
    assert any(abs(mean) > bound for mean, bound in out.values()), "the parity check passed a broken engine"


def test_tuned_names_cover_wrapper_params(recorded_blocks):
    from auto_round.wrapper import wrapper_block

    block = recorded_blocks[0].fresh_block()
    wrapper_block(block, True, False, enable_torch_compile=False, device="cpu")
    rounds, minmax, names = dp_tune.tuned_parameter_groups(block, lambda m: (0.1, 0.1))
    named = dict(block.named_parameters())
    for _, ps in list(rounds.items()) + list(minmax.items()):
        for p in ps:
            assert named[names[id(p)]] is p
