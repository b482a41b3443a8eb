"""Sharded no-grad phases: dpq.sharded.shard's helpers, and auto-round's collection / search seams.

Serial here means plain auto-round (no dpq). The sharded runs install the seams with world 2 on
two CPU lanes; unless a test says otherwise the tuner itself runs serially (auto-round's own
quantize_block), so every difference from serial would come from the sharded phases alone.

Tolerances: collection forwards split on batch boundaries (the same batches serial forms), so
outputs, quantized-input chains, act-max statistics, searches and saved tensors are compared
bitwise. Partial sums (imatrix, sums of squares) are held to the fp32 reassociation bound of a sum
of non-negative terms (tests/numerics.py: 2 (n - 1) u |sum| for n batch partials folded in two
orders) where a lane folds more than one batch, and bitwise where each lane holds one batch. Only the explicit
unaligned-split test changes batch composition: under bf16 autocast its outputs are held to
bf16 rounding (max abs diff <= 2 bf16 ulps of the output magnitude), not bits.
"""

from __future__ import annotations

import copy
import gc
import os
from types import SimpleNamespace

import pytest
import torch

from dpq.engine.split import contiguous_ranges
from dpq.sharded import shard
from dpq.streams import make_lanes
from tests.conftest import cast_floating
from tests.numerics import assert_reassociated_nonneg_sum


@pytest.fixture(autouse=True)
def fast_cpu(monkeypatch):
    """One intra-op thread (the 2-core CI box is shared; OpenMP spinning under load costs 100x) and
    no full gc.collect() per auto-round block (auto-round calls it ~7 times a block, ~0.2 s each,
    with torch loaded; collecting frees memory and changes no result). Per test: conftest's
    autouse fixture puts the thread count back after each test."""
    torch.set_num_threads(1)
    monkeypatch.setattr(gc, "collect", lambda *a, **k: 0)


def lanes(n: int):
    return make_lanes(["cpu"] * n)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- dpq.sharded.shard, no auto-round ---------------------------------------------------------------

def test_contiguous_ranges():
    assert contiguous_ranges(16, 2, 8) == [(0, 8), (8, 16)]
    assert contiguous_ranges(16, 3, 8) == [(0, 8), (8, 16), (16, 16)]  # 2 batches: lane 2 idle
    assert contiguous_ranges(20, 2, 8) == [(0, 16), (16, 20)]  # 3 batches: 2 + 1
    assert contiguous_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    for n in range(0, 30):
        for world in range(1, 5):
            for align in (1, 2, 3, 8):
                r = contiguous_ranges(n, world, align)
                assert r[0][0] == 0 and r[-1][1] == n and all(r[k][1] == r[k + 1][0] for k in range(world - 1))
                assert all(a % align == 0 for a, b in r if a < b)
                units = [-(-(b - a) // align) for a, b in r]
                assert max(units) - min(units) <= 1
    with pytest.raises(ValueError):
        contiguous_ranges(4, 0)


def test_shard_forward_returns_sample_order():
    samples = [torch.full((1, 3), float(i)) for i in range(11)]
    seen = []

    def fwd(module, lane, start, stop):
        seen.append((lane.index, start, stop))
        return [module(s) for s in samples[start:stop]]

    mods = [torch.nn.Identity() for _ in range(3)]
    out = shard.shard_forward(mods, lanes(3), len(samples), fwd, align=2)
    assert seen == [(0, 0, 4), (1, 4, 8), (2, 8, 11)]
    assert [int(t[0, 0]) for t in out] == list(range(11))
    with pytest.raises(RuntimeError, match="returned 1 results"):
        shard.shard_forward(mods, lanes(3), 11, lambda m, lane, a, b: [samples[a]])


def test_merge_rules():
    g = torch.Generator().manual_seed(0)
    parts = [torch.rand(64, generator=g) * 10 for _ in range(6)]
    serial_max, serial_sum = parts[0].clone(), parts[0].clone()
    for p in parts[1:]:
        serial_max = torch.maximum(serial_max, p)
        serial_sum += p
    lane_max = [torch.stack(parts[:3]).amax(0), torch.stack(parts[3:]).amax(0)]
    lane_sum = [parts[0] + parts[1] + parts[2], parts[3] + parts[4] + parts[5]]
    kinds = {"m": "max", "s": "sum", "n": "count"}
    merged = shard.merge_stats({"m": lane_max[0], "s": lane_sum[0], "n": 3}, [{"m": lane_max[1], "s": lane_sum[1],
                                                                              "n": 3}], kinds)
    assert bitwise(merged["m"], serial_max)  # maxima: exact
    assert_reassociated_nonneg_sum(merged["s"], serial_sum, len(parts))  # sums: fp32 reassociation
    assert merged["n"] == 6
    # home saw nothing for a key: the first lane's value is taken
    assert shard.merge_stats({}, [{"n": 2}, {"n": 5}], kinds) == {"n": 7}
    with pytest.raises(ValueError, match="no merge rule"):
        shard.merge_stats({"q": 1}, [], kinds)
    with pytest.raises(ValueError, match="unknown merge kinds"):
        shard.merge_stats({}, [], {"q": "mean"})


class _StatBlock(torch.nn.Module):
    """Two linears whose forward hooks keep a running max, sum and count (auto-round's pattern)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        for m in (self.a, self.b):
            m.register_forward_hook(_stat_hook)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _stat_hook(module, args, output):
    x = args[0].reshape(-1, args[0].shape[-1]).float()
    if not hasattr(module, "mx"):
        module.mx, module.sq, module.cnt = x.abs().amax(0), (x * x).sum(0), x.shape[0]
        return
    module.mx = torch.maximum(module.mx, x.abs().amax(0))
    module.sq += (x * x).sum(0)
    module.cnt += x.shape[0]


SPEC = {"a": {"mx": "max", "sq": "sum", "cnt": "count"}, "b": {"mx": "max", "sq": "sum", "cnt": "count"}}


def _batched(module, samples, start, stop, bs):
    outs = []
    for i in range(start, stop, bs):
        outs.extend(module(torch.cat(samples[i:min(i + bs, stop)])).split(1))
    return outs


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_collection_merges_stats(world):
    g = torch.Generator().manual_seed(1)
    samples = [torch.randn(1, 5, 8, generator=g) for _ in range(24)]
    serial_block, block = _StatBlock(), _StatBlock()
    with torch.no_grad():
        serial = _batched(serial_block, samples, 0, len(samples), 4)
        out = shard.sharded_collection(block, lanes(world), len(samples),
                                       lambda m, lane, a, b: _batched(m, samples, a, b, 4), SPEC, align=4)
    assert all(bitwise(x, y) for x, y in zip(out, serial, strict=True))
    for name in ("a", "b"):
        s, p = serial_block.get_submodule(name), block.get_submodule(name)
        assert bitwise(p.mx, s.mx) and p.cnt == s.cnt == 24 * 5
        # per-batch sums are serial's bitwise (same batches); the 24 / 4 = 6 batch sums fold in another order
        assert_reassociated_nonneg_sum(p.sq, s.sq, len(samples) // 4)
    # mirrors are gone and carried no statistics back into home beyond the merge
    assert not any(hasattr(m, "mx") for m in block.modules() if m not in (block.a, block.b))


def test_sharded_collection_failure_restores_home_stats():
    g = torch.Generator().manual_seed(2)
    samples = [torch.randn(1, 5, 8, generator=g) for _ in range(8)]
    block = _StatBlock()
    with torch.no_grad():
        _batched(block, samples, 0, 8, 4)  # an earlier pass left statistics behind
    before = shard.snapshot_module_stats(block, SPEC)

    def fwd(m, lane, a, b):
        if lane.index == 1:
            raise RuntimeError("lane 1 died")
        return _batched(m, samples, a, b, 4)

    with torch.no_grad(), pytest.raises(RuntimeError, match="lane 1 died"):
        shard.sharded_collection(block, lanes(2), 8, fwd, SPEC, align=4)
    after = shard.read_module_stats(block, SPEC)
    for name in SPEC:
        assert bitwise(after[name]["mx"], before[name]["mx"]) and bitwise(after[name]["sq"], before[name]["sq"])
        assert after[name]["cnt"] == before[name]["cnt"]


def test_assign_and_map_over_lanes():
    assert shard.assign_items(5, 2) == [0, 1, 0, 1, 0]
    # longest first onto the least-loaded lane: 8 -> 0, 5 -> 1, 4 -> 1, 3 -> 0, 1 -> 1
    assert shard.assign_items(5, 2, [3, 8, 1, 5, 4]) == [0, 0, 1, 1, 1]
    calls = []

    def fn(item, lane):
        calls.append((item, lane.index))
        return item * 10

    res = shard.map_over_lanes([1, 2, 3, 4], lanes(2), fn, collect=lambda item, r, lane: (r, lane.index))
    assert res == [(10, 0), (20, 1), (30, 0), (40, 1)]
    assert sorted(calls) == [(1, 0), (2, 1), (3, 0), (4, 1)]  # each item exactly once


def test_copy_to_lane_and_bring_home():
    ls = lanes(2)
    home = torch.nn.Linear(4, 3)
    home.scale = torch.ones(3)
    home.stale = "gone after the search"
    weight = home.weight
    lane_copy = shard.copy_to_lane(home, ls[0], ls[1])
    assert lane_copy.weight.data_ptr() != home.weight.data_ptr()  # private storage: the search writes it
    with torch.no_grad():
        lane_copy.weight.mul_(2)
    lane_copy.scale = torch.full((3,), 0.5)
    lane_copy.zp = None
    del lane_copy.stale
    expected = weight.detach().clone() * 2
    out = shard.bring_home(lane_copy, lane_copy, home, lane_device="cpu", home_device="cpu")
    assert out is home and home.weight is weight and bitwise(home.weight.detach(), expected)
    assert bitwise(home.scale, torch.full((3,), 0.5)) and home.zp is None and not hasattr(home, "stale")

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.orig_layer = inner
            self.extra = torch.zeros(2)

    wrapped = shard.bring_home(Wrap(lane_copy), lane_copy, home, lane_device="cpu", home_device="cpu")
    assert wrapped.orig_layer is home and bitwise(wrapped.extra, torch.zeros(2))


# -- auto-round: collection seams ----------------------------------------------------------------------

def _run(world=None, *, tune_world=None, record=None, save_dir=None, faults=None, **kw):
    """Quantize the tiny Llama with auto-round; ``world`` installs the shard seams (None: plain
    auto-round), ``tune_world`` also enables dpq's tuner. Returns (state_dict, seam records)."""
    from auto_round import AutoRound

    from dpq.autoround import integration, seams_common, shard_seams
    from dpq.autoround.run import Run
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpq.planning.spec import ParallelSpec
    from dpqlab.faults import inject_fault

    args = dict(nsamples=16, seqlen=64, batch_size=8, iters=0)
    injected = [inject_fault(kind=kind, lane=lane) for kind, lane in (faults or {}).items()]
    args.update(kw)
    model = build_tiny_llama(TinyLlamaConfig())
    if tune_world is not None:
        integration.enable(tune_world, "cpu,cpu")
    if world is not None:
        shard_seams.install(Run(ParallelSpec(world, "cpu,cpu"), seams_only=True))
    try:
        dataset = calibration_samples(args["nsamples"], args["seqlen"])
        ar = AutoRound(model, tokenizer=build_tokenizer(), dataset=dataset, device_map="cpu",
                       enable_torch_compile=False, seed=42, **args)
        if save_dir is not None:
            ar.quantize_and_save(str(save_dir), format="auto_round")
        else:
            ar.quantize()
    finally:
        for fault in injected:
            if fault.calls <= fault.after:  # did not fire: keep the caller's dict saying so
                fault.remove()
            elif faults is not None:
                faults.pop(fault.kind, None)  # fired (once)
        recs = seams_common.records() if world is not None else []
        if world is not None:
            shard_seams.uninstall()
        if tune_world is not None:
            integration.disable()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, recs


@pytest.fixture()
def recorder(monkeypatch):
    """Record what each block's quantize_block receives, plus the layers' act_max / imatrix then."""
    from auto_round.algorithms.quantization.rtn.quantizer import OptimizedRTNQuantizer
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    calls = []

    def wrap(cls):
        orig = cls.quantize_block

        def recording(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, *a, **k):
            stats = {n: {s: copy.deepcopy(getattr(m, s)) for s in ("act_max", "imatrix", "imatrix_cnt")
                         if hasattr(m, s)} for n, m in block.named_modules()}
            calls.append(SimpleNamespace(inputs=list(fp_inputs or []), outputs=list(fp_outputs or []),
                                         q_inputs=list(q_inputs) if q_inputs is not None else None,
                                         stats={n: s for n, s in stats.items() if s}))
            return orig(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, *a, **k)

        monkeypatch.setattr(cls, "quantize_block", recording)

    wrap(SignRoundQuantizer)
    wrap(OptimizedRTNQuantizer)
    return calls


def _same_lists(a, b) -> bool:
    return len(a) == len(b) and all(bitwise(x, y) for x, y in zip(a, b, strict=True))


def _stats_equal(sa, sb, key, *, exact=True, n_terms=None):
    assert sa.keys() == sb.keys()
    n = 0
    for name in sa:
        if key in sa[name]:
            n += 1
            if not isinstance(sa[name][key], torch.Tensor):
                assert sa[name][key] == sb[name][key], (name, key)
            elif exact:
                assert bitwise(sa[name][key], sb[name][key]), (name, key)
            else:
                assert_reassociated_nonneg_sum(sb[name][key], sa[name][key], n_terms)
    return n


STATIC_ACT = dict(iters=2, act_bits=8, act_dynamic=False, act_data_type="int")


def test_collection_world2_bitwise_with_act_max(recorder):
    """SignRound with static int8 activations: the fp reference pass, the act-max pass on the
    quantized-input chain and the chain forward all run on 2 lanes; outputs (in sample order),
    the chain fed to block 1, the merged act_max and the tuned model are bitwise serial's."""
    serial_state, _ = _run(None, **STATIC_ACT)
    serial = list(recorder)
    recorder.clear()
    state, recs = _run(2, **STATIC_ACT)
    assert len(serial) == len(recorder) == 2
    for s, p in zip(serial, recorder, strict=True):
        assert _same_lists(s.inputs, p.inputs) and _same_lists(s.outputs, p.outputs)
        assert (s.q_inputs is None) == (p.q_inputs is None) and _same_lists(s.q_inputs or [], p.q_inputs or [])
        assert _stats_equal(s.stats, p.stats, "act_max") == 7  # every linear of the block, max-merged
    assert serial[1].q_inputs is not None  # block 1 consumed the sharded quantized-input chain
    assert serial_state.keys() == state.keys() and all(bitwise(serial_state[k], state[k]) for k in state)
    coll = [r for r in recs if r.phase == "collection"]
    assert len(coll) == 6 and all(r.world == 2 for r in coll)  # reference, act-max q pass, chain; x2 blocks
    assert sum("act_max:max" in r.detail for r in coll) == 2


@pytest.mark.parametrize("batch_size,exact", [(8, True), (2, False)])
def test_imatrix_sums_merge(recorder, batch_size, exact):
    """Optimized RTN (auto-round's iters=0 default) collects imatrix (sum) and imatrix_cnt (count).
    One batch per lane: the fold is serial's order, bitwise. Four batches per lane: the 8 batch
    sums (of squares: non-negative) fold in another order, held to the fp32 reassociation bound
    2 * 7 * 2**-24 * |sum| (tests/numerics.py). Counts are exact; the reference outputs bitwise."""
    serial_state, _ = _run(None, batch_size=batch_size)
    serial = list(recorder)
    recorder.clear()
    state, recs = _run(2, batch_size=batch_size)
    for s, p in zip(serial, recorder, strict=True):
        assert _same_lists(s.outputs, p.outputs)
        assert _stats_equal(s.stats, p.stats, "imatrix", exact=exact, n_terms=16 // batch_size) == 7
        assert _stats_equal(s.stats, p.stats, "imatrix_cnt") == 7
    assert any(r.phase == "collection" and r.world == 2 and "imatrix:sum" in r.detail for r in recs)
    if exact:
        assert all(bitwise(serial_state[k], state[k]) for k in state)


@pytest.mark.explicit_bf16
def test_unaligned_split_changes_batches_bf16_tolerance(recorded_blocks):
    """The seams split on batch boundaries so every lane forms exactly serial's batches. A split
    that forms other batches is held here to bf16 rounding only (2 ulps of the output magnitude):
    on this CPU backend the block forward happens to be row-independent (measured: bitwise even
    unaligned), but a GPU BLAS may pick another kernel for another batch size. The case is built
    in bf16 explicitly (the block and its inputs in bf16, auto-round's block forward under bf16
    autocast), whichever branch auto-round chose for this CPU."""
    rec = recorded_blocks[0]
    block = rec.fresh_block().to(torch.bfloat16)
    runner = copy.copy(rec.quantizer.block_forward)
    runner.amp, runner.amp_dtype = True, torch.bfloat16
    inputs, others = cast_floating(rec.fp_inputs, torch.bfloat16), cast_floating(rec.input_others, torch.bfloat16)
    assert runner.batch_size == 8 and len(inputs) == 16
    with torch.no_grad():
        serial = runner(block, inputs, others)

        def fwd(m, lane, a, b):
            return runner.split_outputs(runner(m, inputs, others, indices=torch.arange(a, b)))

        aligned = shard.sharded_collection(block, lanes(2), 16, fwd, {}, align=8)
        unaligned = shard.sharded_collection(block, lanes(3), 16, fwd, {}, align=1)  # 6/5/5: new batches
    assert _same_lists(serial, aligned)
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(serial, unaligned, strict=True))
    scale = max(x.float().abs().max().item() for x in serial)
    print(f"unaligned split: max abs diff {diff:.3e} at output magnitude {scale:.3e}")
    assert diff <= 2 * scale * 2**-8, (diff, scale)


# -- auto-round: iters=0 searches, AWQ, saved tensors ------------------------------------------------

def _saved(folder) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.rglob("*.safetensors"))
    assert files, f"nothing saved under {folder}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kw", [{}, {"disable_opt_rtn": True}, {"alg_configs": "awq"}],
                         ids=["opt_rtn", "rtn", "awq"])
def test_iters0_world2_saves_serial_tensors(tmp_path, kw):
    """``iters=0`` on 2 lanes (dpq's tuner and the seams both enabled, as the CLI does): every
    layer's search runs on one lane and is copied home; the saved tensors are bitwise serial's.
    AWQ: its activation-statistics pass is sharded (ordered sink), so are its grid searches."""
    _run(None, save_dir=tmp_path / "serial", **kw)
    _, recs = _run(2, tune_world=2, save_dir=tmp_path / "two", **kw)
    a, b = _saved(tmp_path / "serial"), _saved(tmp_path / "two")
    assert a.keys() == b.keys() and all(bitwise(a[k], b[k]) for k in a)
    maps = [r for r in recs if r.phase == "search" and r.nested]
    assert len(maps) == 2 and all(r.world == 2 and "lane 0: 3, lane 1: 4" in r.detail for r in maps)
    if "alg_configs" in kw:
        assert any(r.world == 2 and "awq_activation:ordered" in r.detail for r in recs)
        assert any(r.world == 2 and "AWQ grid search" in r.detail for r in recs)


def test_signround_v2_init_scale_searches_mapped():
    """SignRoundV2 (enable_alg_ext): each layer's wrap-time init-scale search runs once on one lane
    before the block is wrapped, and the wrapper takes the result: tuned model bitwise serial's."""
    from dpq.autoround import seams_common

    kw = dict(iters=2, enable_alg_ext=True)
    serial_state, _ = _run(None, **kw)
    state, recs = _run(2, **kw)
    assert seams_common.reported().seams.init_scale_hits == 14  # 7 layers x 2 blocks, none searched again
    maps = [r for r in recs if r.nested and "init-scale" in r.detail]
    assert len(maps) == 2 and all(r.world == 2 for r in maps)
    assert all(bitwise(serial_state[k], state[k]) for k in state)


def test_collection_lane_failure(recorder):
    """A lane failing in a collection pass: under auto the pass reruns on home with the statistics
    restored (result bitwise serial's); under an explicit world a ParallelLaneError is raised."""
    from dpq.autoround.seams_common import ParallelLaneError

    serial_state, _ = _run(None, **STATIC_ACT)
    state, recs = _run("auto", faults={"collection": 1}, **STATIC_ACT)
    assert any(r.fell_back for r in recs)
    assert all(bitwise(serial_state[k], state[k]) for k in state)
    with pytest.raises(ParallelLaneError, match=r"lane failed in a collection pass of model\.layers\.0"):
        _run(2, faults={"collection": 1}, **STATIC_ACT)


@pytest.mark.parity_subset
@pytest.mark.parametrize("extra", [[], ["--alg", "awq", "--awq_n_grid", "4", "--awq_apply_clip"]],
                         ids=["rtn", "awq"])
def test_cli_iters0_world2_saves_serial_tensors(tmp_path, extra):
    """``auto-round-dp --iters 0 --parallel_quantization 2`` (plain and AWQ) on the shipped
    embedded model, its first 2 of 4 layers (auto-round's ``--num_hidden_layers``: every layer
    runs the same passes, and AWQ's clip search made the 4-layer pair of runs the suite's
    second-slowest test), saves exactly the tensors plain auto-round saves."""
    import subprocess
    import sys

    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    calib = calibration_jsonl(tmp_path / "calib.jsonl", 32, 64)

    def cli(out, *more):
        cmd = [sys.executable, "-m", "dpq.autoround.cli", "--model", str(DATA_DIR), "--dataset", str(calib),
               "--iters", "0", "--nsamples", "16", "--seqlen", "64", "--batch_size", "8", "--device_map", "cpu",
               "--disable_torch_compile", "--num_hidden_layers", "2", "--output_dir", str(tmp_path / out), *extra,
               *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _saved(tmp_path / out), proc.stdout + proc.stderr

    # the two runs at once, one intra-op thread each (2 cores): half the wall time of one after the other
    from concurrent.futures import ThreadPoolExecutor  # threads only wait on the subprocesses

    with ThreadPoolExecutor(2) as pool:
        off = pool.submit(cli, "off", "--parallel_quantization", "off")
        par = pool.submit(cli, "two", "--parallel_quantization", "2", "--parallel_devices", "cpu,cpu")
        (serial, _), (two, log) = off.result(), par.result()
    assert serial.keys() == two.keys() and all(bitwise(serial[k], two[k]) for k in serial)
    from dpq.autoround import patches

    if any(p.name == "_quantize_targets" for p in patches.patches_for()):  # 0.16: dpq maps the searches
        assert "mapped over 2 lanes" in log
    else:  # 0.17: auto-round's own search dispatch runs them; the collection passes are still sharded
        assert "on 2 lane(s)" in log


def test_install_is_idempotent_and_uninstall_restores():
    from auto_round.algorithms.composer import AlgorithmComposer
    from auto_round.algorithms.quantization.rtn.quantizer import OptimizedRTNQuantizer, RTNQuantizer

    from dpq.autoround import shard_seams
    from dpq.autoround.run import Run
    from dpq.planning.spec import ParallelSpec

    before = (AlgorithmComposer.compress_block, RTNQuantizer.quantize_block, OptimizedRTNQuantizer._quantize_targets)
    shard_seams.install(Run(ParallelSpec(2), seams_only=True))
    shard_seams.install(Run(ParallelSpec("off"), seams_only=True))
    assert shard_seams.installed() and AlgorithmComposer.compress_block is not before[0]
    shard_seams.uninstall()
    shard_seams.uninstall()
    after = (AlgorithmComposer.compress_block, RTNQuantizer.quantize_block, OptimizedRTNQuantizer._quantize_targets)
    assert after == before and not shard_seams.installed()


@pytest.fixture()
def awq_recorder(monkeypatch):
    """Record, in call order, every AWQ grid point's loss (serial: auto-round's _compute_parent_loss;
    sharded: the seam's) and every applied smoothing scale vector and clip range."""
    from auto_round.algorithms.transforms.awq.base import AWQTransform

    from dpq.autoround import seams_awq

    calls = []

    def loss_recorder(fn):
        def recording(*args):  # auto-round's (self, ...) or the seam's (run, self, ...)
            loss = fn(*args)
            calls.append(("loss", loss))
            return loss

        return recording

    orig_scales, orig_clip = AWQTransform._apply_scales, AWQTransform._apply_clip

    def scales(self, mapping, s):
        calls.append(("scales", mapping.smooth_name, s.detach().clone()))
        return orig_scales(self, mapping, s)

    def clip(self, layer, min_val, max_val):
        calls.append(("clip", layer.global_name, min_val.detach().clone(), max_val.detach().clone()))
        return orig_clip(self, layer, min_val, max_val)

    monkeypatch.setattr(AWQTransform, "_compute_parent_loss", loss_recorder(AWQTransform._compute_parent_loss))
    monkeypatch.setattr(seams_awq, "compute_parent_loss", loss_recorder(seams_awq.compute_parent_loss))
    monkeypatch.setattr(AWQTransform, "_apply_scales", scales)
    monkeypatch.setattr(AWQTransform, "_apply_clip", clip)
    return calls


def _same_calls(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x[0] != y[0] or (x[0] == "loss" and x[1] != y[1]):
            return False
        if x[0] != "loss" and (x[1] != y[1] or not all(bitwise(p, q) for p, q in zip(x[2:], y[2:], strict=True))):
            return False
    return True


@pytest.mark.parametrize("smooth_batch_size", [None, 4], ids=["whole_calls", "micro_calls"])
def test_awq_grid_and_clip_searches_world2(tmp_path, awq_recorder, smooth_batch_size):
    """AWQ with clipping at iters=0 on 2 lanes: each grid search replays the cached parent calls
    shard by shard (lane k: its contiguous calls) and reduces per-call squared-error sums in
    serial's order, so every grid point's loss is the same float as serial's, hence the same chosen
    point and bitwise the same scales; each clip search runs once on one lane. Saved tensors: bitwise.
    ``smooth_batch_size=4``: each cached call of 8 samples replays as 2 micro calls (references
    offloaded to the CPU), still one loss term per micro call in serial's order."""
    from auto_round.algorithms.transforms.awq.config import AWQConfig

    from dpq.autoround import seams_common

    kw = dict(alg_configs=AWQConfig(apply_clip=True, n_grid=6, clip_n_grid=4, clip_n_sample_token=64,
                                    smooth_batch_size=smooth_batch_size))
    _run(None, save_dir=tmp_path / "serial", **kw)
    serial = list(awq_recorder)
    awq_recorder.clear()
    _, recs = _run(2, save_dir=tmp_path / "two", **kw)
    hits = seams_common.reported().seams.awq_clip_hits
    kinds = {k: sum(c[0] == k for c in serial) for k in ("loss", "scales", "clip")}
    assert kinds["loss"] > 0 and kinds["scales"] > 0 and kinds["clip"] > 0, kinds
    assert _same_calls(serial, awq_recorder)  # losses equal as floats, scales and clips bitwise
    a, b = _saved(tmp_path / "serial"), _saved(tmp_path / "two")
    assert a.keys() == b.keys() and all(bitwise(a[k], b[k]) for k in a)
    grids = [r for r in recs if r.phase == "search" and "AWQ grid search" in r.detail]
    clips = [r for r in recs if r.phase == "search" and "AWQ clip searches" in r.detail]
    assert grids and all(r.world == 2 and "lane 0: 1, lane 1: 1" in r.detail for r in grids)
    assert len(clips) == 2 and all(r.world == 2 for r in clips)
    assert hits == kinds["clip"]


def test_awq_grid_lane_failure():
    """A lane failing in an AWQ grid search: under auto the balance weights are restored and the
    search reruns on home (result bitwise serial's); under an explicit world ParallelLaneError."""
    from auto_round.algorithms.transforms.awq.config import AWQConfig

    from dpq.autoround.seams_common import ParallelLaneError

    kw = dict(alg_configs=AWQConfig(n_grid=4))
    serial_state, _ = _run(None, **kw)
    faults = {"awq_grid": 1}
    state, recs = _run("auto", faults=faults, **kw)
    assert [r.fell_back for r in recs if "AWQ grid search" in r.detail].count(True) == 1
    assert all(bitwise(serial_state[k], state[k]) for k in state)
    assert faults == {}  # fired once
    faults = {"awq_grid": 1}
    with pytest.raises(ParallelLaneError, match=r"AWQ grid search of model\.layers\.0\.input_layernorm"):
        _run(2, faults=faults, **kw)
    assert faults == {}
