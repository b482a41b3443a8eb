"""The timeline model replays the communicator the plan picks for the machine it prices.

On the presets of ``benchmarks/timeline.py`` (4 x RTX 3090, 8 x H100, each with ``auto-round-dp[cuda12]``:
CuPy's NCCL present) the plan picks a communicator by its own rules (``dpq.comm.communicators.choose_communicator``);
the model must record that communicator's own code (:class:`dpqlab.timeline.record.ModelCupyNccl`): its
staging allocations, its send/recv calls and its folds, not one collective per bucket.
"""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.timeline import MACHINES
from dpq.comm import communicators
from dpq.nccl_comm import CupyNcclCommunicator, TorchNcclCommunicator
from dpqlab.timeline.scenarios import recorded_run

ITERS = 2


def plan_choice_on(lanes: int, monkeypatch) -> str:
    """The plan's communicator for ``lanes`` distinct GPUs of a preset machine (its NCCL kinds installed)."""
    with monkeypatch.context() as m:
        for kind in (CupyNcclCommunicator, TorchNcclCommunicator):
            m.setattr(kind, "available", classmethod(lambda cls: True))
        return communicators.choose_communicator([f"cuda:{i}" for i in range(lanes)])[0]


@pytest.mark.parametrize("world", [2, 3])
def test_timeline_records_the_communicator_the_plan_picks(world, monkeypatch):
    model = recorded_run(False, world, ITERS)
    for _, _, lanes in MACHINES:
        assert model.communicators == [plan_choice_on(lanes, monkeypatch)]


def test_timeline_replays_cupy_nccls_canonical_order():
    """Per lane and bucket the canonical reduce-scatter's 2(W-1) send/recv host calls, one group kernel
    per lane (ending together) and W-1 fold adds on the lane's stream; the all-gather one call each."""
    world = 3
    model = recorded_run(False, world, ITERS)
    ops = [op for op in model.ops if op.iteration == 1 and op.bucket is not None]
    buckets = {op.bucket for op in ops}
    calls = Counter(op.name for op in ops if op.kind == "nccl_call")
    assert calls["nccl send (host call)"] == calls["nccl recv (host call)"] == len(buckets) * world * (world - 1)
    assert calls["nccl allGather (host call)"] == len(buckets) * world
    groups = Counter(op.group for op in ops if op.kind == "collective")
    assert set(groups.values()) == {world} and len(groups) == 2 * len(buckets)
    lane_streams = {lane.stream.sid for lane in model.lanes}
    folds = [op for op in ops if op.kind == "kernel" and op.name in ("aten::add", "aten::add_")
             and op.stream.sid in lane_streams and op.phase == "exchange"]
    assert len(folds) == len(buckets) * world * (world - 1)


def test_timeline_prices_one_process_per_lane():
    """Note [P processes x 1 lane]: the same record replayed with each lane issued by a process of its own
    (its own main thread and GIL): where the host is the bound (every host cost x 50) the iteration is
    shorter than one thread issuing both lanes, by at most the lane count, and each process's thread issues
    the ops of its lane only (every device op goes to the process of its stream's lane)."""
    from dpqlab.timeline.devices import GPUS, HOST
    from dpqlab.timeline.replay import Pricing, _process_threads, simulate
    from dpqlab.timeline.shapes import BLOCKS, RECORDED

    world = 2
    model = recorded_run(False, world, ITERS)
    slow = HOST.rebased(**{k: getattr(HOST, k) * 50 for k in ("eager_op_s", "view_op_s", "compiled_kernel_s",
                                                              "compiled_extern_s", "region_call_s", "wait_s")})
    one, spread = (simulate(model, Pricing(RECORDED, BLOCKS["8b"], GPUS["h100"], slow, processes=p))
                   for p in (1, world))
    assert one.seconds_per_iteration() / world <= spread.seconds_per_iteration() < 0.9 * one.seconds_per_iteration()
    # the same ops, each issued once: the host time per lane-iteration is unchanged
    assert spread.breakdown()["host_per_lane_iteration"] == pytest.approx(one.breakdown()["host_per_lane_iteration"],
                                                                          rel=0.05)
    threads = _process_threads(model.ops, model, world)
    lane_of_place = {lane.stream.place: k for k, lane in enumerate(model.lanes)}
    for op in model.ops:
        if op.stream is not None and op.stream.place in lane_of_place:
            assert threads[op.id].endswith(f"#{lane_of_place[op.stream.place]}"), (op.name, threads[op.id])


def test_timeline_counts_an_in_place_write_once_and_copy_reads_no_destination():
    """An elementwise kernel moves what it reads and what it writes, each once: the step's ``_foreach_add_``
    (returns nothing) writes its first list (the old model left the write out: 2 lists, not 3), and
    ``copy_`` writes its destination without reading it (the old model counted it twice: 3 tensors)."""
    model = recorded_run(False, 2, ITERS)
    steps = [op for op in model.ops if op.iteration == 1 and op.name == "aten::_foreach_add_"]
    tuned = len(model.bucket_layout[0])  # the step's lists: one tensor per tuned tensor of the lane
    assert steps and all(len(op.tensors) == 3 * tuned for op in steps), (tuned, [len(op.tensors) for op in steps])
    copies = [op for op in model.ops if op.kind == "kernel" and op.name == "aten::copy_"]
    assert copies and all(len(op.tensors) == 2 for op in copies), {len(op.tensors) for op in copies}


def test_timeline_lane0_breakdown_has_its_communication_streams_kernels():
    """With --parallel_overlap on the exchange's kernels run on lane 0's communication stream: the breakdown
    counts them (the old model counted lane 0's compute stream only: 0 ms of exchange kernels)."""
    from dpqlab.timeline.devices import GPUS, HOST
    from dpqlab.timeline.replay import Pricing, op_class, simulate
    from dpqlab.timeline.scenarios import run_adapter, shared_block
    from dpqlab.timeline.shapes import BLOCKS, RECORDED

    model = run_adapter(shared_block(False), 2, iters=ITERS, overlap=True)
    tl = simulate(model, Pricing(RECORDED, BLOCKS["70b"], GPUS["3090"], HOST))
    place = model.lanes[0].stream.place
    steady = {it.index for it in tl.steady()}
    comm = [op for op in tl.ops if op.iteration in steady and op.stream is not None and op.stream.place == place
            and op.stream.sid != model.lanes[0].stream.sid and op_class(op) == "exchange_kernels" and op.id in tl.start]
    assert comm, "no exchange kernel on lane 0's communication stream"
    on_comm = sum(tl.end[op.id] - tl.start[op.id] for op in comm) / len(steady)
    assert tl.breakdown()["exchange_kernels"] >= on_comm > 0


def test_timeline_native_order_is_one_collective_per_rank():
    """--parallel_order native recorded: per bucket one reduceScatter host call and one NCCL kernel per lane,
    no send/recv and no fold kernel (the sums are NCCL's: nothing of them on the lanes' streams or the host)."""
    from dpqlab.timeline.scenarios import run_adapter, shared_block

    world = 3
    model = run_adapter(shared_block(False), world, iters=ITERS, order="native")
    assert model.communicators == ["cupy-nccl (native)"]
    ops = [op for op in model.ops if op.iteration == 1 and op.bucket is not None]
    buckets = {op.bucket for op in ops}
    calls = Counter(op.name for op in ops if op.kind == "nccl_call")
    assert calls == {"nccl reduceScatter (host call)": len(buckets) * world, "nccl allGather (host call)":
                     len(buckets) * world}
    assert not [op for op in ops if op.in_communicator and op.kind in ("kernel", "host", "view")]


def test_timeline_nccl_kernels_take_sms_from_the_compute_beside_them():
    """Note [NCCL takes SMs]: with the exchange under the backward (--parallel_overlap on), lane 0's kernels
    that run beside its NCCL kernels are longer by the class's share of the overlap (the old model priced
    them as if NCCL took no SMs: the same kernel time with and without the share)."""
    import dataclasses

    from dpqlab.timeline.devices import GPUS, HOST
    from dpqlab.timeline.replay import Pricing, simulate
    from dpqlab.timeline.scenarios import run_adapter, shared_block
    from dpqlab.timeline.shapes import BLOCKS, RECORDED

    model = run_adapter(shared_block(False), 2, iters=ITERS, overlap=True)
    gpu = GPUS["3090"]
    assert 0 < gpu.nccl_sm_share < 1
    free, taken = (simulate(model, Pricing(RECORDED, BLOCKS["70b"], g, HOST))
                   for g in (dataclasses.replace(gpu, nccl_sm_share=0.0), gpu))
    busy = [sum(sum(it.lane_busy_s) for it in tl.steady()) for tl in (free, taken)]
    assert busy[1] > busy[0]
    assert taken.seconds_per_iteration() >= free.seconds_per_iteration()
