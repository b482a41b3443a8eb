"""torch.compile on the lanes (dpq.engine.compiles): the watch counts real dynamo compiles and
recompiles, gives each to the lane whose forward caused it, and through the session the lanes
share one graph where their guards agree (the mirror keeps a wrapper's device attribute as home
has it) and recompile where a slice's shape differs.

Every compile here uses dynamo's ``eager`` backend: the guards, caches and compile ids are
dynamo's own whatever the backend, and no C++ is compiled (fast). auto-round's real block
forward with inductor runs through the CLI in tests/test_compile_cli.py.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from dpq import session
from dpq.autoround.run import BlockRecord
from dpq.engine.compiles import CompileWatch, _frame_compile
from dpq.mirror import ReplicaSet
from dpq.planning.spec import ParallelSpec
from dpq.streams import make_lanes
from dpq.tune_loop import TuneSpec


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with dynamo's caches and compile counters empty (and leaves them so)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_frame_compile_ids():
    assert _frame_compile("3/0") == (3, 0)
    assert _frame_compile("3/2") == (3, 2)
    assert _frame_compile("!1/3/2") == (3, 2)  # under compiled autograd
    assert _frame_compile("nonsense") == (None, None)


def test_counts_a_real_recompile_and_none_without_one():
    def f(x):
        return torch.sin(x) * 2

    g = torch.compile(f, backend="eager", dynamic=False)
    with CompileWatch(1) as w:
        assert w.watched
        with w.lane(0):
            g(torch.ones(4))
            g(torch.ones(4))  # the cached graph's guards hold: no compile
    assert (w.compiles(), w.recompiles()) == ([1], [0])

    with CompileWatch(1) as again:
        with again.lane(0):
            g(torch.ones(4))
    assert (again.compiles(), again.recompiles()) == ([0], [0])

    with CompileWatch(1) as shape:
        with shape.lane(0):
            g(torch.ones(5))  # a shape guard fails: the frame is compiled a second time
    assert (shape.compiles(), shape.recompiles()) == ([1], [1])
    (reason,) = shape.lanes[0].reasons
    assert reason.startswith("0/1") and "size" in reason, reason  # dynamo's recompile reason, kept
    assert shape.lanes[0].compile_s > 0

    g(torch.ones(6))  # after the watch: not counted, the callbacks are gone
    assert (shape.compiles(), shape.recompiles()) == ([1], [1])


def test_compiles_outside_every_lane_are_not_counted():
    g = torch.compile(lambda x: x + 1, backend="eager")
    with CompileWatch(2) as w:
        g(torch.ones(3))
    assert (w.compiles(), w.recompiles()) == ([0, 0], [0, 0])


def test_each_compile_goes_to_the_lane_that_caused_it():
    def f(x):
        return torch.cos(x) + 1

    g = torch.compile(f, backend="eager", dynamic=False)

    class FakeLane:
        def __init__(self, index):
            self.index = index

    with CompileWatch(3) as w:
        loss = w.lane_loss(lambda lane, module, chunk: g(torch.ones(len(chunk))))
        for _ in range(2):  # the second round: every shape cached
            loss(FakeLane(0), None, [0, 1, 2])  # first compile
            loss(FakeLane(1), None, [3, 4, 5])  # same shape: lane 0's graph
            loss(FakeLane(2), None, [6, 7])  # an uneven slice: a recompile on lane 2
    assert w.compiles() == [1, 0, 1]
    assert w.recompiles() == [0, 0, 1]


def test_a_compiled_function_runs_each_replicas_own_parameters():
    """One compiled function called with the home block and a mirror (what a lane does with
    auto-round's compiled ``block_forward``): the mirror reuses home's graph without a recompile
    (parameters are graph inputs, not constants), and computes with its own values."""

    def fwd(module, x):
        return module(x)

    g = torch.compile(fwd, backend="eager")
    home = _Block()
    lanes = make_lanes(["cpu", "cpu"])
    replicas = ReplicaSet(home, lanes, ["w"])
    mirror = replicas.modules[1]
    with torch.no_grad():
        mirror.w.mul_(-2.0)  # the mirror's values differ from home's
    x = torch.randn(2, 3, 5)
    with CompileWatch(2) as w:
        outs = []
        for k, m in enumerate(replicas.modules):
            with w.lane(k):
                outs.append(g(m, x))
    assert torch.equal(outs[0], home(x)) and torch.equal(outs[1], mirror(x))
    assert not torch.equal(outs[0], outs[1])
    assert (w.compiles(), w.recompiles()) == ([1, 0], [0, 0])
    replicas.close()


def test_mirror_keeps_a_wrappers_device_attribute_as_home_has_it():
    """auto-round's WrapperLinear keeps ``device`` as a str and its compiled forward guards on it
    (``x.to(self.device)``): a mirror on home's device that turned 'cpu' into torch.device('cpu')
    failed that guard and recompiled the block on every such lane."""
    home = _Block()
    home.output_device = torch.device("cpu")
    replicas = ReplicaSet(home, make_lanes(["cpu", "cpu"]), ["w"])
    mirror = replicas.modules[1]
    assert type(mirror.device) is str and mirror.device == "cpu"
    assert mirror.output_device == torch.device("cpu")
    replicas.close()

    def fwd(module, x):
        return module(x)

    g = torch.compile(fwd, backend="eager")
    other = _Block()
    other.device = torch.device("cpu")  # what the mirror used to hold
    with CompileWatch(2) as w:
        with w.lane(0):
            g(home, torch.ones(2, 3, 5))
        with w.lane(1):
            g(other, torch.ones(2, 3, 5))
    assert w.recompiles() == [0, 1], "the guard this test is about no longer exists: drop the test"


# -- through the session: the real engine, lanes and mirrors --------------------------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 5, generator=g))
        self.device = "cpu"  # as auto-round's wrappers keep it: a str

    def forward(self, x):
        return torch.tanh(x.to(self.device) @ self.w.T)


DATA = [torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(i)) for i in range(8)]
TARGET = [torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(100 + i)) for i in range(8)]


class _FirstSamples:
    """The sampler: every iteration the first ``batch`` samples."""

    def __init__(self, nsamples: int, batch: int) -> None:
        self.batch = list(range(batch))

    def next_batch(self) -> list[int]:
        return self.batch


def _toy_run(world: int, batch: int, iters: int = 3) -> session.BlockRun:
    def fwd(module, x):
        return module(x)

    forward = torch.compile(fwd, backend="eager")

    def lane_loss(lane, module, indices):
        x = torch.cat([DATA[i] for i in indices])
        y = torch.cat([TARGET[i] for i in indices])
        return torch.nn.functional.mse_loss(forward(module, x), y)

    def make_optimizer(module):
        return torch.optim.SGD([module.w], lr=0.1), None

    spec = TuneSpec(tuned=["w"], make_optimizer=make_optimizer, lane_loss=lane_loss, sampler=_FirstSamples,
                    best_params=lambda home: {}, nsamples=len(DATA), sample_numel=lambda i: DATA[i].numel(),
                    iters=iters, batch_size=batch)
    task = session.BlockTask(name="toy", block=_Block(), start=lambda plan: spec,
                             finish=lambda outcome, plan: outcome, samples_per_iter=batch)
    return session.run(session.SessionConfig(ParallelSpec(world, ",".join(["cpu"] * world))), task)


@pytest.mark.parametrize("batch, recompiles", [(4, [0, 0]), (3, [0, 1])], ids=["even", "uneven"])
def test_session_counts_each_lanes_compiles(batch, recompiles):
    """World 2: even slices (2 + 2) share lane 0's graph, lane 1 compiles nothing; uneven ones
    (2 + 1) recompile once on lane 1 (dynamo specialises a size-1 batch), then never again."""
    run = _toy_run(2, batch)
    assert run.outcome is not None and len(run.outcome.losses) == 3
    assert run.compiles.compiles() == [1, recompiles[1]]
    assert run.compiles.recompiles() == recompiles


def test_block_record_carries_the_compiles():
    """auto-round's block record gets the watch's counts per lane (the CLI's --parallel_report)."""
    from dpq.autoround import integration

    run = _toy_run(2, 3)
    fields = integration._compile_fields(run.compiles)
    assert fields["recompiles"] == [0, 1] and fields["compiles"] == [1, 1]
    assert len(fields["compile_s"]) == 2 and fields["compile_s"][1] > 0
    assert integration._compile_fields(None) == {}
    assert {"recompiles", "compiles", "compile_s"} <= set(BlockRecord.__dataclass_fields__)
