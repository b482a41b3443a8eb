"""Memory as it is allocated (issue 19, item 4): what the run holds is gone before the allocator's
cache is emptied, mirrors hold nothing on home, lane streams are the run's fixed set, and only the
devices a run may use are queried."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dpq import mirror, tune_loop
from dpq.session import SessionConfig, run
from tests.test_distributed import Block, make_task


@pytest.mark.parametrize("fail", [False, True])
def test_the_engine_lets_go_before_the_cache_is_emptied(monkeypatch, fail):
    """The optimizers (holding every lane's tuned values), the flat gradient buffers and the sign
    exchange's scratch are freed before ReplicaSet.close empties the cache, on success and when a
    lane fails (the failed run's frames still reference the engine then)."""
    held: list[weakref.ref] = []
    real_init = tune_loop.TuneEngine.__init__

    def init(engine, *a, **kw):
        real_init(engine, *a, **kw)
        held.extend(weakref.ref(x) for x in (*engine.optimizers, *engine.buckets.buffers))
        held.extend(weakref.ref(p) for k in range(1, engine.replicas.world) for p in engine.replicas.tuned_params(k))

    alive_at_release: list[int] = []

    def release(devices):
        gc.collect()
        alive_at_release.append(sum(r() is not None for r in held))
        scratch = [r for r in held if r() is not None]
        assert not scratch, [type(r()).__name__ for r in scratch]

    monkeypatch.setattr(tune_loop.TuneEngine, "__init__", init)
    monkeypatch.setattr(mirror, "release_cached_memory", release)
    task = make_task("sign", Block())
    if fail:
        real_loss = task.start(None).lane_loss
        calls = []

        def loss(lane, module, indices):
            calls.append(1)
            if len(calls) > 4:
                raise RuntimeError("CUDA out of memory (injected)")
            return real_loss(lane, module, indices)

        spec = task.start(None)
        spec.lane_loss = loss
        task.start = lambda plan: spec
        with pytest.raises(RuntimeError, match="injected"):
            run(SessionConfig(world=2, devices=["cpu", "cpu"]), task)
    else:
        run(SessionConfig(world=2, devices=["cpu", "cpu"]), task)
    assert held and alive_at_release and alive_at_release[0] == 0


def test_lane_streams_are_the_runs_not_each_blocks():
    """Each block used to draw fresh streams from torch's pool (32 per device, round robin), and cuBLAS
    keeps a workspace per (handle, stream) for the process's life: two blocks at world 3 now use the
    same two lane streams (and, with the exchange on communication streams, the same three more: one per lane)."""
    from dpq.streams import release_run_streams
    from tests.stream_checker import StreamOrderChecker

    for overlap, lane_streams in ((None, 2), (True, 5)):
        with StreamOrderChecker() as chk:
            for _ in range(2):
                run(SessionConfig(world=3, devices=["cpu"] * 3, overlap=overlap), make_task("sign", Block()))
        assert chk.violations == []
        assert len(chk.streams) == 1 + lane_streams, [s.name for s in chk.streams]  # the default stream + the run's
        release_run_streams()


def test_nested_tensors_are_mirrored_onto_the_lane():
    """A tensor inside dicts and lists nested deeper than two levels used to be cloned by deepcopy on
    home's device; the mirror's copy is on the lane's (logical) device now, aliases intact."""
    from dpq.mirror import ReplicaSet
    from dpq.streams import make_lanes
    from tests.timeline_model import TimelineModel

    block = Block()
    deep = torch.arange(6.0)
    block.cfg = {"levels": [[{"t": deep, "again": [deep]}]]}
    with TimelineModel(2, seqlen=61) as model:
        model.place(block, "cpu:1")
        model.place(deep, "cpu:1")
        rs = ReplicaSet(block, make_lanes(["cpu:1", "cpu:2"]), ["v1", "v2", "scale"])
        mine = rs.modules[1].cfg["levels"][0][0]
        assert model.place_of(mine["t"]) == 2 and mine["again"][0] is mine["t"]
        assert torch.equal(mine["t"], deep) and rs.modules[0].cfg["levels"][0][0]["t"] is deep
        rs.close()


def test_auto_queries_no_device_it_drops(monkeypatch):
    """A free-memory query makes a CUDA context (hundreds of MB) on a device that had none: under auto
    the plan stops at the first lane whose mirror does not fit (it and those after are dropped), an
    explicit world still queries every lane (it names every reason)."""
    import dpq.plan as plan_mod
    import dpq.streams as dpq_streams
    from dpq.plan import PlanRefused, PlanRequest, resolve

    queried = []

    class Gpus(dpq_streams.Backend):
        type, accelerator, has_streams = "cuda", True, True

        def is_available(self):
            return True

        def device_count(self):
            return 4

        def mem_get_info(self, device):
            queried.append(device.index)
            return (10 if device.index == 2 else 1000), 1000  # cuda:2 is nearly full

        def can_access_peer(self, a, b):
            return True

    monkeypatch.setitem(dpq_streams._BACKENDS, "cuda", Gpus())
    monkeypatch.setattr(plan_mod, "check_device_exists", lambda d: None)
    plan = resolve(PlanRequest(world="auto", devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", mirror_bytes=100))
    assert plan.world == 2 and queried == [1, 2]
    queried.clear()
    with pytest.raises(PlanRefused, match="lane 2 on cuda:2"):
        resolve(PlanRequest(world=4, devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", mirror_bytes=100))
    assert queried == [1, 2, 3]
