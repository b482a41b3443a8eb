"""dpq's stream ordering (contract 4, rules R0-R6 in dpq.streams), proven on CPU lanes.

Every test runs dpq under ``dpqlab.stream_checker.StreamOrderChecker``: lanes get logical
streams with vector clocks, every aten op is booked on its stream, and a read, write or free
without a happens-before edge fails. World 1, 2 and 4 tunes, the failure path (teardown in a
``finally``), sharded collections and per-item maps run clean; each mutation removes one wait
(or record) and the checker must fail.
"""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch

import dpq
from dpq import tune_loop as tl
from dpq.autoround import tune as ar_tune
from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs
from dpq.engine import phases
from dpq.mirror import ReplicaSet
from dpq.sharded import shard
from dpq.streams import Lane, make_lanes
from dpqlab.stream_checker import StreamOrderChecker, StreamOrderError

ITERS = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the shared 2-core box: OpenMP spinning under load costs far more than it gains on tiny blocks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    cfg = TinyLlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = build_tiny_llama(cfg)
    inputs, others = capture_block_inputs(model, calibration_samples(8, 16, vocab_size=256))
    return model.model.layers[0], inputs[0], others[0]


def _tune(tiny, world: int, **kw):
    block, inputs, others = tiny
    block = copy.deepcopy(block)
    res = dpq.parallel_tune(block, inputs, input_others=others, iters=ITERS, batch_size=4, world=world,
                            devices=["cpu"] * world, **kw)
    return block, res


class _Probe(phases.Observer):
    """Host syncs and scalar reads in each iteration's phases from its split to its readback (the step
    aside), and what the readback waited for."""

    def __init__(self, chk: StreamOrderChecker, monkeypatch) -> None:
        self.chk, self.per_call, self.readback_waits_for_all = chk, [], []
        self._at_split = (0, 0)
        real_copy = tl.HostCopy
        probe = self

        class HostCopy(real_copy):
            def tolist(self):
                # by now every lane has queued backward and the exchange after its loss; the
                # readback's event must not include them (item 6: it waits for the losses only)
                lanes = [s for s in chk.streams if s is not chk.default]
                if self._event is not None and lanes:
                    probe.readback_waits_for_all.append(
                        any(self._event.vc.get(s.sid, 0) >= s.vc[s.sid] for s in lanes))
                return super().tolist()

        monkeypatch.setattr(phases, "_OBSERVERS", [*phases.observers(), self])  # gone at the test's end
        monkeypatch.setattr(tl, "HostCopy", HostCopy)

    def phase_begin(self, name, owner, lane):
        if name == "split":
            self._at_split = (self.chk.host_syncs, self.chk.scalar_reads)

    def phase_end(self, name, owner, lane, error):
        if name == "readback" and error is None:
            syncs, reads = self._at_split
            self.per_call.append((self.chk.host_syncs - syncs, self.chk.scalar_reads - reads))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stream_checker_tune(tiny, monkeypatch, world):
    with StreamOrderChecker() as chk:
        probe = _Probe(chk, monkeypatch)
        block, res = _tune(tiny, world, debug_identical=world > 1)
        del block
        gc.collect()  # the frees of the mirrors and the replaced weights are checked too
    assert chk.violations == []
    assert res.world == world and len(res.losses) == ITERS
    assert len(chk.streams) == world  # lane 0 issues on the default stream (R0), lanes 1.. on their own
    # items 6 and 8: one host sync per iteration (the readback), no .item() on a sample index
    assert probe.per_call == [(1, 0)] * ITERS
    assert not any(probe.readback_waits_for_all)
    if world > 1:
        assert chk.waits > 0


def _failing_forward(monkeypatch, lane_index: int, at_call: int):
    """Lane ``lane_index``'s ``at_call``-th forward fails after it ran (it has read home's shared
    weights and the pool), as an out-of-memory in its loss would."""
    real_forward, real_make = ar_tune.lane_forward, ar_tune.make_lane_loss
    lane_of: dict[int, int] = {}
    calls = {"n": 0}

    def forward(runner, module, inputs, others, indices, *lane_and_data):
        out = real_forward(runner, module, inputs, others, indices, *lane_and_data)
        if lane_of.get(id(module)) == lane_index:
            calls["n"] += 1
            if calls["n"] >= at_call:
                raise RuntimeError("injected lane failure (stream checker)")
        return out

    def make_lane_loss(*a, **k):
        inner = real_make(*a, **k)

        def lane_loss(lane, module, indices):
            lane_of[id(module)] = lane.index
            return inner(lane, module, indices)

        return lane_loss

    monkeypatch.setattr(ar_tune, "lane_forward", forward)
    monkeypatch.setattr(ar_tune, "make_lane_loss", make_lane_loss)


def test_stream_checker_failure_path(tiny, monkeypatch):
    with StreamOrderChecker() as chk:
        _failing_forward(monkeypatch, lane_index=1, at_call=2)
        with pytest.raises(RuntimeError, match="injected lane failure"):
            _tune(tiny, 2)
        gc.collect()
    assert chk.violations == []


# -- sharded no-grad passes -----------------------------------------------------------------

class _StatBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        for m in (self.a, self.b):
            m.register_forward_hook(_stat_hook)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _stat_hook(module, args, output):
    x = args[0].reshape(-1, args[0].shape[-1]).float()
    if not hasattr(module, "mx"):
        module.mx, module.sq = x.abs().amax(0), (x * x).sum(0)
        return
    module.mx = torch.maximum(module.mx, x.abs().amax(0))
    module.sq += (x * x).sum(0)


SPEC = {"a": {"mx": "max", "sq": "sum"}, "b": {"mx": "max", "sq": "sum"}}


def _collect(world: int, fail_lane: int | None = None):
    """A sharded collection whose outputs home then uses (as the next block's inputs) and drops."""
    samples = [torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(16)]
    block = _StatBlock()

    def fwd(m, lane, a, b):
        outs = [m(torch.cat(samples[i:i + 4])) for i in range(a, b, 4)]
        if lane.index == fail_lane:
            raise RuntimeError("lane died")
        return [o for out in outs for o in out.split(1)]

    with torch.no_grad():
        out = shard.sharded_collection(block, make_lanes(["cpu"] * world), len(samples), fwd, SPEC, align=4)
        home_use = torch.cat(out).sum() + block.a.mx.sum() + block.b.sq.sum()  # home reads lane results
        out[0].mul_(2)  # and writes one (auto-round moves cached outputs in place)
    del out
    gc.collect()
    return home_use


def _forward_fresh_inputs(world: int):
    """shard_forward over mirrors that already exist, on inputs home produced just before
    (the previous block's outputs, as in auto-round's block-by-block collection)."""
    block = _StatBlock()
    lanes = make_lanes(["cpu"] * world)
    replicas = ReplicaSet(block, lanes, tuned=())
    base = torch.randn(16, 5, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        samples = list((base * 1.5).split(1))  # written on the current stream after the mirrors were built

        def fwd(m, lane, a, b):
            return [o for i in range(a, b, 4) for o in m(torch.cat(samples[i:i + 4])).split(1)]

        out = shard.shard_forward(replicas.modules, lanes, len(samples), fwd, align=4)
        total = torch.cat(out).sum()
    replicas.close(collect=False)
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_stream_checker_shard_forward(world):
    with StreamOrderChecker() as chk:
        _forward_fresh_inputs(world)
    assert chk.violations == []


@pytest.mark.parametrize("world", [2, 4])
def test_stream_checker_sharded_collection(world):
    with StreamOrderChecker() as chk:
        _collect(world)
    assert chk.violations == []
    with StreamOrderChecker() as chk, pytest.raises(RuntimeError, match="lane died"):
        _collect(world, fail_lane=1)
    assert chk.violations == []


def test_stream_checker_map_over_lanes():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]

    def run(layer, lane):
        copy_ = layer if lane.index == 0 else shard.copy_to_lane(layer, lanes[0], lane)
        with torch.no_grad():
            copy_.weight.mul_(0.5)  # a search writing its copy's weight in place
        return copy_

    def collect(layer, result, lane):
        return shard.bring_home(result, result, layer, lane_device=lane.device, home_device=lane.device)

    with StreamOrderChecker() as chk:
        lanes = make_lanes(["cpu"] * 2)
        homes = shard.map_over_lanes(layers, lanes, run, collect=collect)
        with torch.no_grad():
            total = sum(h.weight.sum() for h in homes)
        del homes
        gc.collect()
    assert chk.violations == [] and torch.isfinite(total)


@pytest.mark.parametrize("name", ["local", "p2p"])
@pytest.mark.parametrize("policy", ["full", "sign"])
def test_stream_checker_exchange(name, policy):
    """Communicators and exchanges on their own: lanes write grads, exchange, read them, home reads them."""
    from dpq.comm.communicators import select_communicator
    from dpq.engine.exchange import FullSumExchange, GradBuckets, SignExchange

    with StreamOrderChecker() as chk:
        lanes = make_lanes(["cpu"] * 3)
        params = []
        for lane in lanes:
            with lane.issue():
                params.append([torch.nn.Parameter(torch.zeros(37)), torch.nn.Parameter(torch.zeros(5, 3))])
        buckets = GradBuckets(params, bucket_cap_elems=40, lanes=lanes)
        buckets.attach()
        for k, (lane, ps) in enumerate(zip(lanes, params, strict=True)):
            with lane.issue():  # what backward does: accumulate into the bucket views on the lane's stream
                for p in ps:
                    p.grad.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
        comm = select_communicator(lanes, prefer=name)[0]
        (FullSumExchange if policy == "full" else SignExchange)(comm).exchange(buckets)
        for lane, ps in zip(lanes, params, strict=True):
            with lane.issue():  # the step reads its own lane's reduced grads
                for p in ps:
                    p.data.add_(p.grad)
        home = [lane.hand_home(ps[0].detach()) for lane, ps in zip(lanes, params, strict=True)]
        assert all(torch.equal(home[0], h) for h in home[1:])
        del buckets, params, home
        gc.collect()
    assert chk.violations == []


# -- mutations: remove one wait, the checker must fail -----------------------------------------

@contextlib.contextmanager
def _disabled(owner, name: str):
    real = getattr(owner, name)
    setattr(owner, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _only_during(monkeypatch, owner, method: str, disable_owner, disable_name: str) -> None:
    """``owner.method`` runs with ``disable_owner.disable_name`` turned into a no-op (one wait removed)."""
    real = getattr(owner, method)

    def mutated(*a, **k):
        with _disabled(disable_owner, disable_name):
            return real(*a, **k)

    monkeypatch.setattr(owner, method, mutated)


def _outside_lanes_during(monkeypatch, owner, method: str) -> None:
    """``owner.method`` runs with ``Lane.issue`` a no-op: its lane work lands on the current stream."""
    real = getattr(owner, method)

    def mutated(*a, **k):
        issue = Lane.issue
        Lane.issue = lambda self: contextlib.nullcontext()
        try:
            return real(*a, **k)
        finally:
            Lane.issue = issue

    monkeypatch.setattr(owner, method, mutated)


def _private_lane0(monkeypatch):
    """Item 1's defect: lane 0 on a fresh stream of its own, which nothing orders with home."""
    import dpq.session as session

    def make_lanes_private(devices):
        lanes = make_lanes(devices)
        lanes[0].stream = lanes[0].backend.new_stream(lanes[0].device)
        return lanes

    monkeypatch.setattr(session, "make_lanes", make_lanes_private)


MUTATIONS = {
    # item 1: lane 0 does not issue on the current stream
    "lane0-private-stream": (_private_lane0, "tune"),
    # item 2: the mirror is copied from home before the lane waits for the current stream
    "mirror-copy-before-wait": (lambda mp: _only_during(mp, ReplicaSet, "__init__", Lane, "wait_for_current"),
                                "tune"),
    # item 3: the identical-state check reads the lanes' parameters while their steps may be queued
    "identical-check-without-wait": (
        lambda mp: _only_during(mp, ReplicaSet, "check_identical", Lane, "current_waits_for_me"), "tune"),
    # R6: the lanes' losses copied to the host on the current stream instead of each lane's own
    "loss-readback-on-current": (lambda mp: _outside_lanes_during(mp, tl.TuneEngine, "queue_readback"), "tune"),
    # item 1 (block end) / R5: teardown on the failure path without joining the lanes
    "teardown-without-join": (lambda mp: mp.setattr(ReplicaSet, "join_lanes", lambda self: None), "failure"),
    # item 5: collection outputs handed home without record_stream (home uses them after the pass)
    "collection-outputs-not-recorded": (lambda mp: mp.setattr(Lane, "record_on_current", lambda *a: None),
                                        "collection"),
    # R1 in the sharded passes: a lane forwards home's inputs without waiting
    "shard-forward-without-wait": (
        lambda mp: _only_during(mp, shard, "shard_forward", Lane, "wait_for_current"), "forward"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_stream_checker_mutation_fails(tiny, monkeypatch, mutation):
    apply, scenario = MUTATIONS[mutation]
    with pytest.raises(StreamOrderError), StreamOrderChecker() as chk:
        apply(monkeypatch)
        if scenario == "tune":
            _tune(tiny, 2, debug_identical=True)
        elif scenario == "failure":
            _failing_forward(monkeypatch, lane_index=1, at_call=2)
            try:
                _tune(tiny, 2)
            except RuntimeError as err:
                if "injected lane failure" not in str(err):
                    raise
            gc.collect()
        elif scenario == "forward":
            _forward_fresh_inputs(2)
        else:
            _collect(2)
    assert chk.violations, mutation
    print(f"{mutation}: {chk.violations[0]}")
