"""The iteration's phases (dpq.engine.phases): the order run_loop's engine goes through them, what an observer
sees of them, and the watchdog's ``doing`` while each runs."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from dpq.engine import phases
from dpq.engine.exchange import SignExchange
from dpq.tune_loop import iteration
from tests.test_tune_loop import make_engine


class Seen(phases.Observer):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def phase_begin(self, name, owner, lane):
        self.events.append(("begin", name, lane, getattr(owner, "doing", None)))

    def phase_end(self, name, owner, lane, error):
        self.events.append(("end", name, lane, type(error).__name__ if error else None))

    def exchange_begin(self, policy, bucket, numel):
        self.events.append(("bucket", bucket, numel))

    def buckets_laid_out(self, buckets, cap):
        self.events.append(("buckets", len(buckets.bucket_ranges), cap))


def _top(events) -> list[str]:
    """The engine's own phases in order (a lane's forward and the runtime's inner phases left out)."""
    inner = {"grads", "exchange finish", "exchange wait", "issuer", "loss gather", "identical check"}
    return [e[1] for e in events if e[0] == "begin" and e[2] is None and e[1] not in inner]


@pytest.mark.parametrize("micro", [None, 2])
def test_an_iteration_is_its_phases_in_order(micro):
    """One observer sees split, each micro-step's forward and backward (the readback queued before the
    last backward), the exchange (after the backward: overlap off here) and the readback; every begin
    has its end; each lane's forward is a phase of its global lane; the watchdog's doing is the phase
    while it runs, and the loop's again after it."""
    engine, _ = make_engine(2, "sum" if micro else "mean", micro_batch=micro)
    engine.policy.plan = dataclasses.replace(engine.policy.plan, overlap=False)
    seen = Seen()
    with phases.observing(seen):
        iteration(engine, [3, 9, 1, 14, 0, 7, 5, 11])  # micro-batch 2: each lane's 4 samples in 2 micro-steps
        engine.step()
    steps = 2 if micro else 1
    assert _top(seen.events) == ["split", *["forward", "backward"] * (steps - 1), "forward", "readback queue",
                                 "backward", "exchange", "readback", "step"]
    begins = [e[1:3] for e in seen.events if e[0] == "begin"]
    ends = [e[1:3] for e in seen.events if e[0] == "end"]
    assert sorted(begins, key=repr) == sorted(ends, key=repr)
    assert all(e[3] is None for e in seen.events if e[0] == "end")
    lanes = [e[2] for e in seen.events if e[0] == "begin" and e[1] == "forward" and e[2] is not None]
    assert lanes == [0, 1] * steps
    doing = {e[1]: e[3] for e in seen.events if e[0] == "begin" and e[2] is None and e[1] != "grads"}
    assert all(doing[name] == (name, None) for name in ("split", "backward", "exchange", "readback", "step"))
    lane_doing = [e[3] for e in seen.events if e[0] == "begin" and e[1] == "forward" and e[2] is not None]
    assert lane_doing == [("forward", g) for g in [0, 1] * steps]  # the watchdog's "lane N's forward"
    assert engine.doing == ("loop", None)  # after the phases: the loop's own work again
    numel = engine.buckets.numel  # the Toy: one weight, one bucket
    assert [e for e in seen.events if e[0] == "bucket"] == [("bucket", 0, numel)]


def test_an_observer_that_raises_fails_the_phase_and_the_others_see_it_end():
    """Fault injection's way in: an observer raising as a lane's forward begins fails the iteration there;
    an observer registered before it sees that phase end with the error."""

    class Fails(phases.Observer):
        def phase_begin(self, name, owner, lane):
            if name == "forward" and lane == 1:
                raise RuntimeError("injected")

    engine, _ = make_engine(2)
    seen = Seen()
    with phases.observing(seen), phases.observing(Fails()), pytest.raises(RuntimeError, match="injected"):
        iteration(engine, [3, 9, 1, 14])
    assert ("end", "forward", 1, "RuntimeError") in seen.events
    assert ("end", "forward", None, "RuntimeError") in seen.events
    assert phases.observers() == []


def test_the_bucket_cap_an_observer_asks_for_lays_the_buckets_out():
    """The timeline model records one tuned tensor per bucket: an observer's cap of 1 gives every tensor a
    bucket, and the observers hear the layout."""

    class OnePerTensor(phases.Observer):
        def bucket_cap(self, sizes, cap):
            return 1

    seen = Seen()
    with phases.observing(OnePerTensor()), phases.observing(seen):
        engine, _ = make_engine(3, exchange_cls=SignExchange)
    assert engine.buckets is not None and len(engine.buckets.bucket_ranges) == 1  # the Toy has one tensor
    assert ("buckets", 1, 1) in seen.events
    assert torch.equal(engine.buckets.buffers[0], torch.zeros_like(engine.buckets.buffers[0]))


class Exchanged(phases.Observer):
    """The exchange's own events, in order: its buckets, their steps, the gradient hooks and the link's wait."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def exchange_begin(self, policy, bucket, numel):
        self.events.append(("bucket", bucket))

    def exchange_end(self, policy, bucket, numel, error):
        self.events.append(("bucket end", bucket))

    def exchange_step_begin(self, policy, bucket, step):
        self.events.append(("step", bucket, step))

    def exchange_step_end(self, policy, bucket, step, error):
        self.events.append(("step end", bucket, step))

    def bucket_waits(self, policy, bucket, marks):
        self.events.append(("waits", bucket, marks))
        return marks

    def gradient_hook_begin(self, exchange, lane, param):
        self.events.append(("hook", lane, param))

    def gradient_hook_end(self, exchange, lane, param, error):
        self.events.append(("hook end", lane, param))

    def phase_begin(self, name, owner, lane):
        if name == "exchange wait":
            self.events.append(("wait",))


def _tuned(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for k in range(len(engine.lanes)) for p in engine.replicas.tuned_params(k)]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_exchange_tells_its_steps_hooks_and_wait_and_changes_no_bit(overlap):
    """What benchmarks/overlap.py --breakdown times: each bucket's three steps inside its exchange, each
    lane's gradient hook (overlap on CPU lanes: the last one issues the bucket), and the wait for the
    last collective; the run with an observer is bitwise the run without."""
    runs = {}
    for observed in (False, True):
        engine, _ = make_engine(2, exchange_cls=SignExchange)
        engine.policy.plan = dataclasses.replace(engine.policy.plan, overlap=overlap)
        seen = Exchanged()
        with phases.observing(seen) if observed else contextlib.nullcontext():
            iteration(engine, [3, 9, 1, 14])
            engine.step()
        runs[observed] = (_tuned(engine), seen.events)
    (plain, _), (watched, events) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))
    steps = [("step", 0, s) for s in ("reduce", "update_owned", "gather")]
    exchanged = [("bucket", 0), ("waits", 0, None), *[e for s in steps for e in (s, ("step end", *s[1:]))],
                 ("bucket end", 0)]
    if overlap:  # autograd runs the last lane's backward first; lane 0's hook completes the bucket and issues it
        assert events == [("hook", 1, 0), ("hook end", 1, 0), ("hook", 0, 0), *exchanged, ("hook end", 0, 0),
                          ("wait",)]
    else:
        assert events == [*exchanged, ("wait",)]
