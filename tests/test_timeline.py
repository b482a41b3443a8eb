"""The CUDA timeline model (``dpqlab/timeline/``) on the real tune: one host sync per iteration
(the loss readback), the lanes side by side, every lane's data lane-local, in one process and under
torchrun, on auto-round's default torch.compile path and on the eager one; and the mutations that
prove the model sees each of these.

The scenarios (``dpqlab/timeline/scenarios.py``) replay a tiny bf16 Llama block, recorded from
auto-round's own run, through the auto-round adapter (``enable()``: auto-round's ``block_forward``
and ``_get_loss``, compiled or not) or ``dpq.parallel_tune`` on logical GPUs. Durations: the
70B-class block on RTX 3090s (``benchmarks/timeline.py``'s default preset), where one thread's issue
cost is small next to a lane's compute, so any lane waiting for another shows as lost overlap; the
host's stated server-CPU costs (``devices.HOST``), so the figures do not depend on this machine's load.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from dpqlab.timeline.devices import GPUS, HOST
from dpqlab.timeline.replay import Pricing, simulate
from dpqlab.timeline.scenarios import record_block, recorded_run, run_adapter, run_api, shared_block
from dpqlab.timeline.shapes import BLOCKS, RECORDED
from tests import timeline_mutants
from tests.processes import worker_context

OVERLAP = 0.9  # the issue's bound; the fixed data path gives >= 0.99 at worlds 2-8, the one before lane-local 0.65
ITERS = 2  # iteration 0 also brings each lane's per-block constants; iteration 1 is steady


@pytest.fixture(scope="module")
def rec():
    """The eager record: the data path's properties below do not depend on compiling (the compiled
    path's own run is test_timeline_one_host_sync_per_iteration's compile cases)."""
    return shared_block(compile=False)


def timeline(model):
    return simulate(model, Pricing(RECORDED, BLOCKS["70b"], GPUS["3090"], HOST))


def lane_streams(model) -> set[int]:
    return {lane.stream.sid for lane in model.lanes}


def assert_lane_local(model) -> None:
    """R7: inside the iterations no device-to-device copy runs on a lane's stream (it would join two
    lanes: torch runs it on the source device's current stream, with barriers on both sides), and no
    host-to-device copy blocks the host."""
    lanes = lane_streams(model)
    for op in model.ops:
        if op.iteration < 0 or op.kind != "copy":
            continue
        if op.link == "d2d":
            assert op.stream.sid not in lanes, f"{op.name} on lane stream {op.stream.name} at {op.site}"
        elif op.link == "h2d":
            assert not op.blocking, f"{op.name} blocks the host at {op.site}"


def assert_one_sync(tl) -> None:
    per_iter = [len(it.syncs) for it in tl.iterations]
    assert per_iter == [1] * ITERS, [[(s.what, s.site) for s in it.syncs] for it in tl.iterations]
    for it in tl.iterations:
        assert "_read_losses" in it.syncs[0].site


@pytest.mark.parametrize("compile, world", [(False, 2), (False, 3), (False, 4), (True, 2)])
def test_timeline_one_host_sync_per_iteration(compile, world):
    """Both paths: with torch.compile on (auto-round's default) each lane's block forward is one
    compiled region (its kernels inductor's, its backward one autograd node) and still no host sync
    but the readback, the lanes side by side."""
    model = recorded_run(compile, world, ITERS)
    tl = timeline(model)
    if compile:
        assert any(op.region == "block_forward" for op in model.ops), "no compiled region in the record"
    assert model.violations == []
    assert_one_sync(tl)
    assert tl.lane_overlap() >= OVERLAP, [it.overlap for it in tl.iterations]
    assert_lane_local(model)
    assert len(model.lanes) == world and len(lane_streams(model)) == world


@pytest.mark.parametrize("pool, cache, world", [("host", "device", 2), ("host", "host", 2), ("spread", "device", 3)])
def test_timeline_pool_placements(rec, pool, cache, world):
    """The pool in host memory (pinned once per block, copied async on each lane's stream) and spread
    over the lanes' devices (auto-round 0.17's --calibration_data_device auto: each sample from the
    device holding it, on the lane's side stream there). With the best iteration's values kept on the
    host too (--low_gpu_mem_usage), serial's snapshot copies them over the bus on lane 0's stream
    whenever the loss improves (asynchronously: no host wait), which delays lane 0: the overlap bound
    is held where they stay on the device."""
    model = run_adapter(rec, world, iters=ITERS, pool=pool, cache=cache)
    tl = timeline(model)
    assert model.violations == []
    assert_one_sync(tl)
    assert_lane_local(model)
    if cache == "device":
        assert tl.lane_overlap() >= OVERLAP
    copies = [op for op in model.ops if op.iteration >= 0 and op.kind == "copy"]
    if pool == "host":
        assert any(op.link == "h2d" for op in copies) and not any(op.blocking for op in copies)
    else:
        assert any(op.link == "d2d" for op in copies)  # samples from the other lanes' devices
    if cache == "host":
        assert any(op.link == "d2h" and op.tensors[0][1] > 4 and not op.blocking for op in copies)  # the snapshot


def test_timeline_parallel_tune(rec):
    model = run_api(rec, 2, iters=ITERS)
    tl = timeline(model)
    assert model.violations == []
    assert_one_sync(tl)
    assert tl.lane_overlap() >= OVERLAP
    assert_lane_local(model)


@pytest.mark.parametrize("mutation", timeline_mutants.MUTATIONS)
def test_timeline_mutation_fails(rec, mutation, monkeypatch):
    """Each re-introduced defect (tests/timeline_mutants.py) fails what the tests above hold: more host
    syncs, or lanes waiting for each other."""
    timeline_mutants.apply(monkeypatch.setattr, mutation)
    model = run_adapter(rec, 3, iters=ITERS)
    tl = timeline(model)
    if mutation == "home-stream-pool":
        # the samples' copies queue on lane 0's stream: lanes 1.. wait for lane 0's earlier work
        assert tl.lane_overlap() < OVERLAP
        with pytest.raises(AssertionError, match="on lane stream"):
            assert_lane_local(model)
    else:
        assert tl.syncs_per_iteration() > 1
        with pytest.raises(AssertionError):
            assert_one_sync(tl)


def assert_issued_by_the_caller(model) -> None:
    """Every collective of the iterations issued by the thread that called backward (``main``), none
    by autograd's device threads (which run the lanes' hooks), while the backward ran."""
    coll = [op for op in model.ops if op.kind == "collective" and op.iteration >= 0]
    assert coll, "no collective in the iterations"
    assert {op.thread for op in coll} == {"main"}, sorted({(op.thread, op.name) for op in coll})
    assert any(op.phase == "backward" for op in coll), "nothing was issued during the backward"


@pytest.mark.parametrize("mutant", [False, True])
def test_timeline_overlap_issues_no_collective_from_a_device_thread(rec, monkeypatch, mutant):
    """--parallel_overlap on logical GPUs: the hooks on autograd's device threads only mark their
    buckets; the issuer node runs on the calling thread and issues them (on the communication streams,
    one host sync per iteration still). Mutant: the hooks issue, as before; the model names their thread."""
    from dpq.engine.exchange import BackwardExchange

    if mutant:
        monkeypatch.setattr(BackwardExchange, "_on_devices", lambda self: False)
        model = run_adapter(rec, 2, iters=1, overlap=True)
        with pytest.raises(AssertionError, match="autograd dev"):
            assert_issued_by_the_caller(model)
        return
    model = run_adapter(rec, 2, iters=1, overlap=True)
    assert model.violations == []
    assert [len(it.syncs) for it in timeline(model).iterations] == [1]
    assert_issued_by_the_caller(model)
    comm = {op.stream.sid for op in model.ops if op.kind == "collective"}
    assert comm.isdisjoint(lane_streams(model))  # on the communication streams


@pytest.mark.parametrize("mutant", [False, True])
def test_timeline_overlap_on_the_compile_path_runs_under_the_backward(monkeypatch, mutant):
    """torch.compile on (auto-round's default) with overlap: the lanes run the block forward uncompiled
    (Note [overlap needs gradients during the backward]), so the first bucket goes out while most of the
    backward is still to come on the devices, and the compiled block forward's region is not called on the
    lanes.
    Mutant: the lanes keep auto-round's compiled block forward; its backward is one autograd node, every
    gradient appears when it ends, and no backward kernel comes after the first collective."""
    from dpq.autoround import block_task

    if mutant:
        monkeypatch.setattr(block_task, "lane_block_forward", lambda ran, torch_compile: None)
    model = run_adapter(shared_block(compile=True), 2, iters=ITERS, overlap=True)
    assert model.violations == []
    parts = timeline(model).breakdown()  # the steady iteration, 70B-class block on RTX 3090s
    hidden = 1 - parts["exchange_exposed"] / parts["exchange_wire"]
    lanes_call_the_region = any(op.region == "block_forward" for op in model.ops)
    # measured when written (the sums in bf16): 0.87 uncompiled, 0.25 compiled (what the compiled one
    # hides is the other lane's collective waiting while a lane still computes)
    if mutant:
        assert hidden < 0.45 and lanes_call_the_region, hidden
    else:
        assert hidden > 0.6 and not lanes_call_the_region, hidden


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rec = record_block(compile=False)  # auto-round's own run, before the group exists (it would set up its DDP lane)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        res = {}
        for overlap in (None, True):
            model = run_adapter(rec, 1, iters=ITERS, overlap=overlap)  # 2 processes x 1 lane: world 2
            tl = timeline(model)
            coll = [op for op in model.ops if op.kind == "collective" and op.iteration >= 1]
            res[overlap] = {"syncs": [[(s.what, s.site) for s in it.syncs] for it in tl.iterations],
                            "violations": model.violations, "collectives": len(coll),
                            "threads": sorted({op.thread for op in coll}),
                            "on_lane_streams": sum(op.stream.sid in lane_streams(model) for op in coll
                                                   if op.phase in ("backward", "exchange"))}
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_timeline_torchrun_2x1(tmp_path):
    """Under torchrun (2 gloo processes x 1 lane): one host sync per iteration on every rank (the
    losses and each rank's checksum of the drawn indices come back in one copy of the gathered table),
    also with --parallel_overlap, whose exchange runs on the communication streams, issued by the
    calling thread."""
    ctx = worker_context()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    for r in range(2):
        for overlap, res in torch.load(Path(tmp_path) / f"rank{r}.pt").items():
            assert res["violations"] == []
            assert [len(s) for s in res["syncs"]] == [1] * ITERS, res["syncs"]
            assert all("_read_losses" in s[0][1] for s in res["syncs"])
            assert res["collectives"] > 0  # the exchange crossed the processes
            if overlap:  # --parallel_overlap under torchrun: the caller issues, on the communication streams
                assert res["threads"] == ["main"] and res["on_lane_streams"] == 0, res
