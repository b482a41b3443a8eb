"""auto-round integration: enable(), the plan's refusals, lane failures, and the real CLI."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpq.autoround import block_task, integration, patches
from dpq.autoround.seams_common import ParallelLaneError
from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
from dpq.planning.distributed import ProcessSet
from dpq.planning.plan import PlanRefused, PlanRequest, resolve
from dpqlab import parity_stats
from dpqlab.faults import inject_fault
from tests import mutants
from tests.conftest import SITE_HOOKS, cpu_bf16_expected


def quantize(world, devices=None, iters=6, fail_lane_at=None, return_model=False, auto_world=None, seed=42,
             **ar_kwargs):
    """Quantize the tiny Llama with AutoRound; returns (state_dict, block records, fp model)."""
    from auto_round import AutoRound

    model = build_tiny_llama(TinyLlamaConfig())
    fp = copy.deepcopy(model)
    integration.enable(world, devices, parallel_debug=world != "off", auto_world=auto_world)
    fault = inject_fault(block=fail_lane_at[0], after=fail_lane_at[1]) if fail_lane_at else None
    try:
        ar = AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(16, 64), device_map="cpu",
                       enable_torch_compile=False, iters=iters, nsamples=16, seqlen=64, batch_size=8, seed=seed,
                       **ar_kwargs)
        try:
            ar.quantize()
        finally:
            records = integration.run_summary()
    finally:
        integration.disable()
        if fault is not None:
            fault.remove()
    if return_model:
        return model, records, fp
    return model.state_dict(), records, fp


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def serial_state():
    return quantize("off")[0]


def test_world1_equals_plain_autoround(serial_state):
    state, records, _ = quantize(1)
    assert [r.world for r in records] == [1, 1]
    assert bitwise_equal(state, serial_state)


def _run_diffs(serial: list, parallel: list) -> dict[str, list[float]]:
    """{statistic: [paired relative difference]} per block record of one (serial, parallel) pair of
    in-process runs (dpqlab/parity_stats.py)."""
    out: dict[str, list[float]] = {}
    for s, p in zip(serial, parallel, strict=True):
        ss, ps = parity_stats.loss_stats(s.losses), parity_stats.loss_stats(p.losses)
        for stat in ss:
            out[f"{stat}:{s.name}"] = [parity_stats.rel(ps[stat], ss[stat])]
    return out


# World 4 through enable() (the CLI runs world 2, test_parity worlds 2-4 on the engine): one pair
# (seed 42, 20 iterations) of the tiny random Llama, statistics (dpqlab/parity_stats.py) each
# block's best loss and trajectory and the model's KL(fp || q) on held-out samples: m = 5, n = 1,
# K = Phi^-1(1 - 1e-3 / 10) = 3.72, bound 3.72 * sqrt(2) * MODEL_SPREAD: false failure <= 1e-3.
# MODEL_SPREAD: serial's seed-to-seed spread of this setting (tests/parity_spread.py model, 2
# blocks pooled for the losses), the larger of the two branches: best loss 1.35% (bf16 autocast,
# seeds 0..5, 10 dof) / 1.70% (fp32, seeds 0..4, 8 dof), trajectory 1.40% / 0.69%, KL 2.25% (5 dof)
# / 1.46% (4 dof), Xeon with AVX512-BF16, the fp32 branch forced. World 4's paired differences
# there (bf16, 6 seeds): stdev best 1.12%, trajectory 0.72%, KL 3.13% (at most sqrt(2) x the
# spread, as the bound assumes). Not re-measured here: one serial seed (re-measuring takes >= 3
# more serial runs, ~25 s of the README command; test_parity and the CLI test re-measure theirs).
# Before: each block's best loss within 2% and KL at most 2% above serial's, one pair, at worlds 2
# and 4: by this formula (d's stdev up to sqrt(2) x the spread) a correct build failed a best-loss
# bound with ~40% and the KL bound with ~25% probability (world 4's KL measured +5.7% in fp32).
# Mutant: world 4 with lane 1's gradient dropped, the same pair, must fail. Measured (seed 42):
# world 4 best +1.6% / -0.2%, trajectory +0.7% / +0.8%, KL +0.8% (bf16 autocast); best -1.9% /
# -1.3%, trajectory -0.8% / -0.8%, KL +5.7% (fp32); the mutant (fp32) best +7.7% / +19.0%,
# trajectory +4.0% / +15.2%: layer 1 outside its bounds (best 8.9%, trajectory 7.4%, KL 11.8%).
MODEL_SPREAD = {"best": 0.0170, "trajectory": 0.0140, "kl": 0.0225}
MODEL_WORLD, MODEL_MUTANT = 4, "lane 1 gradient dropped"


def _model_level_check(serial, parallel, fp) -> dict[str, tuple[float, float]]:
    from dpq.demo.metrics import kl_fp_quantized

    held_out = calibration_samples(4, 64, seed=99)
    (s_model, s_rec), (p_model, p_rec) = serial, parallel
    diffs = _run_diffs(s_rec, p_rec)
    diffs["kl"] = [parity_stats.rel(kl_fp_quantized(fp, p_model, held_out), kl_fp_quantized(fp, s_model, held_out))]
    return parity_stats.check(diffs, MODEL_SPREAD, parity_stats.k_for(len(diffs)))


def test_world4_statistical_parity_model_level(monkeypatch):
    world, devices = MODEL_WORLD, ",".join(["cpu"] * MODEL_WORLD)
    s_model, s_rec, fp = quantize(1, iters=20, return_model=True)
    p_model, p_rec, _ = quantize(world, devices, iters=20, return_model=True)
    assert [r.world for r in p_rec] == [world, world]
    assert all(r.wire_bytes > 0 for r in p_rec)
    result = _model_level_check((s_model, s_rec), (p_model, p_rec), fp)
    print(f"world {world}: {parity_stats.describe(result)}")
    assert not parity_stats.failures(result), parity_stats.failures(result)
    mutants.apply(monkeypatch.setattr, MODEL_MUTANT)
    m_model, m_rec, _ = quantize(world, devices, iters=20, return_model=True)
    caught = _model_level_check((s_model, s_rec), (m_model, m_rec), fp)
    print(f"mutant '{MODEL_MUTANT}': {parity_stats.describe(caught)}")
    assert parity_stats.failures(caught), "the parity check passed a broken engine"


ALGORITHMS = [  # (auto-round arguments, the quantizer class they select)
    ({"enable_alg_ext": True}, "SignRoundV2Quantizer"),
    ({"enable_adam": True}, "AdamRoundQuantizer"),
    ({"gradient_accumulate_steps": 2}, "SignRoundQuantizer"),  # accumulation inside each lane, sum loss
    ({"momentum": 0.9}, "SignRoundQuantizer"),  # stateful: full-value exchange
    ({"not_use_best_mse": True, "enable_quanted_input": False}, "SignRoundQuantizer"),
]
# World 2 of each algorithm, one pair (seed 42, 6 iterations), statistics (dpqlab/parity_stats.py)
# each block's best loss and trajectory: m = 4, n = 1, K = Phi^-1(1 - 1e-3 / 8) = 3.66, bound
# 3.66 * sqrt(2) * ALGORITHM_SPREAD[i]: false failure <= 1e-3 per algorithm. ALGORITHM_SPREAD[i]:
# the larger of serial's seed-to-seed spread (tests/parity_spread.py algs, 2 blocks pooled: 6
# dof) and the measured paired difference's rms / sqrt(2) (world 2 vs serial, same seeds), the
# larger over the two branches measured (bf16 autocast: seeds 0..3; fp32, forced: seeds 0..2). Why
# the paired term: with gradient accumulation every iteration takes the whole pool, so the seed
# only reorders it (serial spread 0.03%), and the assumption that parallel is no further from
# serial than another seed must be checked, not assumed. Measured, bf16 (spread best / trajectory;
# paired rms best / trajectory): SignRoundV2 0.79% / 0.85%; 0.19% / 0.17%. AdamRound 2.89% /
# 0.58%; 0.19% / 0.51%. Accumulation 0.033% / 0.105%; 0 / 0 (bitwise: each lane runs one of
# serial's micro-batches). Momentum 2.34% / 0.64%; 0.08% / 0.28%. not_use_best_mse 1.17% / 1.05%;
# 0 / 0.45%. fp32: accumulation 0.74% / 1.05%; 0 / 0; not_use_best_mse 1.38% / 0.36%; 0 /
# 0.32% (SignRoundV2, AdamRound, momentum: bf16's figures, fp32 not measured). Not re-measured
# here (one serial seed per algorithm). Before: each block's
# best loss within 2% of serial, one pair: by this formula (d's stdev up to sqrt(2) x the spread)
# a correct build failed it with 62% (AdamRound), 55% (momentum), 23% (not_use_best_mse), 7%
# (SignRoundV2) and ~0 (accumulation) probability per block; not_use_best_mse measured -2.0% in fp32.
# Mutant: test_algorithm_parity_catches_a_dropped_lane_gradient.
ALGORITHM_SPREAD = {
    0: {"best": 0.0079, "trajectory": 0.0085},
    1: {"best": 0.0289, "trajectory": 0.0058},
    2: {"best": 0.0074, "trajectory": 0.0105},
    3: {"best": 0.0234, "trajectory": 0.0064},
    4: {"best": 0.0138, "trajectory": 0.0105},
}


@pytest.fixture(scope="module")
def algorithm_runs():
    """In-process runs of ALGORITHMS[i] cached by (i, world, mutant): the mutant test reuses world 1."""
    cache: dict = {}

    def get(i: int, world, mutant: str = ""):
        if (i, world, mutant) not in cache:
            with pytest.MonkeyPatch.context() as mp:
                if mutant:
                    mutants.apply(mp.setattr, mutant)
                devices = ",".join(["cpu"] * world) if isinstance(world, int) and world > 1 else None
                cache[i, world, mutant] = quantize(world, devices, **ALGORITHMS[i][0])[:2]
        return cache[i, world, mutant]

    return get


def _algorithm_check(i: int, serial: list, parallel: list) -> dict[str, tuple[float, float]]:
    diffs = _run_diffs(serial, parallel)
    return parity_stats.check(diffs, ALGORITHM_SPREAD[i], parity_stats.k_for(len(diffs)))


@pytest.mark.parametrize("i", range(len(ALGORITHMS)), ids=[f"{q}-{a}" for a, q in ALGORITHMS])
def test_algorithms_and_loop_options_go_through_the_lane(algorithm_runs, i):
    quantizer = ALGORITHMS[i][1]
    serial, _ = algorithm_runs(i, "off")
    w1, rec1 = algorithm_runs(i, 1)
    assert [r.algorithm for r in rec1] == [quantizer] * 2 and [r.world for r in rec1] == [1, 1]
    assert bitwise_equal(w1, serial)  # world 1 through the engine == auto-round's own loop, bit for bit
    _, rec2 = algorithm_runs(i, 2)
    assert [r.world for r in rec2] == [2, 2] and rec2[0].algorithm == quantizer
    assert all(r.best_loss is not None for r in rec1 + rec2)
    result = _algorithm_check(i, rec1, rec2)
    print(f"{quantizer} {ALGORITHMS[i][0]}: {parity_stats.describe(result)}")
    assert not parity_stats.failures(result), parity_stats.failures(result)


ALGORITHM_MUTANT = (2, "lane 1 gradient dropped")  # accumulation: the smallest bounds


def test_algorithm_parity_catches_a_dropped_lane_gradient(algorithm_runs):
    """The per-algorithm check is no rubber stamp: lane 1's gradient dropped at world 2 fails it
    (the gradient-accumulation run: bounds 3.8% best, 5.4% trajectory).
    Measured (bf16 autocast, seed 42): best -0.0% / +38.1%, trajectory +10.1% / +18.4%."""
    i, mutant = ALGORITHM_MUTANT
    caught = _algorithm_check(i, algorithm_runs(i, 1)[1], algorithm_runs(i, 2, mutant)[1])
    print(f"{ALGORITHMS[i][1]} {ALGORITHMS[i][0]}, mutant '{mutant}': {parity_stats.describe(caught)}")
    assert parity_stats.failures(caught), "the parity check passed a broken engine"


def test_lane_failure_under_auto_reruns_serially_bitwise(serial_state):
    # auto on CPU defaults to one lane; give it two so the parallel path runs, then break lane 1
    state, records, _ = quantize("auto", "cpu,cpu", fail_lane_at=(1, 3))
    assert [r.world for r in records] == [2, 1]
    assert records[1].fell_back
    assert bitwise_equal(state, serial_state)  # block 1 was rerun from the same RNG state


def test_lane_failure_under_explicit_world_raises_and_loses_nothing():
    from auto_round import AutoRound

    model = build_tiny_llama(TinyLlamaConfig())
    fp_block1 = copy.deepcopy(model.model.layers[1])
    integration.enable(2, "cpu,cpu")
    fault = inject_fault(block=1, after=3)
    seen, attrs = {}, {}
    orig = integration._ORIGINAL

    try:
        ar = AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(16, 64), device_map="cpu",
                       enable_torch_compile=False, iters=6, nsamples=16, seqlen=64, batch_size=8, seed=42)
        real_parallel = integration._parallel_block

        def spy(cfg, q, plan, block, *a, **k):
            seen[a[-3].block_index] = {n: t.clone() for n, t in block.state_dict().items()}
            attrs[a[-3].block_index] = {n: set(m.__dict__) for n, m in block.named_modules()}
            return real_parallel(cfg, q, plan, block, *a, **k)

        integration._parallel_block = spy
        with pytest.raises(ParallelLaneError, match=r"lane failed while tuning model\.layers\.1"):
            ar.quantize()
    finally:
        integration._parallel_block = real_parallel
        integration.disable()
        fault.remove()
    assert integration._ORIGINAL is orig
    block1 = model.model.layers[1]
    assert not any(hasattr(m, "orig_layer") for m in block1.modules()), "wrappers removed"
    assert bitwise_equal(block1.state_dict(), seen[1]), "home block exactly as before the block started"
    # no attribute the wrappers set (e.g. WrapperLinear's ``iters`` on each original layer) stays behind
    assert {n: set(m.__dict__) for n, m in block1.named_modules()} == attrs[1]
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight.float(),
                           fp_block1.self_attn.q_proj.weight.float())


# -- refusals: each reason, checked by message; an explicit world refuses, auto falls back --

def _refusal(**kw) -> list[str]:
    with pytest.raises(PlanRefused) as e:
        resolve(PlanRequest(**kw))
    return e.value.reasons


def test_refusals_are_listed_together():
    reasons = _refusal(world=3, devices="cpu,cpu,cuda:99", samples_per_iter=1, home="cpu",
                       extra_reasons=["LFQ loss (--enable_lfq) ..."])
    assert any("LFQ" in r for r in reasons)
    assert any("cuda:99 does not exist" in r for r in reasons)
    assert any("every lane needs at least one sample" in r for r in reasons)


def test_refusal_mirror_does_not_fit(monkeypatch):
    from dpq import streams

    monkeypatch.setattr(streams.Backend, "mem_get_info", lambda self, d: (10 * 2**20, 2**40))
    reasons = _refusal(world=2, devices="cpu,cpu", home="cpu", mirror_bytes=2**30)
    assert any("a mirror needs ~1.00 GiB" in r and "Fix:" in r for r in reasons)
    plan = resolve(PlanRequest(world="auto", devices="cpu,cpu", home="cpu", mirror_bytes=2**30))
    assert plan.local_lanes == 1 and any("mirror needs" in r for r in plan.reasons)


def test_refusal_hpu_multi_lane(monkeypatch):
    from dpq import streams

    monkeypatch.setattr(streams, "check_device_exists", lambda d: None)
    import dpq.planning.lane_devices as lane_devices

    monkeypatch.setattr(lane_devices, "check_device_exists", lambda d: None)
    reasons = _refusal(world=2, devices="hpu:0,hpu:1", home="hpu:0")
    assert any("Gaudi's bridge allows one device per process" in r for r in reasons)


@pytest.mark.parametrize(
    "patch,expect",
    [
        ("dist", "group is initialised but dpq was not given it"),
        ("dict_pool", "not a flat list of tensors"),
        ("scaler", "gradient scaler is in use"),
        ("lfq", "LFQ loss"),
        ("split", "weights span 2 devices"),
    ],
)
def test_feature_refusals(recorded_blocks, monkeypatch, patch, expect):
    rec = recorded_blocks[0]
    q = copy.copy(rec.quantizer)
    block, inputs = rec.fresh_block(), list(rec.fp_inputs)
    if patch == "dist":
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a group of two, not given to dpq
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    if patch == "dict_pool":
        inputs = {"hidden_states": inputs}
    if patch == "scaler":
        monkeypatch.setattr(type(q), "_get_scaler", lambda self: object())
    if patch == "lfq":
        q.enable_lfq = True
    if patch == "split":
        p = next(block.parameters())
        monkeypatch.setattr(type(block), "parameters",
                            lambda self, recurse=True: iter([p, torch.nn.Parameter(torch.zeros(1, device="meta"))]))
    reasons = block_task.feature_refusals(q, block, inputs)
    assert any(expect in r for r in reasons), reasons
    if patch == "dist":  # the run was given the group: its tune spans the processes, nothing refused for it
        given = ProcessSet(rank=0, size=2, store=None)
        assert not any(expect in r for r in block_task.feature_refusals(q, block, inputs, given))
    with pytest.raises(PlanRefused, match=expect):
        resolve(PlanRequest(world=2, devices="cpu,cpu", home="cpu", extra_reasons=reasons))
    auto = resolve(PlanRequest(world="auto", devices="cpu,cpu", home="cpu", extra_reasons=reasons))
    assert auto.local_lanes == 1 and any(expect in r for r in auto.reasons)


def test_explicit_world_refuses_before_any_work():
    """4 lanes, 2 samples per iteration: refused at block 0, whose weights stay as loaded."""
    from auto_round import AutoRound

    model = build_tiny_llama(TinyLlamaConfig())
    before = {k: v.clone() for k, v in model.model.layers[0].state_dict().items()}
    integration.enable(4, "cpu,cpu,cpu,cpu")
    try:
        with pytest.raises(PlanRefused, match="every lane needs at least one sample"):
            AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(16, 64), device_map="cpu",
                      enable_torch_compile=False, iters=2, nsamples=16, seqlen=64, batch_size=2, seed=42).quantize()
    finally:
        integration.disable()
    after = model.model.layers[0].state_dict()
    # auto-round casts the model to bf16 before the blocks; nothing else may have touched block 0
    assert all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in before)
    assert not any(hasattr(m, "orig_layer") for m in model.model.layers[0].modules())


# -- the real CLI, in a subprocess, on the embedded (trained) model --

def _cli_cmd(tmp: Path, out: str, *extra: str, torch_compile: bool = False, iters: int | None = None) -> list[str]:
    """The CLI on the embedded model, ``iters`` iterations (None: CLI_ITERS); ``torch_compile``: no
    torch.compile flag, so auto-round's default (on, on Linux; tests/test_compile_cli.py), else
    ``--disable_torch_compile``."""
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    calib = tmp / "calib.jsonl"
    if not calib.exists():
        calibration_jsonl(calib, 32, 64)
    report = tmp / out / "report.json"
    return [sys.executable, "-m", "dpq.autoround.cli", "--model", str(DATA_DIR), "--dataset", str(calib),
            "--iters", str(CLI_ITERS if iters is None else iters), "--nsamples", "16", "--seqlen", "64",
            "--batch_size", "8", "--device_map", "cpu",
            *([] if torch_compile else ["--disable_torch_compile"]), "--output_dir", str(tmp / out),
            "--parallel_report", str(report), *extra]


# CLI runs go CLI_WORKERS at a time, each with CLI_THREADS intra-op threads: on the 2-core CI box two
# one-thread processes finish a batch of runs sooner than one two-thread process at a time (the tiny
# model's kernels do not scale to 2 threads). Every run in a comparison uses the same setting, so
# the bitwise and statistical checks compare like with like.
CLI_WORKERS = max(1, min(2, os.cpu_count() or 1))
CLI_ITERS = 20  # the statistics below are measured at this many iterations
CLI_THREADS = max(1, (os.cpu_count() or 1) // CLI_WORKERS)


def _cli_load(tmp: Path, out: str, proc: subprocess.CompletedProcess) -> dict:
    import json

    from safetensors.torch import load_file

    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted((tmp / out).rglob("*.safetensors"))
    assert files, f"no saved model under {tmp / out}"
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    report = tmp / out / "report.json"
    return {"state": state, "stdout": proc.stdout, "stderr": proc.stderr, "report": json.loads(report.read_text()),
            "dir": files[0].parent}


def _cli_many(tmp: Path, runs: dict[str, list[str]], envs: dict[str, dict] | None = None, *,
              torch_compile: bool = False, iters: int | None = None) -> dict[str, dict]:
    """Run ``{out: extra args}`` CLI jobs, CLI_WORKERS at a time, each with ``envs[out]`` added to
    its environment; returns ``{out: result}``."""
    from concurrent.futures import ThreadPoolExecutor  # threads only wait on the subprocesses

    env = dict(os.environ, OMP_NUM_THREADS=str(CLI_THREADS), MKL_NUM_THREADS=str(CLI_THREADS))
    cmds = {out: _cli_cmd(tmp, out, *extra, torch_compile=torch_compile, iters=iters) for out, extra in runs.items()}
    with ThreadPoolExecutor(CLI_WORKERS) as pool:
        procs = {out: pool.submit(subprocess.run, cmd, capture_output=True, text=True, timeout=600,
                                  env={**env, **(envs or {}).get(out, {})})
                 for out, cmd in cmds.items()}
        return {out: _cli_load(tmp, out, f.result()) for out, f in procs.items()}


def _cli(tmp: Path, out: str, *extra: str) -> dict:
    return _cli_many(tmp, {out: list(extra)})[out]


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


SEEDS = (42, 43, 44)


def cached_cli_runs(tmp: Path, *, torch_compile: bool = False, iters: int | None = None):
    """``get(*keys)``: CLI runs cached by (world, seed) or (world, seed, mutant), world "off"
    included; the missing ones run together and come back in order. A mutant (tests/mutants.py)
    runs in the CLI's process through ``DPQ_TEST_MUTANT`` (tests/site_hooks)."""
    cache: dict = {}

    def name(world, seed, mutant="") -> str:
        return f"w{world}s{seed}" + (f"m{mutants.MUTANTS.index(mutant)}" if mutant else "")

    def get(*keys: tuple) -> list[dict]:
        missing, envs = {}, {}
        for key in keys:
            if key not in cache:
                world, seed, *mutant = key
                extra = ["--seed", str(seed), "--parallel_quantization", str(world)]
                if world not in ("off", 1):
                    extra += ["--parallel_devices", ",".join(["cpu"] * world)]
                missing[name(*key)] = extra
                if mutant:
                    envs[name(*key)] = {SITE_HOOKS.MUTANT_ENV: mutant[0]}
        done = _cli_many(tmp, missing, envs, torch_compile=torch_compile, iters=iters) if missing else {}
        for key in keys:
            cache.setdefault(key, done.get(name(*key)))
        return [cache[k] for k in keys]

    return get


@pytest.fixture(scope="module")
def cli_runs(cli_tmp):
    """The CLI runs every test below shares (:func:`cached_cli_runs`; the serial runs serve the
    world-1 bitwise test and the quality test)."""
    return cached_cli_runs(cli_tmp)


AMP_OFF_LINE = "amp is set to FALSE as the current cpu device does not support the 'bf16' data type"


@pytest.mark.parity_subset
def test_cli_world1_saves_the_same_tensors_as_off(cli_runs):
    off, one = cli_runs(("off", 42), (1, 42))
    assert off["report"]["blocks"] == []  # off: auto-round alone, dpq recorded nothing
    assert [b["world"] for b in one["report"]["blocks"]] == [1, 1, 1, 1]
    assert bitwise_equal(off["state"], one["state"])
    # the CLI's process took the session's precision branch (DPQ_TEST_CPU_BF16 reaches subprocesses)
    assert all((AMP_OFF_LINE in r["stderr"]) is (not cpu_bf16_expected()) for r in (off, one))


# World 2 only through the CLI (6 runs of CLI_ITERS iterations, and one mutant): world 3 and 4 are
# held to statistical parity on real auto-round blocks in test_parity.py (same engine, same loss
# weights), and the CLI at world 4 is checked bitwise across layouts (1x4, 2x2, 4x1) in test_torchrun.py.
#
# Statistics (dpqlab/parity_stats.py): per seed, the paired relative differences of each of the 4
# blocks' best loss and trajectory (mean per-iteration loss, from the report) and of the saved
# model's KL(fp || q) on held-out text: m = 9 statistics, each a mean over the 3 SEEDS held to
# K * sqrt(2) * CLI_SPREAD / sqrt(3), K = Phi^-1(1 - 9e-4 / 18) = 3.89 (bounds: best loss 8.6%,
# trajectory 8.4%, KL 18.6%): false failure <= 9e-4. CLI_SPREAD: serial's relative seed-to-seed
# stdev in this test's settings (20 iterations: `tests/parity_spread.py cli --seeds 42-47 --worlds 2`,
# the 4 blocks pooled for the losses: 20 dof, KL 5; Xeon with AVX512-BF16, 2 cores, 2026-12-02), the
# larger of the two branches: best loss 2.70% / 2.66%, trajectory 2.62% / 2.64%, KL 5.24% / 3.26%
# (bf16 autocast / fp32, DPQ_TEST_CPU_BF16=off). Paired world-2 differences measured there: stdev
# best 1.84% / 1.24%, trajectory 1.66% / 1.08%, KL 8.29% / 4.34%. bf16 KL's paired stdev is above
# sqrt(2) x its serial spread (7.41%): at 20 iterations a split batch's bf16 rounding moves the
# 4-bit decisions like another seed does, so the KL spread used is that paired stdev / sqrt(2) =
# 5.86%, which the bound's Var d <= 2 sigma**2 then holds. Re-measured here on the 3 serial seeds
# (losses 8 dof, KL 2) and held below C x CLI_SPREAD, C = 2.1 / 3.25 for 1e-4 of false failure
# over the 3 spreads: the test's total <= 1e-3. Mutant: one more world-2 run at seed 42 with every
# lane's mean loss unweighted (tests/mutants.py "lane weight 1": the reported losses double) must
# fail its one pair against the one-pair bounds (sqrt(3) wider: best 14.9%, trajectory 14.5%). A
# dropped lane gradient (+9.5% on the trajectory in test_parity's setting) is not certain to clear a
# one-pair bound here: test_parity and the model-level test below show that one.
CLI_SPREAD = {"best": 0.0270, "trajectory": 0.0264, "kl": 0.0586}
CLI_PAIRS_ALPHA, CLI_SPREAD_ALPHA = 9e-4, 1e-4
CLI_MUTANT = "lane weight 1"


def _cli_diffs(pairs: list[tuple[dict, dict]]) -> dict[str, list[float]]:
    """{statistic: paired relative differences, one per (serial, parallel) pair of CLI runs}."""
    diffs: dict[str, list[float]] = {}
    for serial, run in pairs:
        for s, p in zip(serial["report"]["blocks"], run["report"]["blocks"], strict=True):
            ps, ss = parity_stats.loss_stats(p["losses"]), parity_stats.loss_stats(s["losses"])
            for stat in ss:
                diffs.setdefault(f"{stat}:{s['name']}", []).append(parity_stats.rel(ps[stat], ss[stat]))
        diffs.setdefault("kl", []).append(parity_stats.rel(run["kl"], serial["kl"]))
    return diffs


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.parity_subset)])
def test_cli_world_n_matches_serial_quality(cli_runs, world):
    """Per-block best losses and trajectories, and the saved models' KL(fp || q) on held-out
    text, paired with serial per seed and averaged over 3 seeds, within statistical parity (the
    bounds above; DESIGN.md's contract 1: statistical parity, not bits); serial's spread
    re-measured; a dropped lane gradient fails the same check."""
    from transformers import AutoModelForCausalLM

    from dpq.demo.embedded import heldout_samples, load_embedded_model
    from dpq.demo.metrics import kl_fp_quantized

    fp, tok = load_embedded_model(torch.float32)
    samples = heldout_samples(tok, 8, 64)
    keys = [(w, seed) for seed in SEEDS for w in (1, world)] + [(world, SEEDS[0], CLI_MUTANT)]
    runs = cli_runs(*keys)
    for r in runs:
        if "kl" not in r:  # each saved model's KL once: the serial ones serve every world
            q = AutoModelForCausalLM.from_pretrained(r["dir"], device_map="cpu", local_files_only=True).eval()
            r["kl"] = kl_fp_quantized(fp, q, samples)
    serial, parallel, mutant = runs[0:-1:2], runs[1:-1:2], runs[-1]
    for run in (*parallel, mutant):
        assert "dpq summary:" in run["stderr"]  # auto-round's logger (issue 29)
        assert "blocks per world: world 2: 4" in run["stderr"] and "fallbacks to serial: 0" in run["stderr"]
        assert "peak memory per lane device: cpu " in run["stderr"], run["stderr"][-3000:]
        assert [b["world"] for b in run["report"]["blocks"]] == [world] * 4

    diffs = _cli_diffs(list(zip(serial, parallel, strict=True)))
    k = parity_stats.k_for(len(diffs), CLI_PAIRS_ALPHA)
    result = parity_stats.check(diffs, CLI_SPREAD, k)
    print(f"CLI world {world}, K {k:.2f}: {parity_stats.describe(result)}")
    assert not parity_stats.failures(result), parity_stats.failures(result)

    for stat in CLI_SPREAD:
        groups = ([[r["kl"] for r in serial]] if stat == "kl" else
                  [[parity_stats.loss_stats(r["report"]["blocks"][i]["losses"])[stat] for r in serial]
                   for i in range(len(serial[0]["report"]["blocks"]))])
        measured, nu = parity_stats.pooled_relative_spread(groups)
        c = parity_stats.spread_ratio_bound(nu, CLI_SPREAD_ALPHA / len(CLI_SPREAD))
        print(f"serial {stat} spread: measured {measured:.3%} ({nu} dof), committed {CLI_SPREAD[stat]:.3%}, C {c}")
        assert measured < c * CLI_SPREAD[stat], (stat, measured, CLI_SPREAD[stat])

    caught = parity_stats.check(_cli_diffs([(serial[0], mutant)]), CLI_SPREAD, k)
    print(f"mutant '{CLI_MUTANT}': {parity_stats.describe(caught)}")
    assert parity_stats.failures(caught), "the parity check passed a broken engine"


def test_cli_rejects_bad_world(cli_tmp):
    proc = subprocess.run([sys.executable, "-m", "dpq.autoround.cli", "--parallel_quantization", "zero"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "world must be 'off', 'auto' or an integer >= 1" in proc.stderr


def test_multi_gpu_device_map_keeps_fitting_blocks_whole(recorded_blocks, monkeypatch):
    """--device_map 0,1 asks auto-round to split blocks; with dpq on, a block that fits stays whole on home."""
    rec = recorded_blocks[0]
    q = rec.quantizer
    calls = []
    monkeypatch.setattr(integration, "_auto_split_requested", lambda: True)
    monkeypatch.setattr(integration, "_ORIGINAL_DISPATCH", lambda self, b, i, o: calls.append("split") or b)
    block = rec.fresh_block()
    with integration.parallel_quantization("auto", "cpu,cpu"):  # the dispatch is handed the enabled run
        out = q.dispatch_block(block, list(rec.fp_inputs), rec.input_others)
        assert out is block and calls == [] and q._loss_device == integration.device_manager.device
        monkeypatch.setattr(integration, "backend_free", lambda d: 1024)  # does not fit: auto-round's split
        q.dispatch_block(block, list(rec.fp_inputs), rec.input_others)
        assert calls == ["split"]
    integration._whole_block_dispatch(None, q, block, list(rec.fp_inputs), rec.input_others)  # no run: auto-round's
    assert calls == ["split", "split"]


def test_refusal_unsupported_home_device_type():
    reasons = _refusal(world=2, devices="cpu,cpu", home="mps")
    assert any("home device type 'mps' is not supported" in r for r in reasons)
    auto = resolve(PlanRequest(world="auto", devices="cpu,cpu", home="mps"))
    assert auto.local_lanes == 1 and any("'mps' is not supported" in r for r in auto.reasons)


# -- issue 7: auto's dropped lanes in the records; enable()/disable() nest --

def test_auto_records_every_reason_a_lane_was_dropped():
    _, records, _ = quantize("auto", "cpu,cpu,cuda:99", iters=2)  # cuda:99 cannot exist anywhere
    assert [r.world for r in records] == [2, 2]
    assert all(any("cuda:99 does not exist" in x for x in r.reasons) for r in records), [r.reasons for r in records]
    # the default cost model does not choose for lanes sharing one device: every fitting lane ran, and it says so
    assert all(any("no speedup: these lanes share one CPU" in x and "Fix:" in x for x in r.reasons) for r in records)
    assert all(r.predicted_s == {} and r.measured_s is None for r in records)


# -- issue 10: 'auto' chooses the world by predicted time through enable() and the CLI's report --

@pytest.mark.parametrize("bandwidth_GBps,compute_s,world", [
    (2e-4, 1e-3, 1),  # a 200 KB/s link, 1 ms of compute: the exchange dominates, one lane
    (10.0, 100.0, 2),  # a fast link, 100 s of compute: both lanes
])
def test_auto_chooses_the_world_by_predicted_time(tmp_path, bandwidth_GBps, compute_s, world):
    import json

    from dpq.autoround.outputs import RunReport
    from dpq.planning.cost_model import AutoWorld
    from dpqlab.simulated_link import SimulatedLink

    links = []

    def wrap(comm):  # the run's communicator as the probe and the lanes see it (session._communicator)
        links.append(SimulatedLink(comm, bandwidth_GBps=bandwidth_GBps, latency_s=1e-4))
        return links[-1]

    auto = AutoWorld(compute_s=compute_s, probe_sizes=(2**10, 2**14), wrap=wrap)
    try:
        _, records, _ = quantize("auto", "cpu,cpu", iters=2, auto_world=auto)
    finally:
        for link in links:
            link.close()
    assert links, "the cost model probed the simulated link"
    assert [r.world for r in records] == [world, world]
    for r in records:
        assert any(x.startswith("auto: predicted") and f"world {world} is fastest" in x for x in r.reasons), r.reasons
        assert set(r.predicted_s) == {1, 2} and r.measured_s > 0
        assert min(r.predicted_s, key=r.predicted_s.get) == world
    path = tmp_path / "report.json"
    assert RunReport(str(path), "auto", "cpu,cpu").write(None) is None  # after disable(): the last run's
    body = json.loads(path.read_text())
    assert [b["predicted_s"] for b in body["blocks"]] == [{str(k): v for k, v in r.predicted_s.items()}
                                                          for r in records]
    assert [(a["block"], a["world"], a["measured_s"]) for a in body["auto_world"]] == \
        [(r.name, world, r.measured_s) for r in records]


def test_enable_nests_and_disable_restores_what_it_replaced():
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer as Q

    from dpq.autoround import shard_seams

    before = {n: Q.__dict__.get(n) for n in ("quantize_block", "dispatch_block")}
    with integration.parallel_quantization(2, "cpu,cpu") as outer:
        with integration.parallel_quantization("auto", "cpu,cpu"):
            assert patches.enabled_run().world == "auto"
        assert patches.ours(Q, "quantize_block") is integration._delegated_quantize_block and shard_seams.installed()
        assert patches.enabled_run().world == 2 and patches.enabled_run().records is outer
    assert {n: Q.__dict__.get(n) for n in before} == before and not shard_seams.installed()

    integration.enable(2, "cpu,cpu")
    ours = Q.quantize_block

    def theirs(self, *a, **k):  # someone else's patch, put over dpq's
        return ours(self, *a, **k)

    Q.quantize_block = theirs
    try:
        integration.disable()
        assert Q.__dict__["quantize_block"] is theirs  # not clobbered with the import-time method
    finally:
        Q.quantize_block = before["quantize_block"]
    with integration.parallel_quantization(2, "cpu,cpu"):  # taken off again: dpq patches afresh
        assert patches.ours(Q, "quantize_block") is integration._delegated_quantize_block
    assert Q.__dict__["quantize_block"] is before["quantize_block"]
