"""Memory as it is allocated (issue 19, item 4): what the run holds is gone before the allocator's
cache is emptied, mirrors hold nothing on home, lane streams are the run's fixed set, and only the
devices a run may use are queried."""

from __future__ import annotations

import gc
import weakref

import pytest

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
