"""dpq.comm.comm_streams: the exchange on a second stream per lane, its ordering checked with logical streams."""

from __future__ import annotations

import pytest
import torch

from dpq.comm.comm_streams import CommStreams, comm_lanes
from dpq.engine.exchange import ExchangePlan, FullSumExchange, GradBuckets, SignExchange, bucket_layout
from dpq.fallback_p2p import LocalCommunicator
from dpq.mirror import ReplicaSet
from dpq.streams import make_lanes
from dpq.tune_loop import TuneEngine, iteration
from dpqlab.stream_checker import StreamOrderChecker, StreamOrderError

NAMES = ["l1.weight", "l1.bias", "l2.weight", "l2.bias", "l3.weight"]


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


DATA = [torch.randn(2, 6, generator=torch.Generator().manual_seed(i)) for i in range(12)]
TARGET = [torch.randn(2, 4, generator=torch.Generator().manual_seed(40 + i)) for i in range(12)]


def lane_loss(lane, module, indices):
    x = torch.cat([DATA[i] for i in indices])
    return torch.nn.functional.mse_loss(module(x), torch.cat([TARGET[i] for i in indices]))


def tune(world: int, policy, *, streams: bool, overlap: bool, iters: int = 3):
    """(lane 0's tuned values, the checker's violations) after ``iters`` iterations (a violation is
    raised at the op that made it; the run stops there)."""
    chk = StreamOrderChecker()
    try:
        return _tune(chk, world, policy, streams, overlap, iters), chk.violations
    except StreamOrderError:
        return None, chk.violations


def _tune(chk, world, policy, streams, overlap, iters):
    with chk:
        lanes = make_lanes(["cpu"] * world)
        comm = CommStreams(LocalCommunicator(comm_lanes(lanes)), lanes) if streams else LocalCommunicator(lanes)
        rs = ReplicaSet(MLP(), lanes, NAMES)
        try:
            engine = TuneEngine(rs, lane_loss, lambda m: (torch.optim.SGD(
                [dict(m.named_parameters())[n] for n in NAMES], lr=0.05), None),
                policy(comm, ExchangePlan.overlapped(policy.name, overlap)),
                sample_numel=lambda i: DATA[i].numel())
            engine.buckets = GradBuckets([rs.tuned_params(k) for k in range(world)], bucket_cap_elems=100,
                                         lanes=lanes)  # several buckets
            g = torch.Generator().manual_seed(3)
            for _ in range(iters):
                iteration(engine, torch.randperm(12, generator=g)[:6].tolist())
                engine.step()
            out = [p.detach().clone() for p in rs.tuned_params(0)]
        finally:
            getattr(comm, "join", lambda: None)()  # C4, as the session does
            rs.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("policy", [SignExchange, FullSumExchange])
@pytest.mark.parametrize("overlap", [True, False])
def test_comm_streams_are_ordered_and_change_no_bit(world, policy, overlap):
    got, violations = tune(world, policy, streams=True, overlap=overlap)
    assert violations == []
    want, plain_violations = tune(world, policy, streams=False, overlap=overlap)
    assert plain_violations == []
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("mutant,overlap", [("no join before the bucket (C1)", False),
                                            ("no join at the end (C2)", True), ("no join at the end (C2)", False)])
def test_a_missing_join_is_caught(monkeypatch, mutant, overlap):
    """Each join is needed: without it the checker reports a race. (C1 with overlap on is also kept
    by the gradient hooks, which make the communication stream wait for the stream each gradient
    was accumulated on; after the backward only begin_bucket does it.)"""
    if mutant.startswith("no join before"):
        monkeypatch.setattr(CommStreams, "begin_bucket", lambda self, marks=None: None)
    else:
        monkeypatch.setattr(CommStreams, "join", lambda self: None)
    _, violations = tune(2, SignExchange, streams=True, overlap=overlap, iters=2)
    assert violations, "the checker saw nothing"


def test_comm_lanes_have_their_own_streams():
    with StreamOrderChecker():
        lanes = make_lanes(["cpu"] * 2)
        comms = comm_lanes(lanes)
        assert [c.device for c in comms] == [lane.device for lane in lanes]
        assert all(c.stream is not None and c.stream is not lane.stream for c, lane in zip(comms, lanes, strict=True))
    assert [c.stream for c in comm_lanes(make_lanes(["cpu"] * 2))] == [None, None]  # CPU: no streams, nothing
    with pytest.raises(ValueError, match="2 communication lanes for 3 lanes"):
        CommStreams(LocalCommunicator(make_lanes(["cpu"] * 2)), make_lanes(["cpu"] * 3))


def test_parallel_tune_with_overlap_on_lanes_with_streams():
    """dpq.parallel_tune(overlap=True) on lanes with (logical) streams: the session runs the
    exchange over CommStreams, stream order is clean, and the result is bitwise the run without."""
    import copy

    import dpq
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    model = build_tiny_llama(TinyLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
    inputs, others = capture_block_inputs(model, calibration_samples(8, 8))
    out = {}
    for overlap in (True, False):
        with StreamOrderChecker() as chk:
            block = copy.deepcopy(model.model.layers[0])
            res = dpq.parallel_tune(block, inputs[0], input_others=others[0], iters=3, batch_size=4, world=2,
                                    devices=["cpu", "cpu"], overlap=overlap, seed=0)
        assert chk.violations == []
        out[overlap] = (res, len(chk.streams), {k: v.clone() for k, v in block.state_dict().items()})
    (res, streams, state), (plain, plain_streams, plain_state) = out[True], out[False]
    assert "second stream per lane" in res.communicator_reason and res.communicator.endswith("+comm-streams")
    assert streams == plain_streams + 2  # a communication stream per lane
    assert res.losses == plain.losses
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)


@pytest.mark.parametrize("policy", [SignExchange, FullSumExchange])
@pytest.mark.parametrize("mutant", [False, True])
def test_the_issuers_marks_order_each_bucket(monkeypatch, policy, mutant):
    """Accelerator lanes' overlap (dpq.engine.exchange): the hooks only mark each lane's part of a bucket (an
    event on its stream) and the issuer node issues it, the communication streams waiting for those
    marks only (C1). Forced here on CPU lanes with logical streams: no race, the same bits. Mutant:
    the communication streams ignore the marks; the checker sees the race."""
    from dpq.engine.exchange import BackwardExchange

    monkeypatch.setattr(BackwardExchange, "_on_devices", lambda self: True)
    issued = []
    real_serve = BackwardExchange.serve
    monkeypatch.setattr(BackwardExchange, "serve", lambda bx: (real_serve(bx), issued.append(bx.issued_in_backward)))
    if mutant:
        real_begin = CommStreams.begin_bucket
        monkeypatch.setattr(CommStreams, "begin_bucket", lambda self, marks=None: None if marks else real_begin(self))
    got, violations = tune(2, policy, streams=True, overlap=True, iters=2)
    if mutant:
        assert violations, "the checker saw nothing"
        return
    assert violations == [] and issued and all(n > 0 for n in issued)
    want, _ = tune(2, policy, streams=False, overlap=False, iters=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("full_wait", [False, True])
def test_the_observers_see_the_marks_and_may_ask_for_the_full_wait(monkeypatch, full_wait):
    """The GPU check's diagnosis (dpqlab/gpu_check/race.py) through the observer protocol: every lane's mark
    of every bucket is told (``bucket_marked``), the marks reach ``bucket_waits``, and an observer
    answering None (each bucket's communication streams wait for everything their lane queued:
    conservative) leaves the order clean and the bits those of the plain run."""
    from dpq.engine import phases
    from dpq.engine.exchange import BackwardExchange

    monkeypatch.setattr(BackwardExchange, "_on_devices", lambda self: True)  # the accelerator path (as above)
    marked, waited = [], []

    class Diagnosis(phases.Observer):
        def bucket_marked(self, exchange, bucket, lane, mark):
            marked.append((bucket, lane, mark is not None))

        def bucket_waits(self, policy, bucket, marks):
            waited.append(marks is not None and all(m is not None for m in marks))
            return None if full_wait else marks

    given = []
    real_begin = CommStreams.begin_bucket
    monkeypatch.setattr(CommStreams, "begin_bucket", lambda self, marks=None: (given.append(marks is not None),
                                                                               real_begin(self, marks)))
    with phases.observing(Diagnosis()):
        got, violations = tune(2, SignExchange, streams=True, overlap=True, iters=2)
    assert violations == []
    assert any(given) != full_wait  # what the communication streams waited for: the observer's answer
    params = dict(MLP().named_parameters())
    buckets = len(bucket_layout([params[n].numel() for n in NAMES], 100))
    assert buckets > 1 and all(ok for _, _, ok in marked)
    # each lane's part of each bucket marked once per backward (2 iterations)
    assert sorted((b, k) for b, k, _ in marked) == [(b, k) for b in range(buckets) for k in (0, 1) for _ in range(2)]
    assert any(waited)  # the issuer's buckets came with their marks
    want, _ = tune(2, SignExchange, streams=False, overlap=False, iters=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
