"""Several processes x local lanes (dpq.planning.distributed, the session across gloo groups).

One spawn of 4 processes, everything checked from its files: a tiny block tuned through
``session.run`` for a few iterations, with a pure-sign optimizer (sign exchange, mean
reduction) and with a full-sum one (momentum SGD, sum reduction with micro-steps, lanes
reaching different numbers of micro-steps), as 4x1, 2x2 and 2x1 (subgroups of the four),
compared bitwise with the same world as lanes of one process (this process, one intra-op
thread: CPU kernels may round differently with another thread count). Then the failure
paths: a refusal on one rank stops every rank with its reason; a rank that drew other sample
indices, raises or is killed stops every rank with an error naming it."""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import signal
import time
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from dpq import refusals, tune_loop
from dpq.engine.exchange import GradBuckets
from dpq.fallback_p2p import LocalCommunicator
from dpq.planning.distributed import ProcessSet, RankFailure, Topology
from dpq.planning.plan import PlanRefused
from dpq.planning.spec import ParallelSpec
from dpq.session import BlockTask, SessionConfig, run
from dpq.streams import make_lanes
from dpq.tune_loop import TuneSpec
from tests.processes import worker_context

NSAMPLES, ITERS = 12, 4
TIMEOUT_S = 120  # whole spawn (a bound, not the expected time); a process group collective times out after 20 s


class Block(torch.nn.Module):
    """Two frozen linear weights, each with a tuned additive value, and a tuned output scale."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 8, generator=g), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(8, 16, generator=g) / 4, requires_grad=False)
        self.v1 = torch.nn.Parameter(torch.zeros(16, 8))
        self.v2 = torch.nn.Parameter(torch.zeros(8, 16))
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.w1 + self.v1).T) @ (self.w2 + self.v2).T * self.scale


TUNED = ["v1", "v2", "scale"]
DATA = [torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(NSAMPLES)]
TARGET = [torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(100 + i)) for i in range(NSAMPLES)]


class SignStep(torch.optim.Optimizer):
    """Pure SignSGD: p -= lr * sign(grad) (the sign exchange hands it sign(sum) already)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.sign(p.grad), alpha=-group["lr"])


class Sampler:
    seed = 1234  # the same on every rank, as a tuner's seeded sampler is (a rank that differs is caught)

    def __init__(self, n: int, batch: int) -> None:
        self.rng, self.n, self.batch = random.Random(self.seed), n, batch

    def next_batch(self) -> list[int]:
        return self.rng.sample(range(self.n), self.batch)


# (pure sign, batch_size, gradient_accumulate_steps): the sign path with mean reduction over an
# uneven split (7 samples); momentum SGD with sum reduction and micro-steps of one sample over
# 5 samples, so at W=2 and W=4 some lanes (whole ranks, across processes) skip the last backward.
CASES = {"sign": (True, 7, 1), "full": (False, 1, 5)}


def make_task(case: str, block: Block | None = None, lane_loss=None) -> BlockTask:
    pure_sign, batch, accumulate = CASES[case]
    block = block if block is not None else Block()
    reduction = "sum" if accumulate != 1 else "mean"

    def loss(lane, module, indices):
        x, y = torch.cat([DATA[i] for i in indices]), torch.cat([TARGET[i] for i in indices])
        return torch.nn.functional.mse_loss(module(x), y, reduction=reduction)

    def optimizer(module):
        params = [dict(module.named_parameters())[n] for n in TUNED]
        return (SignStep(params, 0.01) if pure_sign else torch.optim.SGD(params, lr=0.01, momentum=0.9)), None

    spec = TuneSpec(tuned=TUNED, make_optimizer=optimizer, lane_loss=lane_loss or loss, sampler=Sampler,
                    best_params=lambda m: {n: dict(m.named_parameters())[n].detach().clone() for n in TUNED},
                    nsamples=NSAMPLES, sample_numel=lambda i: DATA[i].numel(), iters=ITERS, batch_size=batch,
                    gradient_accumulate_steps=accumulate)

    def finish(outcome, plan):
        with torch.no_grad():
            for n, v in outcome.best_params.items():
                dict(block.named_parameters())[n].copy_(v)
        return {n: dict(block.named_parameters())[n].detach().clone() for n in TUNED}

    return BlockTask(name=f"block-{case}", block=block, start=lambda plan: spec, finish=finish,
                     samples_per_iter=batch * accumulate, pure_sign=pure_sign)


def tune(case: str, world: int, processes: ProcessSet | None = None) -> dict:
    done = run(SessionConfig(ParallelSpec(world, ["cpu"] * world), processes=processes), make_task(case))
    out = done.outcome
    return {"losses": out.losses, "best_iter": out.best_iter, "values": done.result,
            "topology": dataclasses.astuple(done.topology), "communicator": done.ran.communicator,
            "communicator_reason": done.ran.communicator_reason}


@pytest.fixture(scope="module")
def reference(request) -> dict:
    """W=2 and W=4 as lanes of this process, under one intra-op thread as in the workers."""
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(1)
    return {world: {case: tune(case, world) for case in CASES} for world in (2, 4)}


# -- the processes ---------------------------------------------------------------------------


# One spawn of 4 processes holds every layout: W=4 as 4x1 (the default group), then each pair
# of ranks (a subgroup: ranks 0,1 and ranks 2,3, at the same time) as 2x2 (W=4) and 2x1 (W=2).
PAIRS = [[0, 1], [2, 3]]
LAYOUTS = {"4x1": (4, 1), "2x2": (2, 2), "2x1": (2, 1)}
# How each pair ends, mid-loop: its second rank raises (ranks 0,1) or is killed (ranks 2,3).
ENDING = {1: "raise", 3: "kill"}


class SmallBuckets(GradBuckets):
    """One bucket per tuned parameter here (64 elements at most each), so the overlapped
    exchange issues several collectives from backward hooks, in the same order on every rank."""

    made: ClassVar[list[int]] = []  # the bucket count of each one made

    def __init__(self, params_per_lane, bucket_cap_elems=None, lanes=None) -> None:
        # 64 whatever the exchange asks (without overlap it asks for buckets as large as the largest tensor)
        super().__init__(params_per_lane, 64, lanes)
        SmallBuckets.made.append(len(self.bucket_ranges))


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    tune_loop.GradBuckets = SmallBuckets  # this process only; the reference keeps one bucket
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=20))
    # every rank makes every group, in order; W=4 on a group of all four (not the default group),
    # so that its failure below (which destroys the group) leaves the pairs' groups alone
    groups = [dist.new_group(ranks) for ranks in PAIRS] + [dist.new_group([0, 1, 2, 3])]
    # grace 5 s (the default): with 2 s a live but descheduled rank on a loaded 2-core machine was
    # once named as silent (its report came later than the grace)
    procs = {"4x1": ProcessSet.detect(groups[2], grace_s=5.0),
             "pair": ProcessSet.detect(groups[rank // 2], grace_s=5.0)}
    result: dict = {}
    for name, (processes, lanes) in LAYOUTS.items():
        result[name] = {case: tune(case, lanes, procs["4x1" if processes == 4 else "pair"]) for case in CASES}
    if rank == 2:  # rank 2 draws other indices: every rank must stop at the first iteration, naming it
        Sampler.seed = 99
    try:
        tune("sign", 1, procs["4x1"])
    except RankFailure as err:
        result["drew"] = str(err)
    Sampler.seed = 1234
    # a refusal on a pair's second rank reaches the first before any work; the group goes on
    devices = ["cpu", "cpu"] if rank % 2 == 0 else ["cpu", "cuda:7"]  # well formed; no such lane here
    try:
        run(SessionConfig(ParallelSpec(2, devices), processes=procs["pair"]), make_task("sign"))
    except PlanRefused as err:
        result["refused"] = err.reasons
    result["buckets"] = set(SmallBuckets.made)
    torch.save(result, f"{out}/rank{rank}.pt")  # a killed rank's tuning is checked too
    _failing_run(rank, procs["pair"], result)
    torch.save(result, f"{out}/rank{rank}.pt")
    os._exit(3 if "failure" in result else 0)  # what a launcher sees: a rank that stopped exits non-zero


def _failing_run(rank: int, procs: ProcessSet, result: dict) -> None:
    """A pair's second rank raises (or its process dies) at its third lane-loss call: the pair stops."""
    block, calls = Block(), []
    before = {n: t.clone() for n, t in block.state_dict().items()}

    def loss(lane, module, indices):
        calls.append(1)
        if rank in ENDING and len(calls) == 3:
            if ENDING[rank] == "kill":
                os._exit(9)
            raise RuntimeError(f"boom on rank {rank}")
        x, y = torch.cat([DATA[i] for i in indices]), torch.cat([TARGET[i] for i in indices])
        return torch.nn.functional.mse_loss(module(x), y)

    t0 = time.monotonic()
    try:
        run(SessionConfig(ParallelSpec(1, ["cpu"]), processes=procs), make_task("sign", block, loss))
    except RankFailure as err:
        result["failure"] = str(err)
        result["seconds"] = time.monotonic() - t0
        result["restored"] = all(torch.equal(t, before[n]) for n, t in block.state_dict().items())


def _spawn(tmp_path) -> tuple[list[int | None], list[dict], float]:
    ctx = worker_context()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_worker, args=(r, store, str(tmp_path))) for r in range(4)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    results = [torch.load(tmp_path / f"rank{r}.pt") if (tmp_path / f"rank{r}.pt").exists() else {}
               for r in range(4)]
    return codes, results, time.monotonic() - t0


def _assert_same_run(got: dict, ref: dict) -> None:
    assert got["losses"] == ref["losses"]  # floats compared exactly: the same bits
    assert got["best_iter"] == ref["best_iter"]
    for n in TUNED:
        assert torch.equal(got["values"][n].view(torch.int32), ref["values"][n].view(torch.int32)), n


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    codes, results, seconds = _spawn(tmp)
    print(f"\n4 processes (4x1, 2x2, 2x1, refusal, failures): {seconds:.1f} s; the failing runs stopped after "
          f"{[round(r.get('seconds', 0), 1) for r in results]} s")
    return codes, results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_bitwise_equal(spawned, reference, layout):
    """W = processes x lanes tunes to the bits of W lanes in one process, on every rank."""
    _, results = spawned
    processes, lanes = LAYOUTS[layout]
    reference = reference[processes * lanes]
    assert Topology(*reference["sign"]["topology"]) == Topology.alone(processes * lanes)  # this process alone
    assert reference["sign"]["communicator"] == "local"
    assert reference["sign"]["losses"] != reference["full"]["losses"]  # two different runs compared
    for rank, got in enumerate(results):
        for case in CASES:
            group_rank = rank if processes == 4 else rank % 2
            assert Topology(*got[layout][case]["topology"]) == Topology(processes, group_rank, lanes)
            assert got[layout][case]["communicator"] == "pg-gloo"
            said = got[layout][case]["communicator_reason"]
            assert said.startswith(f"{processes} processes: local inside each, pg-gloo across them ("), said
            _assert_same_run(got[layout][case], reference[case])
        assert got["buckets"] == {3}  # several buckets exchanged across processes (from hooks: the sign case)


def test_refusal_on_one_rank_stops_every_rank(spawned):
    _, results = spawned
    for rank, got in enumerate(results):  # each pair's second rank refused its device list: both raised its reason
        first, second = PAIRS[rank // 2]
        assert any(r.startswith(f"rank {second}: ") and "cuda:7" in r for r in got["refused"]), got["refused"]
        assert not any(r.startswith(f"rank {first}: ") for r in got["refused"])


def test_rank_that_drew_other_indices_stops_every_rank(spawned):
    _, results = spawned
    for got in results:
        assert "dpq: process rank 2 drew other sample indices than rank 0" in got["drew"], got.get("drew")


def test_failing_rank_stops_every_rank(spawned):
    """Ranks 0,1: rank 1 raises; ranks 2,3: rank 3 is killed. The other rank of each pair exits
    non-zero within the bound, naming the rank (its global rank), its home block restored."""
    codes, results = spawned
    assert codes == [3, 3, 3, 9], (codes, [r.get("failure") for r in results])
    for rank, named in ((0, "the run failed on rank 1: RuntimeError: boom on rank 1"), (1, "the run failed on rank 1"),
                        (2, "rank 3 stopped answering")):
        assert results[rank]["failure"].startswith(f"dpq: {named}"), results[rank]["failure"]
        assert results[rank]["restored"]  # the home block exactly as before the failed run
        assert results[rank]["seconds"] < 15  # gloo sees a closed peer at once; then up to 5 s (grace) for reports


def test_lane_offset_is_the_process_rank_times_its_lanes():
    class Rank3(LocalCommunicator):
        process_rank = 3

    assert LocalCommunicator(make_lanes(["cpu"] * 2)).lane_offset == 0
    assert Rank3(make_lanes(["cpu"] * 2)).lane_offset == 6
    assert Topology(2, 1, 2).describe() == "world 4 = 2 processes x 2 lanes"
    assert Topology(1, 0, 1).describe() == "world 1 = 1 process x 1 lane"
    assert Topology.alone(3) == Topology(1, 0, 3) and Topology.alone(3).world == 3 and not Topology.alone(3).several
    assert Topology(2, 1, 2).several and Topology(2, 1, 2).world == 4 and Topology(2, 1, 2).lane_offset == 2


class Gathered(ProcessSet):
    """The agreement without processes: every rank's plan given."""

    def __init__(self, rank: int, plans: list) -> None:
        super().__init__(rank, len(plans), store=None, global_ranks=[10 + r for r in range(len(plans))])
        self.plans = plans

    def all_gather_object(self, value: object) -> list:
        assert value is self.plans[self.rank]
        return self.plans


def test_job_token_from_rank_0():
    from dpq.planning.distributed import RankPlan, agree

    plans = [RankPlan("auto", 1, []), RankPlan("auto", 1, [])]
    first, second = Gathered(0, plans), Gathered(1, plans)
    agree(first, plans[0], 8)  # rank 0 draws it; the gathered plans carry it to every rank
    agree(second, plans[1], 8)
    assert first.job and second.job == first.job and first._key(1) == f"dpq/{first.job}/failed/1"
    plans[0].job = "another"
    agree(first, plans[0], 8)
    assert first.job != "another"  # drawn once per job


def _agree(plans, rank=1, samples=8, pool=0):
    from dpq.planning.distributed import agree

    return agree(Gathered(rank, plans), plans[rank], samples, pool)


def test_agreement():
    from dpq.planning.distributed import RankPlan

    topology, notes = _agree([RankPlan("auto", 3, []), RankPlan("auto", 2, ["lane 2 does not fit"])])
    assert topology == Topology(2, 1, 2) and topology.lane_offset == 2
    assert notes == [refusals.auto_fewest_lanes(2, [11]), topology.describe()]
    assert notes[0].startswith("auto: every process runs 2 lanes, the fewest any rank has (rank 11)")
    topology, notes = _agree([RankPlan("auto", 4, []), RankPlan("auto", 4, [])], samples=6)
    assert topology.lanes == 3 and "so that every lane gets a sample" in notes[0]
    topology, notes = _agree([RankPlan("auto", 2, []), RankPlan("auto", 1, ["feature"], serial=True)])
    # serial on every rank: each rank alone on its home lane, also one whose own plan had more lanes
    assert topology == Topology.alone(1) and not topology.several
    assert notes == [refusals.serial_every_rank([11], "feature")]
    assert _agree([RankPlan("auto", 2, []), RankPlan("auto", 1, ["feature"], serial=True)], rank=0)[0] == \
        Topology.alone(1)
    assert notes[0].startswith("serial on every rank: rank 11 cannot split this block (feature)")
    with pytest.raises(PlanRefused) as refused:
        _agree([RankPlan(2, 0, ["a", "b"], refused=True), RankPlan(2, 2, []), RankPlan(2, 0, ["c"], refused=True)])
    assert refused.value.reasons == ["rank 10: a", "rank 10: b", "rank 12: c"]
    with pytest.raises(PlanRefused, match=r"different worlds \(rank 10: 2, rank 11: 'auto'\)"):
        _agree([RankPlan(2, 2, []), RankPlan("auto", 2, [])])
    with pytest.raises(PlanRefused, match=r"6 lanes \(3 processes x 2\) but only 5 samples") as refused:
        _agree([RankPlan(2, 2, [])] * 3, samples=5)
    assert refused.value.every_rank and "Fix: --batch_size 6 or more, or fewer lanes: --parallel_quantization 1 per " \
        "process" in refused.value.reasons[0]
    with pytest.raises(PlanRefused, match=r"3 lanes \(3 processes x 1\) but only 2 samples per iteration \(the "
                                          r"calibration data has 2 samples\).*Fix: --nsamples 3 or more"):
        _agree([RankPlan("auto", 2, [])] * 3, samples=2, pool=2)
    # issue 42, item 3: a reason every rank gave is said once, as one process says it; the others name their ranks
    with pytest.raises(PlanRefused) as refused:
        _agree([RankPlan(2, 0, ["x", "y"], refused=True), RankPlan(2, 0, ["x"], refused=True)])
    assert refused.value.reasons == ["x", "rank 10: y"]
    gpus = [RankPlan("auto", 2, [], host="a", devices=["cuda:0", "cuda:1"]),
            RankPlan("auto", 1, [], host="a", devices=["cuda:1"]),
            RankPlan("auto", 1, [], host="b", devices=["cuda:0"])]  # another host's cuda:0: fine
    with pytest.raises(PlanRefused) as refused:
        _agree(gpus)
    assert refused.value.reasons == [
        "ranks 10, 11 all plan lanes on cuda:1 of a: an accelerator belongs to one process. Fix: give each process "
        "its own devices (under torchrun: --parallel_devices cuda:$LOCAL_RANK, or one device list per process)"]


def test_ranks_that_drew_other_indices_are_named():
    """Across processes each lane sends a checksum of the iteration's indices with its losses;
    the engine names the process ranks whose draw differs from rank 0's (2 lanes per process)."""
    from types import SimpleNamespace

    from dpq.tune_loop import TuneEngine

    engine = SimpleNamespace(lanes=[None, None])
    TuneEngine._check_drawn(engine, [5.0, 5.0, 5.0, 5.0])
    with pytest.raises(RuntimeError, match="process rank 1, 2 drew other sample indices than rank 0"):
        TuneEngine._check_drawn(engine, [5.0, 5.0, 7.0, 5.0, 6.0, 6.0])


@pytest.mark.parametrize("device, shared", [("cuda:1", True), ("hpu:0", False), ("cpu", False)])
def test_agreement_counts_only_physical_accelerators(monkeypatch, device, shared):
    """What each rank tells the agreement about its lanes' devices: a cuda index names one GPU of
    the host, but every Gaudi process sees its own Gaudi as hpu:0 (the bridge maps LOCAL_RANK), and
    CPU lanes share the host; only the first may be refused as planned by two ranks."""
    from types import SimpleNamespace

    from dpq import session
    from dpq.planning.plan import Plan

    told = []

    def agree(procs, mine, samples, pool, asked):
        told.append(mine)
        return Topology.alone(1), []

    monkeypatch.setattr(session, "agree", agree)
    monkeypatch.setattr(session, "block_plan", lambda config, task: Plan([torch.device(device)]))
    task = SimpleNamespace(extra_reasons=[], samples_per_iter=8, pool_samples=None, asked_samples=None)
    session._agreed_plan(SessionConfig(ParallelSpec(1, [device])), task, procs=None, plan=None)
    assert told[0].devices == ([device] if shared else [])


class DictStore:
    """The store calls a ProcessSet makes (set, get, check), in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys) -> bool:
        return all(k in self.data for k in keys)


def test_the_others_wait_for_rank_0s_save_as_long_as_it_beats(monkeypatch):
    """Rank 0's save is not bounded by the collective timeout: the others wait on its heartbeat,
    get what it publishes, and count it lost only when it reported a failure or its beat stood
    still for the timeout."""
    import threading

    import dpq.planning.distributed as distributed

    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    store = DictStore()
    rank0, rank1 = ProcessSet(0, 2, store, timeout_s=0.5), ProcessSet(1, 2, store, timeout_s=0.5)
    rank0.beat("save")

    def slow_save():
        time.sleep(1.5)  # three times the timeout: a collective would have timed out
        rank0.publish("save", ["out/model-w4g128"])

    threading.Thread(target=slow_save).start()
    t0 = time.monotonic()
    assert rank1.await_rank0("save") == ["out/model-w4g128"] and time.monotonic() - t0 > 1.4
    time.sleep(0.2)
    assert not any(t.name == "dpq-save-heartbeat" for t in threading.enumerate())  # published: the beat ended

    rank0.beat("other")
    rank0._end_beat()  # rank 0 died in its save: its beat stands still
    with pytest.raises(dist.DistError, match=r"rank 0 stopped answering in its other \(no heartbeat for 0.5 s"):
        rank1.await_rank0("other")
    store.set(rank0._key(0), "1.0 raised OSError: disk full")
    with pytest.raises(dist.DistError, match="rank 0 failed in its third"):
        rank1.await_rank0("third")


def test_a_cancel_is_reported_and_named(monkeypatch):
    """A rank's cancel (reported by its watcher) is what the others name, and their exit says cancelled."""
    from dpq import cancel
    from dpq.planning.distributed import _failure_message

    store = DictStore()
    rank0, rank1 = ProcessSet(0, 2, store), ProcessSet(1, 2, store)
    rank1.report_cancel("SIGTERM")
    assert not rank0.cancelled_everywhere()
    reports = {0: "2.0 lost RuntimeError: closed", 1: store.get(rank1._key(1)).decode()}
    message, cause, kind = _failure_message(0, 2, reports, 5.0, True, lambda r: r)
    assert message.startswith("dpq: rank 1 was cancelled (SIGTERM)") and cause == signal.SIGTERM and kind == "cancelled"
    assert "Fix: rerun the whole job when it should run" in message
    rank0.report_cancel("SIGTERM")
    assert rank0.cancelled_everywhere()
    assert cancel.exit_status(cause) == 143
