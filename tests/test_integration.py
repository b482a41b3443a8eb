"""auto-round integration: enable(), the plan's refusals, lane failures, and the real CLI."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpq import session
from dpq.autoround import integration
from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
from dpq.plan import PlanRefused, PlanRequest, resolve


def quantize(world, devices=None, iters=6, fail_lane_at=None, return_model=False, auto_world=None, **ar_kwargs):
    """Quantize the tiny Llama with AutoRound; returns (state_dict, block records, fp model)."""
    from auto_round import AutoRound

    model = build_tiny_llama(TinyLlamaConfig())
    fp = copy.deepcopy(model)
    integration.enable(world, devices, debug_identical=True, auto_world=auto_world)
    fault = session.inject_fault(block=fail_lane_at[0], after=fail_lane_at[1]) if fail_lane_at else None
    try:
        ar = AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(16, 64), device_map="cpu",
                       enable_torch_compile=False, iters=iters, nsamples=16, seqlen=64, batch_size=8, seed=42,
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


@pytest.fixture(scope="module")
def serial_20():
    return quantize(1, iters=20, return_model=True)


@pytest.mark.parametrize("world", [2, 4])
def test_world_n_statistical_parity_model_level(serial_20, world):
    """Per-block best loss within 2% of serial and model KL(fp || q) no more than 2% above it."""
    from dpq.demo.metrics import kl_fp_quantized

    s_model, s_rec, fp = serial_20
    p_model, p_rec, _ = quantize(world, ",".join(["cpu"] * world), iters=20, return_model=True)
    assert [r.world for r in p_rec] == [world, world]
    assert all(r.wire_bytes > 0 for r in p_rec)
    for s, p in zip(s_rec, p_rec, strict=True):
        assert abs(p.best_loss - s.best_loss) / s.best_loss < 0.02, (s.name, s.best_loss, p.best_loss)
    held_out = calibration_samples(4, 64, seed=99)
    kl_s, kl_p = kl_fp_quantized(fp, s_model, held_out), kl_fp_quantized(fp, p_model, held_out)
    print(f"world {world}: KL serial {kl_s:.6e} parallel {kl_p:.6e} ({(kl_p - kl_s) / kl_s:+.2%}); best losses "
          + ", ".join(f"{s.best_loss:.4e}/{p.best_loss:.4e}" for s, p in zip(s_rec, p_rec, strict=True)))
    # One-sided: the parallel model must not be worse than serial by more than 2%. (Measured at
    # world 2 it came out 2.6% *better*; trajectories differ by rounding, not by quality.)
    assert kl_p <= kl_s * 1.02


@pytest.mark.parametrize(
    "alg,quantizer",
    [
        ({"enable_alg_ext": True}, "SignRoundV2Quantizer"),
        ({"enable_adam": True}, "AdamRoundQuantizer"),
        ({"gradient_accumulate_steps": 2}, "SignRoundQuantizer"),  # accumulation inside each lane, sum loss
        ({"momentum": 0.9}, "SignRoundQuantizer"),  # stateful: full-value exchange
        ({"not_use_best_mse": True, "enable_quanted_input": False}, "SignRoundQuantizer"),
    ],
)
def test_algorithms_and_loop_options_go_through_the_lane(alg, quantizer):
    serial, _, _ = quantize("off", **alg)
    w1, rec1, _ = quantize(1, **alg)
    assert [r.algorithm for r in rec1] == [quantizer] * 2 and [r.world for r in rec1] == [1, 1]
    assert bitwise_equal(w1, serial)  # world 1 through the engine == auto-round's own loop, bit for bit
    _, rec2, _ = quantize(2, "cpu,cpu", **alg)
    assert [r.world for r in rec2] == [2, 2] and rec2[0].algorithm == quantizer
    assert all(r.best_loss is not None for r in rec1 + rec2)
    for s, p in zip(rec1, rec2, strict=True):
        print(quantizer, s.name, s.best_loss, p.best_loss, (p.best_loss - s.best_loss) / s.best_loss)
        assert abs(p.best_loss - s.best_loss) / s.best_loss < 0.02, (s.name, s.best_loss, p.best_loss)


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
    fault = session.inject_fault(block=1, after=3)
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
        with pytest.raises(integration.ParallelLaneError, match=r"lane failed while tuning model\.layers\.1"):
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
    assert plan.world == 1 and any("mirror needs" in r for r in plan.reasons)


def test_refusal_hpu_multi_lane(monkeypatch):
    from dpq import streams

    monkeypatch.setattr(streams, "check_device_exists", lambda d: None)
    import dpq.plan as plan_mod

    monkeypatch.setattr(plan_mod, "check_device_exists", lambda d: None)
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
    reasons = integration._feature_refusals(q, block, inputs, rec.block_ctx)
    assert any(expect in r for r in reasons), reasons
    with pytest.raises(PlanRefused, match=expect):
        resolve(PlanRequest(world=2, devices="cpu,cpu", home="cpu", extra_reasons=reasons))
    auto = resolve(PlanRequest(world="auto", devices="cpu,cpu", home="cpu", extra_reasons=reasons))
    assert auto.world == 1 and any(expect in r for r in auto.reasons)


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

def _cli_cmd(tmp: Path, out: str, *extra: str) -> list[str]:
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    calib = tmp / "calib.jsonl"
    if not calib.exists():
        calibration_jsonl(calib, 32, 64)
    report = tmp / out / "report.json"
    return [sys.executable, "-m", "dpq.autoround.cli", "--model", str(DATA_DIR), "--dataset", str(calib),
            "--iters", "50", "--nsamples", "16", "--seqlen", "64", "--batch_size", "8", "--device_map", "cpu",
            "--disable_torch_compile", "--output_dir", str(tmp / out), "--parallel_report", str(report), *extra]


# CLI runs go CLI_WORKERS at a time, each with CLI_THREADS intra-op threads: on the 2-core CI box two
# one-thread processes finish a batch of runs sooner than one two-thread process at a time (the tiny
# model's kernels do not scale to 2 threads). Every run in a comparison uses the same setting, so
# the bitwise and statistical checks compare like with like.
CLI_WORKERS = max(1, min(2, os.cpu_count() or 1))
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
    return {"state": state, "stdout": proc.stdout, "report": json.loads(report.read_text()),
            "dir": files[0].parent}


def _cli_many(tmp: Path, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Run ``{out: extra args}`` CLI jobs, CLI_WORKERS at a time; returns ``{out: result}``."""
    from concurrent.futures import ThreadPoolExecutor  # threads only wait on the subprocesses

    env = dict(os.environ, OMP_NUM_THREADS=str(CLI_THREADS), MKL_NUM_THREADS=str(CLI_THREADS))
    cmds = {out: _cli_cmd(tmp, out, *extra) for out, extra in runs.items()}
    with ThreadPoolExecutor(CLI_WORKERS) as pool:
        procs = {out: pool.submit(subprocess.run, cmd, capture_output=True, text=True, timeout=600, env=env)
                 for out, cmd in cmds.items()}
        return {out: _cli_load(tmp, out, f.result()) for out, f in procs.items()}


def _cli(tmp: Path, out: str, *extra: str) -> dict:
    return _cli_many(tmp, {out: list(extra)})[out]


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


SEEDS = (42, 43, 44)


@pytest.fixture(scope="module")
def cli_runs(cli_tmp):
    """CLI runs cached by (world, seed), world "off" included: every test below shares them (the
    serial runs serve the world-1 bitwise test and both quality tests). ``get(*keys)`` runs the
    missing ones together and returns them in order."""
    cache: dict = {}

    def name(world, seed) -> str:
        return f"w{world}s{seed}"

    def get(*keys: tuple) -> list[dict]:
        missing = {}
        for world, seed in keys:
            if (world, seed) not in cache:
                extra = ["--seed", str(seed), "--parallel_quantization", str(world)]
                if world not in ("off", 1):
                    extra += ["--parallel_devices", ",".join(["cpu"] * world)]
                missing[name(world, seed)] = extra
        done = _cli_many(cli_tmp, missing) if missing else {}
        for world, seed in keys:
            cache.setdefault((world, seed), done.get(name(world, seed)))
        return [cache[k] for k in keys]

    return get


@pytest.mark.parity_subset
def test_cli_world1_saves_the_same_tensors_as_off(cli_runs):
    off, one = cli_runs(("off", 42), (1, 42))
    assert off["report"]["blocks"] == []  # off: auto-round alone, dpq recorded nothing
    assert [b["world"] for b in one["report"]["blocks"]] == [1, 1, 1, 1]
    assert bitwise_equal(off["state"], one["state"])


# World 2 only through the CLI (6 runs of 50 iterations): world 3 and 4 are held to statistical
# parity on real auto-round blocks in test_parity.py (same engine, same loss weights), and the
# CLI at world 4 is checked bitwise across layouts (1x4, 2x2, 4x1) in test_torchrun.py. A world-4
# row here cost ~90 s of the README's test command on 2 cores for no path the others miss.
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.parity_subset)])
def test_cli_world_n_matches_serial_quality(cli_runs, world):
    """Per-block best losses and the saved models' KL(fp || q) on held-out text within 2% of
    serial, each averaged over 3 seeds. One seed is not enough: on this model serial's own
    seed-to-seed spread measured 3.3% (KL, stdev over 5 seeds), and a single seed's per-block
    best loss moved by up to 3.4% between serial and world 2 (parallel lower) while the 3-seed
    means agree to about 1%. DESIGN.md's contract 1: statistical parity, not bits."""
    from transformers import AutoModelForCausalLM

    from dpq.demo.embedded import heldout_samples, load_embedded_model
    from dpq.demo.metrics import kl_fp_quantized

    fp, tok = load_embedded_model(torch.float32)
    samples = heldout_samples(tok, 8, 64)
    runs = cli_runs(*[(w, seed) for seed in SEEDS for w in (1, world)])
    kls: dict[int, list[float]] = {1: [], world: []}
    rel_by_block: dict[str, list[float]] = {}
    for serial, run in zip(runs[0::2], runs[1::2], strict=True):
        assert "dpq summary:" in run["stdout"]
        blocks = run["report"]["blocks"]
        assert [b["world"] for b in blocks] == [world] * 4
        for s, p in zip(serial["report"]["blocks"], blocks, strict=True):
            rel_by_block.setdefault(s["name"], []).append((p["best_loss"] - s["best_loss"]) / s["best_loss"])
        for w, r in ((1, serial), (world, run)):
            if "kl" not in r:  # each saved model's KL once: the serial ones serve both worlds
                q = AutoModelForCausalLM.from_pretrained(r["dir"], device_map="cpu", local_files_only=True).eval()
                r["kl"] = kl_fp_quantized(fp, q, samples)
            kls[w].append(r["kl"])
    for name, rels in rel_by_block.items():
        print(f"world {world} {name}: best loss vs serial per seed {[f'{r:+.2%}' for r in rels]}, "
              f"mean {sum(rels) / len(rels):+.2%}")
        assert abs(sum(rels) / len(rels)) < 0.02, (name, rels)
    kl_s, kl_p = sum(kls[1]) / len(SEEDS), sum(kls[world]) / len(SEEDS)
    print(f"CLI world {world}: mean KL serial {kl_s:.6f} parallel {kl_p:.6f} ({(kl_p - kl_s) / kl_s:+.2%}); "
          f"per seed serial {kls[1]} parallel {kls[world]}")
    assert abs(kl_p - kl_s) / kl_s < 0.02


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
    with integration.parallel_quantization("auto", "cpu,cpu"):  # the dispatch reads the enabled config
        out = integration._whole_block_dispatch(q, block, list(rec.fp_inputs), rec.input_others)
        assert out is block and calls == [] and q._loss_device == integration.device_manager.device
        monkeypatch.setattr(integration, "backend_free", lambda d: 1024)  # does not fit: auto-round's split
        integration._whole_block_dispatch(q, block, list(rec.fp_inputs), rec.input_others)
        assert calls == ["split"]
    integration._whole_block_dispatch(q, block, list(rec.fp_inputs), rec.input_others)  # not enabled: auto-round's
    assert calls == ["split", "split"]


def test_refusal_unsupported_home_device_type():
    reasons = _refusal(world=2, devices="cpu,cpu", home="mps")
    assert any("home device type 'mps' is not supported" in r for r in reasons)
    auto = resolve(PlanRequest(world="auto", devices="cpu,cpu", home="mps"))
    assert auto.world == 1 and any("'mps' is not supported" in r for r in auto.reasons)


# -- issue 7: auto's dropped lanes in the records; enable()/disable() nest --

def test_auto_records_every_reason_a_lane_was_dropped():
    _, records, _ = quantize("auto", "cpu,cpu,cuda:99", iters=2)  # cuda:99 cannot exist anywhere
    assert [r.world for r in records] == [2, 2]
    assert all(any("cuda:99 does not exist" in x for x in r.reasons) for r in records), [r.reasons for r in records]
    # the default cost model does not choose for lanes sharing one device: every fitting lane ran, and it says so
    assert all(any("share cpu" in x and "Fix:" in x for x in r.reasons) for r in records)
    assert all(r.predicted_s == {} and r.measured_s is None for r in records)


# -- issue 10: 'auto' chooses the world by predicted time through enable() and the CLI's report --

@pytest.mark.parametrize("bandwidth_GBps,compute_s,world", [
    (2e-4, 1e-3, 1),  # a 200 KB/s link, 1 ms of compute: the exchange dominates, one lane
    (10.0, 100.0, 2),  # a fast link, 100 s of compute: both lanes
])
def test_auto_chooses_the_world_by_predicted_time(tmp_path, bandwidth_GBps, compute_s, world):
    import json

    from dpq.autoround import cli
    from dpq.cost_model import AutoWorld
    from dpq.simulated_link import SimulatedLink

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
    cli.write_report(str(path), "auto", "cpu,cpu", integration.run_summary(), {})  # after disable(): the last run's
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
            assert integration._current().world == "auto"
        assert Q.quantize_block is integration._delegated_quantize_block and shard_seams.installed()
        assert integration._current().world == 2 and integration._current().records is outer
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
        assert Q.quantize_block is integration._delegated_quantize_block
    assert Q.__dict__["quantize_block"] is before["quantize_block"]
