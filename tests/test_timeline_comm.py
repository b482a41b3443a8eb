"""The timeline model replays the communicator the plan picks for the machine it prices.

On the presets of ``benchmarks/timeline.py`` (4 x RTX 3090, 8 x H100, each with ``auto-round-dp[cuda12]``:
CuPy's NCCL present) the plan picks a communicator by its own rules (``dpq.communicators.choose_communicator``);
the model must record that communicator's own code (:class:`dpq.testing.timeline.record.ModelCupyNccl`): its
staging allocations, its send/recv calls and its folds, not one collective per bucket.
"""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.timeline import MACHINES
from dpq import communicators
from dpq.nccl_comm import CupyNcclCommunicator, TorchNcclCommunicator
from dpq.testing.timeline.scenarios import recorded_run

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
