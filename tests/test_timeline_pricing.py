"""The timeline model prices the block it claims to: every size scaled by its role, matmuls and
attention by their FLOPs, the exchange in dpq's buckets for the target's tensors, the default path
compiled, a calibration re-basing only what it measured; and the mutations that show each check sees
what it is there for.

The records are the 1- and 2-lane compile-on runs (``scenarios.recorded_run``), replayed on every
target block and GPU class (``shapes.BLOCKS``, ``devices.GPUS``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpq.engine.exchange import Buckets, bucket_cap, bucket_layout
from dpqlab.timeline.calibration import Calibration, ModelCounts, rebase
from dpqlab.timeline.devices import GPUS, HOST
from dpqlab.timeline.replay import BREAKDOWN, Pricing, op_class, simulate
from dpqlab.timeline.roofline import roofline
from dpqlab.timeline.scenarios import recorded_run
from dpqlab.timeline.shapes import BLOCKS, RECORDED, RoleMap

ITERS = 2
CASES = [(b, g) for b in BLOCKS for g in ("3090", "h100")]


@pytest.fixture(scope="module")
def one_lane():
    return recorded_run(True, 1, ITERS)


@pytest.fixture(scope="module")
def two_lanes():
    return recorded_run(True, 2, ITERS)


@pytest.fixture(scope="module")
def two_lanes_overlap():
    """Two lanes with --parallel_overlap on (what auto takes on GPUs without peer access, e.g. RTX 3090s)."""
    from dpqlab.timeline.scenarios import run_adapter, shared_block

    return run_adapter(shared_block(True), 2, iters=ITERS, overlap=True)


def table_records(one_lane, two_lanes, two_lanes_overlap) -> dict:
    """What benchmarks/timeline.py's table reads: each world with overlap off, and on from world 2."""
    return {("compile", 1): one_lane, ("compile", 2): two_lanes, ("compile+overlap", 2): two_lanes_overlap}


def replay(model, block: str, gpu: str, **pricing):
    return simulate(model, Pricing(RECORDED, BLOCKS[block], GPUS[gpu], pricing.pop("host", HOST),
                                   buckets=pricing.pop("buckets", None), graphs=pricing.pop("graphs", None)))


# -- sizes ------------------------------------------------------------------------------------------


def test_timeline_recorded_sizes_have_one_role_each():
    for block in BLOCKS.values():
        assert RoleMap(RECORDED, block).collisions() == []


def test_timeline_role_collisions_are_found():
    """Mutant: a recorded block whose key/value width equals the group size (the embedded model's
    128): a [kv, in/128] scale would be priced as a norm's [hidden] weight."""
    bad = dataclasses.replace(RECORDED, hidden=256, intermediate=640, heads=4, kv_heads=2, head_dim=64)
    assert RoleMap(bad, BLOCKS["70b"]).collisions()


def test_timeline_every_compute_tensor_has_a_role(two_lanes):
    """Nothing the lanes compute is priced by the fallback ratio (the exchange's buffers are re-laid
    out per target bucket instead)."""
    pricing = Pricing(RECORDED, BLOCKS["70b"], GPUS["h100"], HOST)
    tl = simulate(two_lanes, pricing)
    assert pricing.roles.unmapped == {}, pricing.roles.unmapped
    assert any(op.fixed_scale for op in tl.ops), "the exchange was not laid out per target bucket"


# -- matmuls, attention, the roofline ----------------------------------------------------------------


def check_matmul_time(tl, block: str, gpu: str) -> None:
    matmul = tl.breakdown()["matmul"]
    expected = BLOCKS[block].matmul_flops() / GPUS[gpu].matmul_flops
    assert abs(matmul - expected) <= 0.01 * expected, (matmul, expected)


def check_attention_time(tl, block: str, gpu: str) -> None:
    attention = tl.breakdown()["attention"]
    expected = BLOCKS[block].attention_flops() / GPUS[gpu].attention_flops
    assert abs(attention - expected) <= 0.01 * expected, (attention, expected)


@pytest.mark.parametrize("block, gpu", CASES)
def test_timeline_one_lane_matmuls_and_attention_are_flops_over_rate(one_lane, block, gpu):
    tl = replay(one_lane, block, gpu)
    check_matmul_time(tl, block, gpu)
    check_attention_time(tl, block, gpu)


@pytest.mark.parametrize("block, gpu", CASES)
def test_timeline_one_lane_is_within_ten_percent_of_the_roofline(one_lane, block, gpu):
    model_s = replay(one_lane, block, gpu).seconds_per_iteration()
    roof = roofline(BLOCKS[block], GPUS[gpu])["total"]
    assert abs(model_s - roof) <= 0.1 * roof, (model_s, roof)


def test_timeline_attention_at_zero_flops_fails(one_lane, monkeypatch):
    """Mutant: attention priced by its bytes (0 FLOPs, as torch's registry has it for the CPU kernels)."""
    real = Pricing.flops
    monkeypatch.setattr(Pricing, "flops", lambda self, op: 0.0 if op.work == "attention" else real(self, op))
    with pytest.raises(AssertionError):
        check_attention_time(replay(one_lane, "70b", "h100"), "70b", "h100")


def test_timeline_every_kernel_is_priced(one_lane, two_lanes):
    """A matmul or attention kernel carries its FLOPs; anything else is memory-bound by design
    (elementwise, priced by its bytes), and every kernel has bytes."""
    for model in (one_lane, two_lanes):
        for op in model.ops:
            if op.kind != "kernel":
                continue
            assert (op.flops > 0) == (op.work in ("matmul", "attention")), (op.name, op.work, op.flops)
            assert sum(b for _, b, _ in op.tensors) > 0 or op.work == "elementwise", op.name


# -- the exchange in the target's buckets ------------------------------------------------------------


def check_buckets(tl, model, block: str, cap="recorded") -> None:
    sizes, recorded_cap = model.bucket_layout
    cap = recorded_cap if cap == "recorded" else cap
    target = [RoleMap(RECORDED, BLOCKS[block]).target_numel(n, 0) for n in sizes]
    expected = [sum(target[i] for i in ids) for ids in bucket_layout(target, bucket_cap(target, cap))]
    assert tl.buckets == expected
    assert sum(tl.buckets) == sum(BLOCKS[block].tuned_numels())
    groups = {op.group for op in tl.ops if op.iteration == 1 and op.kind == "collective"}
    assert len(groups) == 2 * len(expected)  # the sign exchange: a reduce-scatter and an all-gather per bucket


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_timeline_exchange_has_the_target_blocks_buckets(two_lanes, block):
    from dpq.engine.exchange import Buckets

    # accelerator lanes, no overlap, and the recorded block fits anywhere: the plan's one bucket for the
    # whole block (Note [one bucket where it fits]), and so the target's
    assert two_lanes.bucket_layout[1] is Buckets.BLOCK
    tl = replay(two_lanes, block, "h100")
    check_buckets(tl, two_lanes, block)
    assert len(tl.buckets) == 1
    # where the target's card lacks the memory for it: buckets up to the largest tensor (Note [buckets
    # as large as the largest tensor]): the three 28672 x 8192 values alone, attention's four with the
    # norms, the scales
    tl = replay(two_lanes, block, "h100", buckets="largest")
    check_buckets(tl, two_lanes, block, cap=Buckets.LARGEST)
    if block == "70b":
        assert len(tl.buckets) == 5 and max(tl.buckets) == 28672 * 8192


def test_timeline_overlapping_buckets_keep_the_small_cap(two_lanes):
    """Where buckets overlap the backward the cap stays 2^22: every weight-shaped value of a 70B-class
    block over it alone, the scales in four."""
    from dpq.engine.exchange import OVERLAP_BUCKET_CAP

    sizes, _ = two_lanes.bucket_layout
    target = [RoleMap(RECORDED, BLOCKS["70b"]).target_numel(n, 0) for n in sizes]
    assert len(bucket_layout(target, bucket_cap(target, OVERLAP_BUCKET_CAP))) == 11


def test_timeline_one_bucket_for_every_block_fails(two_lanes, monkeypatch):
    """Mutant: the recorded block's single bucket kept for the target (the model before this change)."""
    from dpqlab.timeline.buckets import TargetBucket

    def one_bucket(layout, roles):
        return [TargetBucket(sum(roles.target_numel(n, 0) for n in layout[0]), tuple(range(len(layout[0]))))]

    monkeypatch.setattr("dpqlab.timeline.replay.target_buckets", one_bucket)
    with pytest.raises(AssertionError):
        check_buckets(replay(two_lanes, "70b", "h100", buckets="largest"), two_lanes, "70b", cap=Buckets.LARGEST)


# -- the default path is the compiled one -------------------------------------------------------------


def check_compiled(model) -> None:
    """Each lane's block forward is one compiled region: a graph call on the issuing thread, its
    backward one more on autograd's thread for the lane, inductor's kernels between."""
    calls = [op for op in model.ops if op.iteration == 1 and op.kind == "call"]
    assert calls and {op.region for op in calls} == {"block_forward"}, {op.region for op in calls}
    assert {op.thread for op in calls} == {"main", "autograd dev1"}
    assert [n for name, n in model.region_graphs if name == "block_forward"] == \
        [1] * sum(name == "block_forward" for name, _ in model.region_graphs), "the block forward graph-broke"
    region = [op for op in model.ops if op.iteration == 1 and op.region]
    assert any(op.work == "matmul" for op in region) and any(op.work == "elementwise" for op in region)


def test_timeline_default_record_is_compile_on(one_lane):
    import inspect

    from benchmarks import timeline as bench
    from dpqlab.timeline import scenarios

    assert inspect.signature(scenarios.record_block).parameters["compile"].default is True
    assert bench.PATHS[0] == "compile"
    check_compiled(one_lane)


def test_timeline_compile_off_in_the_default_fails():
    """Mutant: the eager record where the default's is expected."""
    with pytest.raises(AssertionError):
        check_compiled(recorded_run(False, 1, ITERS))


def test_timeline_compiled_gradients_reach_the_buckets_when_the_backward_lets_them(two_lanes, two_lanes_overlap):
    """Without overlap (where auto leaves it off on GPU lanes) a compiled region is one autograd node and no
    hook runs: each lane's gradients reach the buckets in one copy the issuing thread makes after the
    backward (Note [one copy per lane]). With overlap the lanes run the block forward uncompiled (Note
    [overlap needs gradients during the backward]): a lane's first gradient reaches its bucket (the copy
    hooks on autograd's threads, Python, so under the GIL) before that lane's backward has issued its last
    kernel, and no compiled block region runs on the lanes."""

    ops = [op for op in two_lanes_overlap.ops if op.iteration == 1 and op.stream is not None]
    assert not any(op.region == "block_forward" for op in ops)
    backward = [op for op in ops if op.kind == "kernel" and op.phase == "backward" and op.thread.startswith("autograd")]
    streams = {op.stream.sid for op in backward}
    assert len(streams) == 2
    for stream in streams:
        last = max(op.id for op in backward if op.stream.sid == stream)
        grads = [op for op in ops if op.phase == "grads" and op.stream.sid == stream
                 and op.thread.startswith("autograd")]
        assert grads and min(op.id for op in grads) < last
        assert all(op.gil for op in grads)  # Note [Python on autograd's threads holds the GIL]
    ops = [op for op in two_lanes.ops if op.iteration == 1 and op.stream is not None]
    assert not [op for op in ops if op.phase == "grads" and op.thread.startswith("autograd")]
    copies = [op for op in ops if op.name == "aten::_foreach_copy_"]
    assert [op.thread for op in copies] == ["main", "main"]
    assert {op.stream.sid for op in copies} == {op.stream.sid for op in ops if op.region and op.phase == "backward"}
    assert min(op.id for op in copies) > max(op.id for op in ops if op.region and op.phase == "backward")


# -- calibration ------------------------------------------------------------------------------------

COUNTS = {"compile": ModelCounts(matmul_flops=2.0e13, attention_flops=2.0e12, qdq_bytes=4.0e9, eager_ops=80,
                                 compiled_kernels=60, compiled_externs=24, region_calls=2, launches=140),
          "eager": ModelCounts(matmul_flops=2.0e13, attention_flops=2.0e12, qdq_bytes=4.0e10, eager_ops=900,
                               compiled_kernels=0, compiled_externs=0, region_calls=0, launches=900)}


def fixture(**paths) -> Calibration:
    return Calibration.from_dict({"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200",
                                  "date": "2026-12-04", "block": {"hidden": 4096, "intermediate": 14336,
                                                                  "heads": 32, "kv_heads": 8, "head_dim": 128},
                                  "paths": paths})


def changed(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if f.name not in ("sources", "calibrated")
            and getattr(a, f.name) != getattr(b, f.name)}


def test_timeline_calibration_changes_what_it_measured_only():
    gpu, host = GPUS["h200"], HOST
    cal = fixture(compile={"8": {"phases_ms": {"matmul": 40.0}}})
    g, h, notes = rebase(cal, "h200", gpu, host, COUNTS)
    assert changed(gpu, g) == {"matmul_flops"} and changed(host, h) == set() and len(notes) == 1
    assert g.matmul_flops == pytest.approx(2.0e13 / 0.040) and g.calibrated == "NVIDIA_H200-2026-12-04"
    cal = fixture(eager={"8": {"host_ms_per_iteration": 9.0}})
    g, h, _ = rebase(cal, "h200", gpu, host, COUNTS)
    assert changed(gpu, g) == set() and changed(host, h) == {"eager_op_s", "compiled_extern_s", "view_op_s"}
    assert h.eager_op_s == pytest.approx(9.0e-3 / 900)
    g, h, notes = rebase(cal, "h100", gpu, host, COUNTS)  # another class: only the host's figures
    assert changed(gpu, g) == set() and "eager_op_s" in changed(host, h)


def test_timeline_calibration_with_attention_inside_matmul_keeps_the_models_ratio():
    """A run whose matmul phase also holds attention (attention_in_matmul): both rates scale by one
    factor and the model's matmul + attention time is the measured time; read apart, the matmul rate
    alone would absorb attention's time (and attention would keep the stated rate)."""
    gpu, host = GPUS["h200"], HOST
    data = {"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200", "date": "2026-12-04",
            "block": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128},
            "paths": {"compile": {"8": {"phases_ms": {"matmul": 40.0, "attention": 0.0}}}}}
    g, _, _ = rebase(Calibration.from_dict({**data, "attention_in_matmul": True}), "h200", gpu, host, COUNTS)
    assert changed(gpu, g) == {"matmul_flops", "attention_flops"}
    assert 2.0e13 / g.matmul_flops + 2.0e12 / g.attention_flops == pytest.approx(0.040)
    assert g.matmul_flops / g.attention_flops == pytest.approx(gpu.matmul_flops / gpu.attention_flops)
    apart, _, _ = rebase(Calibration.from_dict(data), "h200", gpu, host, COUNTS)
    assert changed(gpu, apart) == {"matmul_flops"} and apart.matmul_flops < g.matmul_flops


def test_timeline_host_calibrated_from_dpqs_issuing_thread():
    """dpq_issuing: the eager kind's per-op host costs scale by measured / modeled issuing time per
    lane-iteration (Note [host scales by kind]); the paths' host times (an upper bound) are then left
    alone; no key, no change."""
    from dpqlab.timeline.calibration import HOST_KINDS, HOST_OP_COSTS, issuing_scale

    data = {"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200", "date": "2026-12-04",
            "block": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128},
            "paths": {"eager": {"8": {"host_ms_per_iteration": 9.0}}},
            "dpq_issuing": {"world": 2, "path": "compile", "own_ms_per_lane_iteration": 21.0}}
    cal = Calibration.from_dict(data)
    h, notes = issuing_scale(cal, HOST, 7.0)
    assert set(HOST_OP_COSTS) == {name for names in HOST_KINDS.values() for name in names}
    assert changed(HOST, h) == set(HOST_KINDS["eager"]) and len(notes) == 1
    for name in HOST_KINDS["eager"]:
        assert getattr(h, name) == pytest.approx(3.0 * getattr(HOST, name))
    _, h2, _ = rebase(cal, "h200", GPUS["h200"], h, COUNTS, paths_host=False)
    assert h2 == h  # the eager path's 9 ms (an upper bound) does not overwrite it
    del data["dpq_issuing"]
    assert issuing_scale(Calibration.from_dict(data), HOST, 7.0) == (HOST, [])


def test_timeline_issuing_figure_is_bounded_by_the_unprofiled_walls():
    """Note [the profiler's bound]: the one issuing thread's own time per lane-iteration is at most an
    unprofiled iteration's wall / W; the profiled figure is used only where it is smaller."""
    from dpqlab.timeline.calibration import issuing_bound, issuing_scale

    got = {"world": 2, "path": "compile", "own_ms_per_lane_iteration": 21.0,
           "wall_ms_per_iteration": {"2": 46.0, "4": 48.8}}
    ms, whence = issuing_bound(got)
    assert ms == pytest.approx(12.2) and "world 4" in whence
    assert issuing_bound({**got, "own_ms_per_lane_iteration": 10.0}) == (10.0, "profiled")
    assert issuing_bound({"own_ms_per_lane_iteration": 21.0}) == (21.0, "profiled")
    assert issuing_bound({**got, "wall_ms_per_iteration": {"1": 5.0}}) == (21.0, "profiled")  # one lane bounds nothing
    data = {"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200", "date": "2026-12-04",
            "block": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128},
            "dpq_issuing": got}
    h, notes = issuing_scale(Calibration.from_dict(data), HOST, 6.1)
    assert h.eager_op_s == pytest.approx(2.0 * HOST.eager_op_s) and "unprofiled" in notes[0]


def test_timeline_issuing_scale_prices_the_measured_codes_own_ops():
    """Note [the measured code's ops]: with the run's op counts the scale is the measured time over
    those ops at the stated costs, whatever today's code issues (the model's figure is not used)."""
    from dpqlab.timeline.calibration import issuing_scale

    data = {"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200", "date": "2026-12-04",
            "block": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128},
            "dpq_issuing": {"world": 2, "path": "compile", "own_ms_per_lane_iteration": 20.0,
                            "ops_per_lane_iteration": {"views": 1000.0, "other": 200.0}}}
    then = (200 * HOST.eager_op_s + 1000 * HOST.view_op_s) * 1e3
    h, notes = issuing_scale(Calibration.from_dict(data), HOST, 5.0)
    assert h.eager_op_s == pytest.approx(HOST.eager_op_s * 20.0 / then) and "200 ops and 1000 views" in notes[0]
    assert issuing_scale(Calibration.from_dict(data), HOST, 1.0) == (h, notes)  # today's code: not the scale's
    del data["dpq_issuing"]["ops_per_lane_iteration"]
    assert issuing_scale(Calibration.from_dict(data), HOST, 5.0)[0].eager_op_s == pytest.approx(4 * HOST.eager_op_s)


def _issuing_cal(got: dict) -> Calibration:
    return Calibration.from_dict({"schema": "dpq-calibration/1", "card": "NVIDIA H200", "gpu_class": "h200",
                                  "date": "2026-12-04", "block": {"hidden": 4096, "intermediate": 14336,
                                                                  "heads": 32, "kv_heads": 8, "head_dim": 128},
                                  "dpq_issuing": {"world": 2, "path": "compile", **got}})


def test_timeline_compiled_forward_is_counted_once(one_lane, two_lanes):
    """Note [the compiled forward counted once]: the run's counted ops at the calibrated costs plus the
    compiled regions as the calibrated model replays them are the measured time, not more (before: the
    measured time went to the counted ops alone and the compiled regions came on top, scaled alike)."""
    from benchmarks import timeline as bench
    from dpqlab.timeline.calibration import block_shape, compiled_host_ms

    got = {"own_ms_per_lane_iteration": 12.0, "ops_per_lane_iteration": {"views": 328.0, "other": 204.5}}
    cal = _issuing_cal(got)
    _, h, _ = bench.calibrated(cal, "h200", HOST, {"compile": one_lane}, {("compile", 2): two_lanes})
    tl = simulate(two_lanes, Pricing(RECORDED, block_shape(cal), GPUS["h200"], h))
    compiled = compiled_host_ms(tl)
    assert compiled > 0  # the record's compiled forward is on the issuing thread
    counted = (204.5 * h.eager_op_s + 328.0 * h.view_op_s) * 1e3
    assert counted + compiled == pytest.approx(12.0, rel=1e-9)


def test_timeline_host_kinds_are_priced_apart(two_lanes):
    """Note [host scales by kind]: the measured issuing time re-bases the Python-issued eager ops only,
    less the compiled regions at their stated costs; compiled-region calls, Inductor's launches and
    graph launches keep their stated figures (before: every kind x the eager scale), and the replay
    prices each op by its kind's figure."""
    from dpqlab.timeline.calibration import HOST_KINDS, issuing_scale

    cal = _issuing_cal({"own_ms_per_lane_iteration": 12.0, "ops_per_lane_iteration": {"views": 300.0,
                                                                                       "other": 200.0}})
    h, notes = issuing_scale(cal, HOST, 5.0, 2.0)
    then = (200 * HOST.eager_op_s + 300 * HOST.view_op_s) * 1e3
    for kind, names in HOST_KINDS.items():
        for name in names:
            want = getattr(HOST, name) * ((12.0 - 2.0) / then if kind == "eager" else 1.0)
            assert getattr(h, name) == pytest.approx(want), (kind, name)
    assert "stated costs" in notes[0]
    same, why = issuing_scale(cal, HOST, 5.0, 12.0)  # nothing left for the eager ops: the stated host kept
    assert same == HOST and "stated figures kept" in why[0]
    # the replay: a compiled kernel costs compiled_kernel_s, a region's call region_call_s, whatever eager costs
    price = replay(two_lanes, "8b", "h100", host=h).pricing
    call = next(op for op in two_lanes.ops if op.kind == "call")
    assert price.host_s(call) == h.region_call_s == HOST.region_call_s
    kernel = next(op for op in two_lanes.ops if op.kind == "kernel" and op.region and op.work == "elementwise")
    assert price.host_s(kernel) == HOST.compiled_kernel_s
    eager = next(op for op in two_lanes.ops if op.kind == "kernel" and not op.region)
    assert price.host_s(eager) == pytest.approx(HOST.eager_op_s * (12.0 - 2.0) / then)


def test_timeline_table_prints_the_bound_and_the_stated_host_while_the_host_is_a_bound(one_lane, two_lanes,
                                                                                       two_lanes_overlap):
    """Issue 38 item 2: until a lease measured the issuing thread's CPU time the calibration's host is a
    bound, and ``--table`` prints the compile-on rows at that bound and at the stated host side by
    side; with the thread's CPU time (``host_source`` thread_time) it prints the table alone."""
    from benchmarks import timeline as bench

    records = table_records(one_lane, two_lanes, two_lanes_overlap)
    walls = {"own_ms_per_lane_iteration": 21.0, "wall_ms_per_iteration": {"2": 46.0, "4": 48.9},
             "ops_per_lane_iteration": {"views": 328.0, "other": 204.5}}
    bound = _issuing_cal(walls)
    assert bound.host_source == "wall_bound"
    rows, _ = bench.table(records, bound, HOST, ("compile",))
    lines = bench.host_sides_lines(rows, records, bound, HOST)
    body = [ln for ln in lines if ln.startswith("| ") and "x |" in ln]
    assert len(body) == len(rows) and "an upper bound" in "\n".join(lines)
    for r, ln in zip(rows, body, strict=True):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert cells[2] == f"{r.host.eager_op_s * 1e6:.1f}" and cells[6] == f"{HOST.eager_op_s * 1e6:.1f}"
        assert cells[3] == f"{r.per_iter[1] / r.per_iter[2]:.2f}x"
        assert float(cells[9]) < float(cells[5])  # the stated host is below the bound's
    measured = _issuing_cal({**walls, "thread_cpu_ms_per_iteration": {"2": 18.0, "4": 35.0}})
    assert measured.host_source == "thread_time"
    assert bench.host_sides_lines(rows, records, measured, HOST) == []  # the calibration decides, not the rows


def test_timeline_views_cost_the_issuing_thread_only(two_lanes):
    """An op that only makes a view is recorded (kind ``view``), priced at ``view_op_s`` on its
    thread and nothing on a device; the exchange makes its views once, in its first iteration (the
    communicator's own slices of its buffers, cupy-nccl's canonical order, are made per call)."""
    views = [op for op in two_lanes.ops if op.kind == "view"]
    assert views and all(op.stream is None for op in views)
    tl = replay(two_lanes, "8b", "h100")
    dear = replay(two_lanes, "8b", "h100", host=HOST.rebased(view_op_s=HOST.view_op_s + 1e-4))
    steady = {it.index for it in tl.steady()}
    n = sum(op.kind == "view" and op.thread == "main" and op.iteration in steady for op in tl.ops) / len(steady) / 2
    assert n > 0
    got = dear.breakdown()["host_per_lane_iteration"] - tl.breakdown()["host_per_lane_iteration"]
    assert got == pytest.approx(n * 1e-4, rel=1e-6)
    views = [op for op in views if not op.in_communicator]
    bucket_views = [{op.iteration for op in views if op.bucket == b} for b in {op.bucket for op in views} - {None}]
    assert bucket_views and all(its == {0} for its in bucket_views)


def test_timeline_calibration_moves_the_table(tmp_path, one_lane, two_lanes, two_lanes_overlap):
    """A calibration file read by benchmarks/timeline.py changes the figures it measures."""
    from benchmarks import timeline as bench

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"schema": "dpq-calibration/1", "card": "NVIDIA H100", "gpu_class": "h100",
                                "date": "2026-12-04", "block": {"hidden": 4096, "intermediate": 14336, "heads": 32,
                                                                "kv_heads": 8, "head_dim": 128},
                                "paths": {"compile": {"8": {"phases_ms": {"matmul": 80.0}}}}}))
    records = table_records(one_lane, two_lanes, two_lanes_overlap)
    plain, _ = bench.table(records, None, HOST, ("compile",))
    cal, notes = bench.table(records, bench.load_calibration(str(path)), HOST, ("compile",))
    by = {(r.gpu, r.block): r for r in plain}
    for r in cal:
        assert (r.per_iter[1] != by[(r.gpu, r.block)].per_iter[1]) == (r.gpu == "h100"), (r.gpu, r.block)
    assert any("matmul_flops" in n for n in notes)


def test_timeline_breakdown_adds_up(two_lanes):
    """Every class of lane 0's device time is counted once: its kernels and copies on every stream of its
    device (the exchange's communication stream too)."""
    tl = replay(two_lanes, "70b", "h100")
    steady = tl.steady()
    place = two_lanes.lanes[0].stream.place
    for it in steady:
        ops = [op for op in tl.ops if op.iteration == it.index and op.kind in ("kernel", "copy")
               and op.stream is not None and op.stream.place == place and op.id in tl.start]
        assert all(op_class(op) is not None for op in ops)
        assert sum(it.lane0.values()) == pytest.approx(sum(tl.end[op.id] - tl.start[op.id] for op in ops))


# -- CUDA graphs, priced (Pricing.graphs) --------------------------------------------------------------


def _steady_main(tl):
    steady = {it.index for it in tl.steady()}
    return [op for op in tl.ops if op.thread == "main" and op.iteration in steady], len(steady)


def _device_work(tl) -> dict[str, float]:
    b = tl.breakdown()
    return {k: b[k] for k in BREAKDOWN}


def test_timeline_graphed_regions_cost_a_launch_and_no_kernels(two_lanes):
    """With the compiled regions replayed through CUDA graph trees, the issuing thread pays each region
    call its call, the trees' checks and a launch, and none of the region's kernels; no device op's
    time changes."""
    built, graphed = replay(two_lanes, "8b", "h100"), replay(two_lanes, "8b", "h100", graphs="regions")
    price = Pricing(RECORDED, BLOCKS["8b"], GPUS["h100"], HOST)
    ops, n = _steady_main(built)
    kernels = [op for op in ops if op.kind == "kernel" and op.region]
    calls = [op for op in ops if op.kind == "call" and op.region]
    assert kernels and calls
    saved = sum(price.host_s(op) for op in kernels) - len(calls) * (HOST.graph_tree_s + HOST.graph_launch_s)
    got = built.breakdown()["host_per_lane_iteration"] - graphed.breakdown()["host_per_lane_iteration"]
    assert got == pytest.approx(saved / n / 2, rel=1e-6)
    assert _device_work(graphed) == pytest.approx(_device_work(built), rel=1e-9)


def test_timeline_graphed_iteration_costs_a_launch_per_lane_and_the_readback(two_lanes):
    """With each lane's steady iteration one captured graph, the issuing thread pays per lane-iteration
    one launch and two small copies, plus the loss readback as recorded; no device op's time changes."""
    built, graphed = replay(two_lanes, "8b", "h100"), replay(two_lanes, "8b", "h100", graphs="iteration")
    price = Pricing(RECORDED, BLOCKS["8b"], GPUS["h100"], HOST)
    ops, n = _steady_main(built)
    readback = sum(price.host_s(op) for op in ops if op.phase == "readback")
    assert readback > 0
    want = HOST.graph_launch_s + 2 * HOST.eager_op_s + readback / n / 2
    assert graphed.breakdown()["host_per_lane_iteration"] == pytest.approx(want, rel=1e-6)
    assert _device_work(graphed) == pytest.approx(_device_work(built), rel=1e-9)
    assert graphed.seconds_per_iteration() <= built.seconds_per_iteration()


def test_timeline_unknown_graphs_pricing_is_refused():
    with pytest.raises(ValueError, match="graphs='all'"):
        Pricing(RECORDED, BLOCKS["8b"], GPUS["h100"], HOST, graphs="all")


def test_timeline_table_prints_the_graphed_speedups(one_lane, two_lanes, two_lanes_overlap):
    """``--table`` prints per compile-on row the speedup as built, with graph trees and with one graph per
    lane-iteration, at the most lanes recorded; one graph per lane-iteration is never slower."""
    from benchmarks import timeline as bench

    rows, _ = bench.table(table_records(one_lane, two_lanes, two_lanes_overlap), None, HOST, ("compile",))
    lines = [ln for ln in bench.graphs_lines(rows) if ln.startswith("| ") and "x |" in ln]
    assert len(lines) == len(rows)
    for r in rows:
        built, trees, one = (r.per_iter[1] / tl.seconds_per_iteration()
                             for tl in (r.timelines[2], r.graphed["regions"], r.graphed["iteration"]))
        assert one >= built - 1e-9 and trees > 0
        assert any(f"{built:.2f}x | " in ln and f"{one:.2f}x | " in ln for ln in lines)


def test_timeline_table_runs_what_auto_takes(one_lane, two_lanes, two_lanes_overlap):
    """Each row's worlds >= 2 are the run --parallel_overlap auto takes on the machine (Note [overlap where the
    wire is slow]): with overlap on RTX 3090s (no peer access), off on H100s (NVLink), the other setting
    beside it in ``Row.other`` and in the overlap table."""
    from benchmarks import timeline as bench

    rows, _ = bench.table(table_records(one_lane, two_lanes, two_lanes_overlap), None, HOST, ("compile",))
    for r in rows:
        on = r.gpu == "3090"
        assert r.overlap[0] is on and ("no peer access" if on else "every GPU pair has peer access") in r.overlap[1]
        taken, other = (two_lanes_overlap, two_lanes) if on else (two_lanes, two_lanes_overlap)
        assert r.per_iter[2] == bench._priced(taken, r.block, r.gpu, GPUS[r.gpu], HOST, 2).seconds_per_iteration()
        assert r.other.seconds_per_iteration() == bench._priced(other, r.block, r.gpu, GPUS[r.gpu], HOST,
                                                                2).seconds_per_iteration()
    lines = [ln for ln in bench.overlap_lines(rows) if ln.startswith("| compile |")]
    assert len(lines) == len(rows) and all(ln.endswith("| on |") == ("3090" in ln) for ln in lines)
