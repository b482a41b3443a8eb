"""One block's tune, per iteration: auto-round's serial loop vs dpq's engine at world 1 and 2.

    .venv/bin/python -m pytest benchmarks/bench_tune.py --benchmark-only

Not collected by the normal test run (testpaths = tests). The same real tiny-Llama block,
recorded from auto-round mid-run, is tuned for ``ITERS`` iterations by (a) auto-round's own
``SignRoundQuantizer.quantize_block``, (b) ``dpq.parallel_tune`` on one CPU lane and (c) on two
CPU lanes, in this one process. Each round gets a fresh copy of the block and the recorded
RNG state, so every run draws the same samples and does the same work. A round is a whole
block tune (wrap, ITERS iterations, unwrap), so ``extra_info["s_per_iter"]`` (median / ITERS)
includes each run's fixed per-block cost; ``benchmarks/report.py`` separates the two.

On CPU the two lanes share the machine's cores: world 2 measures the engine's overhead, not
a speedup.
"""

from __future__ import annotations

import pytest

from benchmarks import tune_cases

ITERS = 20
ROUNDS = 3
SERIAL = "serial"
_medians: dict[str, float] = {}

pytestmark = pytest.mark.benchmark(group=f"tune one block, {ITERS} iters (cpu)")


@pytest.fixture(scope="module")
def rec():
    return tune_cases.record_block("cpu", iters=ITERS)


def _record(benchmark, key: str) -> None:
    """Per-iteration seconds and the ratio to serial, into extra_info."""
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return
    median = stats.stats.median
    _medians[key] = median
    benchmark.extra_info["iters"] = ITERS
    benchmark.extra_info["s_per_iter"] = median / ITERS
    if SERIAL in _medians:
        benchmark.extra_info["ratio_vs_serial"] = median / _medians[SERIAL]


def test_serial_autoround(benchmark, rec):
    benchmark.pedantic(
        tune_cases.run_serial,
        setup=lambda: ((rec, tune_cases.fresh_block(rec, "cpu")), {}),
        rounds=ROUNDS,
        iterations=1,
        warmup_rounds=1,
    )
    benchmark.extra_info["runner"] = "auto-round SignRoundQuantizer.quantize_block"
    _record(benchmark, SERIAL)


@pytest.mark.parametrize("world", [1, 2])
def test_dpq_engine(benchmark, rec, world):
    devices = ["cpu"] * world
    result = benchmark.pedantic(
        tune_cases.run_dpq,
        setup=lambda: ((rec, tune_cases.fresh_block(rec, "cpu"), devices), {}),
        rounds=ROUNDS,
        iterations=1,
        warmup_rounds=1,
    )
    assert result.world == world and len(result.losses) == ITERS
    benchmark.extra_info.update(
        runner="dpq.parallel_tune",
        world=world,
        communicator=result.communicator,
        # the loop alone (mirrors set up, iterations run), without wrap/unwrap and teardown
        loop_s_per_iter_last_round=result.seconds / ITERS,
        wire_bytes_per_iter=result.wire_bytes // ITERS,
    )
    _record(benchmark, f"world{world}")
