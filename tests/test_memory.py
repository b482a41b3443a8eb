"""Memory as it is allocated (issue 19, item 4): what the run holds is gone before the allocator's
cache is emptied, mirrors hold nothing on home, lane streams are the run's fixed set, and only the
devices a run may use are queried."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

from dpq import mirror, tune_loop
from dpq.planning.spec import ParallelSpec
from dpq.session import SessionConfig, run
from dpqlab.timeline.record import TimelineModel
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
        held.extend(weakref.ref(p) for k in range(1, engine.replicas.local_lanes)
                    for p in engine.replicas.tuned_params(k))

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
            run(SessionConfig(ParallelSpec(2, ["cpu", "cpu"])), task)
    else:
        run(SessionConfig(ParallelSpec(2, ["cpu", "cpu"])), task)
    assert held and alive_at_release and alive_at_release[0] == 0


def test_lane_streams_are_the_runs_not_each_blocks():
    """Each block used to draw fresh streams from torch's pool (32 per device, round robin), and cuBLAS
    keeps a workspace per (handle, stream) for the process's life: two blocks at world 3 now use the
    same two lane streams (and, with the exchange on communication streams, the same three more: one per lane)."""
    from dpq.streams import release_run_streams
    from dpqlab.stream_checker import StreamOrderChecker

    for overlap, lane_streams in ((None, 2), (True, 5)):
        with StreamOrderChecker() as chk:
            for _ in range(2):
                run(SessionConfig(ParallelSpec(3, ["cpu"] * 3, overlap=overlap)), make_task("sign", Block()))
        assert chk.violations == []
        assert len(chk.streams) == 1 + lane_streams, [s.name for s in chk.streams]  # the default stream + the run's
        release_run_streams()


def test_nested_tensors_are_mirrored_onto_the_lane():
    """A tensor inside dicts and lists nested deeper than two levels used to be cloned by deepcopy on
    home's device; the mirror's copy is on the lane's (logical) device now, aliases intact."""
    from dpq.mirror import ReplicaSet
    from dpq.streams import make_lanes
    from dpqlab.timeline.record import TimelineModel

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


def _four_fake_gpus(monkeypatch, free_bytes, *, total: int, queried: list | None = None, peer: bool = True) -> None:
    """cuda:0..3 on a fake backend for the plan (every pair peer-capable unless ``peer`` is False, every
    device existing): ``mem_get_info`` answers ``(free_bytes(index), total)`` and appends each queried
    index to ``queried``."""
    import dpq.planning.lane_devices as lane_devices
    import dpq.streams as dpq_streams

    class Gpus(dpq_streams.Backend):
        type, accelerator, has_streams = "cuda", True, True

        def is_available(self):
            return True

        def device_count(self):
            return 4

        def mem_get_info(self, device):
            if queried is not None:
                queried.append(device.index)
            return free_bytes(device.index), total

        def can_access_peer(self, a, b):
            return peer or a == b

    monkeypatch.setitem(dpq_streams._BACKENDS, "cuda", Gpus())
    monkeypatch.setattr(lane_devices, "check_device_exists", lambda d: None)


def test_auto_queries_no_device_it_drops(monkeypatch):
    """A free-memory query makes a CUDA context (hundreds of MB) on a device that had none: under auto
    the plan stops at the first lane whose mirror does not fit (it and those after are dropped), an
    explicit world still queries every lane (it names every reason)."""
    from dpq.planning.plan import PlanRefused, PlanRequest, resolve

    queried = []
    _four_fake_gpus(monkeypatch, lambda k: 10 if k == 2 else 1000, total=1000, queried=queried)  # cuda:2 nearly full
    plan = resolve(PlanRequest(world="auto", devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", mirror_bytes=100))
    assert plan.local_lanes == 2 and queried == [1, 2]
    queried.clear()
    with pytest.raises(PlanRefused, match="lane 2 on cuda:2"):
        resolve(PlanRequest(world=4, devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", mirror_bytes=100))
    assert queried == [1, 2, 3]


# -- the price against what each lane allocates ---------------------------------------------------


@contextlib.contextmanager
def _branch(rec, compute: torch.dtype):
    """``rec`` in one of auto-round's CPU precision branches, built explicitly whatever this CPU
    made auto-round choose: the block and its pool in fp32 without autocast, or in bf16 under bf16
    autocast (auto-round casts the model to its amp dtype)."""
    import dataclasses

    from tests.conftest import cast_floating

    q, runner = rec.quantizer, rec.quantizer.block_forward
    saved = (q.model_context.amp, q.model_context.amp_dtype, runner.amp, runner.amp_dtype)
    amp = compute != torch.float32
    q.model_context.amp, q.model_context.amp_dtype = amp, compute
    runner.amp, runner.amp_dtype = amp, compute
    try:
        yield dataclasses.replace(
            rec, block=copy.deepcopy(rec.block).to(compute), fp_inputs=cast_floating(rec.fp_inputs, compute),
            fp_outputs=cast_floating(rec.fp_outputs, compute), input_others=cast_floating(rec.input_others, compute),
            q_inputs=cast_floating(rec.q_inputs, compute))
    finally:
        q.model_context.amp, q.model_context.amp_dtype, runner.amp, runner.amp_dtype = saved


@pytest.mark.parametrize("compute", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.explicit_bf16)],
                         ids=["fp32", "bf16_autocast"])
def test_the_plan_prices_what_every_lane_allocates(monkeypatch, compute):
    """A real auto-round block tuned through the adapter at world 3 on logical GPUs (the timeline
    model: home on device 1 with the block and its pool, mirrors on 2 and 3), every storage on each
    device tracked (``TimelineModel.live``/``peak``: what ops, copies and factories allocate there,
    views counted once). Per lane, home included, what the lane's device held at its peak beyond what
    it held when the session started is covered by the price the plan checked that lane with (before
    the margin), and the price is no more than 3x it; the runtime's terms (workspaces, NCCL) are 0 on
    these devices (``price_runtime``: cuda only). Home's price has no weights (the block is there) but
    the best-iteration snapshots; a mirror's has no snapshot."""
    from dpq import session
    from dpq.planning.plan import MARGIN
    from dpqlab.timeline.scenarios import record_block, run_adapter

    world, seen = 3, {}
    real_run = session.run

    def tracked_run(config, task, *, plan=None):
        model = TimelineModel.active
        seen["start"] = dict(model.live)
        model.reset_peaks()
        out = real_run(config, task, plan=plan)
        seen["peak"], seen["plan"] = dict(model.peak), out.plan
        return out

    monkeypatch.setattr(session, "run", tracked_run)
    with _branch(record_block(compile=False), compute) as rec:
        model = run_adapter(rec, world, iters=3)
    plan = seen["plan"]
    assert model.violations == [] and plan.local_lanes == world and len(plan.lane_bytes) == world
    for k in range(world):
        place = k + 1
        grown = seen["peak"].get(place, 0) - seen["start"].get(place, 0)
        priced = plan.lane_bytes[k] / MARGIN
        print(f"{compute} lane {k}: allocated {grown / 2**20:.2f} MiB at its peak, priced {priced / 2**20:.2f} MiB")
        assert 0 < grown <= priced <= 3 * grown, (k, grown, priced)


class _OneRankOfMany:
    """``torch.distributed`` as one rank of several sees it, for what the process-group communicator
    calls: messages go nowhere and receives keep what their buffers held (the bytes staged, not the values)."""

    isend = irecv = None

    class P2POp:
        def __init__(self, op, tensor, peer, group=None, tag=0):
            self.op, self.tensor, self.peer = op, tensor, peer

    @staticmethod
    def batch_isend_irecv(ops):
        return [type("Work", (), {"wait": lambda self: None})() for _ in ops]


def test_home_price_covers_what_the_process_group_stages_on_lane_0():
    """Under torchrun the process-group communicator stages on lane 0, per bucket: a copy of each
    local lane's buffer that is on another device, the (P-1) x L rows the other processes send and
    the ordered sum of its chunks. Measured on logical devices (rank 0 of 3 processes, 2 lanes on
    devices 1 and 2, one sign-path exchange of a block's tuned values): what device 1 allocates
    during the exchange is at least ``price_home``'s process-group term (the staging is held) and
    at most that plus its exchange term (the sign path's own scratch)."""
    from dpq.comm.comm_base import CommunicatorBase
    from dpq.comm.communicators import select_communicator
    from dpq.comm.process_group import ProcessGroupCommunicator
    from dpq.engine.exchange import GradBuckets, SignExchange
    from dpq.planning.plan import price_home
    from dpq.streams import make_lanes

    block = torch.nn.Sequential(torch.nn.Linear(40, 24, bias=False), torch.nn.Linear(24, 40, bias=False))
    n = sum(p.numel() for p in block.parameters())
    processes, lanes_here = 3, 2
    detail: dict = {}
    price_home(block, [], 8, lanes_here, processes=processes, lanes_elsewhere=1, detail=detail)
    with TimelineModel(lanes_here, seqlen=61) as model:
        lanes = make_lanes(["cpu:1", "cpu:2"])
        params = [[torch.nn.Parameter(torch.randn(size, device=lane.device)) for size in (n, n // 8)]
                  for lane in lanes]
        buckets = GradBuckets(params, lanes=lanes)
        for buf in buckets.buffers:
            buf.normal_()
        comm = ProcessGroupCommunicator.__new__(ProcessGroupCommunicator)
        CommunicatorBase.__init__(comm, lanes)
        comm._dist, comm.group, comm.inner = _OneRankOfMany, None, select_communicator(lanes)[0]
        comm.processes, comm.process_rank, comm.name, comm.p2p_bytes_sent = processes, 0, "pg-fake", 0
        start = model.live[1]
        model.reset_peaks()
        SignExchange(comm).exchange(buckets)
        grown = model.peak[1] - start
    assert detail["process_group"] <= grown <= detail["process_group"] + detail["exchange"], (grown, detail)


def test_home_is_checked_and_accelerator_lanes_carry_the_runtimes_allocations(monkeypatch):
    """With the block's price the plan checks home too (its share, gradient buffer, exchange scratch,
    staging, best snapshots), and on cuda lanes adds what the runtime allocates beside the tensors:
    cuBLAS workspaces per (handle, stream), the lane's own allocator pools, NCCL's buffers per rank
    and per send/recv peer (and NVLS unless NCCL_NVLS_ENABLE=0); under torchrun home carries the
    process group's communicator. A home without room refuses an explicit world (named as home) and
    makes 'auto' serial."""
    import dpq.planning.plan as plan_mod
    from dpq.planning.plan import (
        CUBLAS_WORKSPACE,
        NCCL_COMM,
        NCCL_NVLS,
        NCCL_PEER,
        STREAM_POOL,
        BlockPrice,
        PlanRefused,
        PlanRequest,
        price_runtime,
        resolve,
    )

    free = {0: 2**40, 1: 2**40, 2: 2**40, 3: 2**40}
    _four_fake_gpus(monkeypatch, free.__getitem__, total=2**40)
    monkeypatch.setattr(plan_mod, "choose_communicator", lambda devices: ("cupy-nccl", "test"))
    block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    price = BlockPrice(block, [torch.randn(1, 16, 64)], 8)
    gpu = torch.device("cuda", 1)
    cpu_terms, terms = {}, {}
    assert price_runtime(torch.device("cpu"), home=False, communicator="cupy-nccl", world=4, detail=cpu_terms) == 0
    price_runtime(gpu, home=False, communicator="cupy-nccl", world=4, overlap=True, detail=terms)
    assert terms == {"cublas": 2 * CUBLAS_WORKSPACE, "stream_pools": 2 * STREAM_POOL,
                     "nccl": NCCL_COMM + NCCL_NVLS + 3 * NCCL_PEER}
    price_runtime(gpu, home=True, communicator="torch-nccl", world=4, detail=terms)  # no send/recv
    assert terms == {"cublas": CUBLAS_WORKSPACE, "stream_pools": 0, "nccl": NCCL_COMM + NCCL_NVLS}
    price_runtime(gpu, home=True, communicator="local", world=1, processes=3, detail=terms)  # ProcessGroupNCCL
    assert terms["nccl"] == NCCL_COMM + NCCL_NVLS + 2 * NCCL_PEER
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    price_runtime(gpu, home=False, communicator="cupy-nccl", world=2, detail=terms)
    assert terms["nccl"] == NCCL_COMM + NCCL_PEER
    monkeypatch.delenv("NCCL_NVLS_ENABLE")

    devices = "cuda:0,cuda:1,cuda:2,cuda:3"
    plan = resolve(PlanRequest(world=4, devices=devices, home="cuda:0", price=price))
    run = [price_runtime(torch.device("cuda", k), home=k == 0, communicator="cupy-nccl", world=4) for k in range(4)]
    assert plan.lane_bytes == [price.home(4) + run[0]] + [price.mirror(4) + run[k] for k in (1, 2, 3)]
    assert run[0] < run[1]  # home's forward workspace and pool exist already
    free[0] = plan.lane_bytes[0] - 1
    with pytest.raises(PlanRefused, match=r"lane 0 on cuda:0: home \(lane 0\) needs"):
        resolve(PlanRequest(world=4, devices=devices, home="cuda:0", price=price))
    auto = resolve(PlanRequest(world="auto", devices=devices, home="cuda:0", price=price))
    assert auto.local_lanes == 1 and any("home (lane 0) needs" in r for r in auto.reasons)


def test_one_bucket_where_every_lane_has_the_memory(monkeypatch):
    """Note [one bucket where it fits]: the plan prices one bucket for the whole block on every lane and
    takes it where every device has the memory; where one lane lacks it, buckets as large as the
    largest tensor, the lane kept (the world does not change for it); across processes the largest
    tensor on every rank, whatever the memory."""
    import dataclasses

    import dpq.planning.plan as plan_mod
    from dpq.engine.exchange import Buckets
    from dpq.planning.plan import BlockPrice, PlanRequest, price_runtime, resolve

    free = {0: 2**40, 1: 2**40, 2: 2**40, 3: 2**40}
    _four_fake_gpus(monkeypatch, free.__getitem__, total=2**40)
    monkeypatch.setattr(plan_mod, "choose_communicator", lambda devices: ("cupy-nccl", "test"))
    # two 2048 x 2048 weights: the block (9.4M tuned values) is larger than its largest tensor
    block = torch.nn.Sequential(torch.nn.Linear(2048, 2048, device="meta"), torch.nn.Linear(2048, 2048, device="meta"))
    price = BlockPrice(block, [torch.empty(1, 16, 2048, device="meta")], 8)
    whole = dataclasses.replace(price, bucket_cap_elems=Buckets.BLOCK)
    assert whole.mirror(4) > price.mirror(4)
    devices = "cuda:0,cuda:1,cuda:2,cuda:3"
    plan = resolve(PlanRequest(world=4, devices=devices, home="cuda:0", price=price))
    assert plan.exchange.buckets is Buckets.BLOCK and "whole block" in plan.buckets_reason
    free[2] = whole.mirror(4) + price_runtime(torch.device("cuda", 2), home=False, communicator="cupy-nccl",
                                               world=4) - 1
    plan = resolve(PlanRequest(world=4, devices=devices, home="cuda:0", price=price))
    assert plan.local_lanes == 4 and plan.exchange.buckets is Buckets.LARGEST
    assert "does not fit cuda:2" in plan.buckets_reason
    free[2] = 2**40
    plan = resolve(PlanRequest(world=2, devices="cuda:0,cuda:1", home="cuda:0", price=price, processes=2))
    assert plan.exchange.buckets is Buckets.LARGEST and "across processes" in plan.buckets_reason
