"""The cost model behind ``auto``: formulas, the link probe, and the choice both ways on a simulated link."""

from __future__ import annotations

import pytest

from dpq.fallback_p2p import LocalCommunicator
from dpq.planning.cost_model import (
    ACHIEVABLE_FLOPS,
    AutoWorld,
    CostInputs,
    block_flops,
    choose_world,
    compute_from_iteration,
    exchange_seconds,
    predict,
    probe_link,
    wire_bytes,
)
from dpq.streams import make_lanes
from dpqlab.simulated_link import SimulatedLink


def test_predict_by_hand():
    c = CostInputs(compute_s=1.0, issue_s=0.01, tuned_elems=10**8, bandwidth_Bps=1e10, latency_s=1e-4,
                   policy="sign", buckets=10, setup_per_mirror_s=0.5)
    assert wire_bytes(4, 10**8) == pytest.approx(0.75 * 2.25e8)
    e = 20 * 1e-4 + 0.75 * 2.25e8 / 1e10
    assert exchange_seconds(4, c) == pytest.approx(e)
    p = predict(4, 50, c)
    assert p.per_iter_s == pytest.approx(0.25 + e)  # no overlap: all exposed
    assert p.seconds == pytest.approx(3 * 0.5 + 50 * (0.25 + e))
    assert predict(1, 50, c).seconds == pytest.approx(50 * 1.0)  # no exchange, no mirrors
    c.overlap = 1.0  # the backward (2/3 of 0.25 s) hides all but the last bucket's share
    assert predict(4, 50, c).per_iter_s == pytest.approx(0.25 + e / 10)
    c.issue_s = 0.1  # the issuing thread bounds it: 4 x 0.1 > 0.25
    assert predict(4, 50, c).parts["issue_s"] == pytest.approx(0.4)
    assert predict(4, 50, c).per_iter_s == pytest.approx(0.4 + e / 10)


@pytest.mark.parametrize("overlap,buckets", [(0.0, 1), (1.0, 8), (0.5, 4), (1.0, 1)])
@pytest.mark.parametrize("bw", [1e8, 1e9, 1e11])
def test_compute_from_iteration_inverts_predict(overlap, buckets, bw):
    c = CostInputs(compute_s=0.8, issue_s=1e-4, tuned_elems=10**7, bandwidth_Bps=bw, overlap=overlap, buckets=buckets)
    for world in (2, 4):
        t = predict(world, 1, c).per_iter_s
        assert compute_from_iteration(t, world, c) == pytest.approx(0.8, rel=1e-6)


def test_block_flops_8b_class():
    # Llama-3-8B block: 218 M linear params, 8 x 2048 tokens -> ~23 TFLOP per iteration (issue 10)
    n = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    f = block_flops(n, 8 * 2048, hidden=4096, seqlen=2048, samples=8)
    assert 22e12 < f < 24e12


def _link(world, gbps, latency=0.0):
    return SimulatedLink(LocalCommunicator(make_lanes(["cpu"] * world)), bandwidth_GBps=gbps, latency_s=latency)


def test_probe_link_measures_the_simulated_link():
    link = _link(2, 0.002, latency=0.004)  # 2 MB/s: 4 KB -> ~2 ms, 256 KB -> ~131 ms, plus 4 ms each
    try:
        latency, bw = probe_link(link, sizes=(2**10, 2**16), reps=3)
    finally:
        link.close()
    assert bw == pytest.approx(2e6, rel=0.3)
    assert latency == pytest.approx(0.004, abs=0.003)


def test_auto_picks_one_lane_when_the_exchange_dominates():
    link = _link(4, 0.005)  # 5 MB/s: a 2 M-value block's exchange takes ~1.3 s per iteration
    try:
        auto = AutoWorld(issue_s=1e-4, probe_sizes=(2**10, 2**14))
        choice = auto.choose(link, iters=20, compute_s=0.05, tuned_elems=2 * 10**6, label="block 0")
    finally:
        link.close()
    assert choice.world == 1
    assert "world 1 is fastest" in choice.reason
    assert auto.records[0]["predicted_s"][1] < auto.records[0]["predicted_s"][4]


def test_auto_picks_every_lane_when_compute_dominates():
    link = _link(4, 0.05)  # 50 MB/s
    try:
        auto = AutoWorld(issue_s=1e-4, probe_sizes=(2**10, 2**14))
        choice = auto.choose(link, iters=20, compute_s=5.0, tuned_elems=10**5, label="block 0")
        again = auto.choose(link, iters=20, compute_s=5.0, tuned_elems=10**5, label="block 1")
    finally:
        link.close()
    assert choice.world == 4 and again.world == 4
    assert len(auto.links) == 1  # probed once per run and lane set
    auto.measured("block 0", 26.0)
    assert auto.records[0]["measured_s"] == 26.0 and auto.records[1]["measured_s"] is None


def test_choose_world_prefers_fewer_lanes_on_a_tie_and_logs(caplog):
    c = CostInputs(compute_s=0.0, issue_s=0.0, tuned_elems=0, bandwidth_Bps=1.0)
    with caplog.at_level("INFO", logger="dpq.planning.cost_model"):
        assert choose_world([4, 2, 1], 10, c).world == 1
    assert "dpq auto: predicted block time" in caplog.text


def test_auto_says_what_one_process_per_lane_would_take():
    """Where the issuing thread is the bound (issue cost measured, compute small), auto's reason prices
    world processes x 1 lane (each its own issuing thread) and, >10% faster, says how to run it; where
    compute hides the issuing it prices it without the advice; before a measurement it says nothing."""
    issue_bound = CostInputs(compute_s=40e-3, issue_s=10e-3, tuned_elems=1, bandwidth_Bps=1e12)  # best: 2 lanes
    reason = choose_world([1, 2, 4], 10, issue_bound).reason
    assert "4 processes x 1 lane (torchrun)" in reason and "torchrun --nproc-per-node 4" in reason
    assert "--parallel_quantization 1" in reason
    compute_bound = CostInputs(compute_s=4.0, issue_s=10e-3, tuned_elems=1, bandwidth_Bps=1e12)
    reason = choose_world([1, 2, 4], 10, compute_bound).reason
    assert "4 processes x 1 lane (torchrun)" in reason and "torchrun --nproc" not in reason
    assert "processes x 1 lane" not in choose_world([1, 4], 10, CostInputs(4.0, 0.0, 1, 1e12)).reason


# -- through the real plan/session path (dpq.parallel_tune, world='auto', 4 CPU lanes) -----------


@pytest.fixture(scope="module")
def tiny_block():
    import torch

    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = TinyLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = build_tiny_llama(cfg)
    inputs, others = capture_block_inputs(model, calibration_samples(8, 8, vocab_size=256))
    yield model.model.layers[0], inputs[0], others[0]
    torch.set_num_threads(threads)


def _auto_tune(tiny_block, bandwidth_GBps: float, compute_s: float):
    import copy

    import dpq

    block, inputs, others = tiny_block
    links = []

    def wrap(comm):
        links.append(SimulatedLink(comm, bandwidth_GBps=bandwidth_GBps, latency_s=1e-4))
        return links[-1]

    auto = AutoWorld(compute_s=compute_s, probe_sizes=(2**10, 2**14), wrap=wrap)
    try:
        res = dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=3, batch_size=4,
                                world="auto", devices=["cpu"] * 4, auto_world=auto)
    finally:
        for link in links:
            link.close()
    return res, auto


def test_session_auto_picks_one_lane_when_the_exchange_dominates(tiny_block):
    res, auto = _auto_tune(tiny_block, bandwidth_GBps=2e-4, compute_s=1e-3)  # 200 KB/s, 1 ms of compute
    assert res.world == 1 and len(res.losses) == 3
    assert any("auto: predicted" in r and "world 1 is fastest" in r for r in res.plan_reasons)
    [rec] = auto.report()
    assert rec["world"] == 1 and rec["measured_s"] > 0 and rec["predicted_s"][1] < rec["predicted_s"][4]


def test_session_auto_picks_every_lane_when_compute_dominates(tiny_block):
    res, auto = _auto_tune(tiny_block, bandwidth_GBps=10.0, compute_s=100.0)  # a fast link, 100 s of compute
    assert res.world == 4 and len(res.losses) == 3
    assert any("world 4 is fastest" in r for r in res.plan_reasons)
    [rec] = auto.report()
    assert rec["world"] == 4 and rec["measured_s"] > 0


def test_compute_from_iteration_refuses_an_issue_bound_iteration():
    """When W x issue is most of the iteration the devices' time is hidden behind the thread: None."""
    c = CostInputs(compute_s=0.0, issue_s=0.01, tuned_elems=10**5, bandwidth_Bps=1e12)
    assert compute_from_iteration(0.085, 8, c) is None  # 8 x 10 ms = 80 ms of an 85 ms iteration
    assert compute_from_iteration(0.5, 8, c) is not None


def test_auto_uses_the_measured_issue_cost_and_stops_where_the_thread_binds():
    """AutoWorld without a given issue cost takes the previous block's measured one (accelerator
    lanes: the session passes the engine's). A block whose iterations the issuing thread bounded
    gives no compute estimate: the next block's comes from FLOPs, and with the measured issue the
    model keeps fewer lanes than it would with issue 0."""
    link = _link(4, 50.0)  # a fast link: the exchange is not what limits
    try:
        auto = AutoWorld(probe_sizes=(2**10, 2**14))
        assert auto.issue() == 0.0
        first = auto.choose(link, iters=10, compute_s=0.04, tuned_elems=10**5, label="block 0")
        assert first.world == 4  # issue 0: every lane
        # measured: 4 lanes x 10 ms of issue = the whole 40 ms iteration (issue-bound)
        auto.measured("block 0", 10 * 0.04, iters=10, world=4, issue_s=0.01)
        assert auto.issue() == 0.01 and auto.records[0]["issue_s"] == 0.01
        compute, where = auto.estimate_compute(flops=0.04 * ACHIEVABLE_FLOPS["cuda"], device_type="cuda")
        assert compute == pytest.approx(0.04) and "bound by the issuing thread" in where
        second = auto.choose(link, iters=10, compute_s=compute, tuned_elems=10**5, label="block 1")
        assert second.world == 2  # max(W x 10 ms, 40 ms / W): 20 ms at W = 2 beats 30 and 40 ms
        given = AutoWorld(issue_s=0.0, probe_sizes=(2**10, 2**14))
        given.measured("x", 1.0, iters=1, world=1, issue_s=0.5)
        assert given.issue() == 0.0  # a given issue cost is kept
    finally:
        link.close()


def test_auto_keeping_fewer_lanes_leaves_the_plan_as_resolved(tiny_block, monkeypatch):
    """The plan from resolve() is frozen: the lanes 'auto' kept, the communicator built for them, the
    choice's note and the step are the run's (dpq.session.LaneRun), and the result reports those."""
    import dataclasses

    import torch

    from dpq import session
    from dpq.planning.plan import ONE_LANE_EXCHANGE

    runs, real_run = [], session.run

    def run(*a, **kw):
        runs.append(real_run(*a, **kw))
        return runs[-1]

    monkeypatch.setattr(session, "run", run)
    res, _ = _auto_tune(tiny_block, bandwidth_GBps=2e-4, compute_s=1e-3)  # world 1 is fastest
    [done] = runs
    plan, ran = done.plan, done.ran
    assert plan.devices == [torch.device("cpu")] * 4 and plan.local_lanes == 4
    assert ran.devices == [torch.device("cpu")] and ran.local_lanes == ran.world == res.world == 1
    assert plan.communicator_reason != ONE_LANE_EXCHANGE
    assert (ran.communicator, ran.communicator_reason) == (res.communicator, res.communicator_reason) \
        == ("local", ONE_LANE_EXCHANGE)
    assert not any(n.startswith("auto: ") for n in plan.notes) and ran.notes[-1].startswith("auto: predicted")
    assert ran.said == res.plan_reasons and ran.step == res.step != ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.devices = ran.devices
