"""dpq.engine.sign_step: pure SignSGD's update as one foreach op per device and lr, bitwise auto-round's step."""

from __future__ import annotations

import warnings
from types import MappingProxyType

import pytest
import torch

from dpq.engine.exchange import FullSumExchange, SignExchange
from dpq.fallback_p2p import LocalCommunicator
from dpq.mirror import ReplicaSet
from dpq.streams import make_lanes
from dpq.tune_loop import TuneEngine, iteration

pytest.importorskip("auto_round")
from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD


class TwoGroups(torch.nn.Module):
    """Tuned tensors in two param groups with different lrs (auto-round: rounding values and min/max scales)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(7, 5, generator=g))
        self.b = torch.nn.Parameter(torch.randn(5, generator=g))
        self.c = torch.nn.Parameter(torch.zeros(3, 5))  # grads with exact zeros (rows of 0 * x)

    def forward(self, x):
        h = torch.tanh(x @ self.a.T)[..., :5] + self.b
        return h + (self.c * 0).sum(0) + (self.c[:1] * x).sum(-1, keepdim=True)


DATA = [torch.randn(2, 5, generator=torch.Generator().manual_seed(i)) for i in range(12)]
TARGET = [torch.randn(2, 5, generator=torch.Generator().manual_seed(50 + i)) for i in range(12)]


def lane_loss(lane, module, indices):
    x = torch.cat([DATA[i] for i in indices])
    y = torch.cat([TARGET[i] for i in indices])
    return torch.nn.functional.mse_loss(module(x), y)


def make_optimizer(module, momentum=0):
    # as dpq.autoround.tune builds it: lr tensors per group, auto-round's LinearLR schedule
    groups = [{"params": [module.a, module.c], "lr": torch.tensor(0.005)},
              {"params": [module.b], "lr": torch.tensor(0.01)}]
    opt = SignSGD(groups, lr=torch.tensor(0.005), weight_decay=0, momentum=momentum)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=20)


def run(world, one_op, *, exchange_cls=SignExchange, iters=12, optimizer=make_optimizer, lanes=None):
    lanes = lanes or make_lanes(["cpu"] * world)
    rs = ReplicaSet(TwoGroups(), lanes, ["a", "b", "c"])
    engine = TuneEngine(rs, lane_loss, optimizer, exchange_cls(LocalCommunicator(lanes)), reduction="mean",
                        sample_numel=lambda i: DATA[i].numel(), debug_identical=True, one_op_sign_step=one_op)
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(iters):
        iteration(engine, torch.randperm(12, generator=g)[:6].tolist())
        engine.step()
        history.append([p.detach().clone() for p in rs.tuned_params(0)])
    rs.close()
    return engine, history


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("exchange_cls", [SignExchange, FullSumExchange])
def test_one_op_step_is_bitwise_signsgd(world, exchange_cls):
    """Every iteration's parameters bitwise those of each lane's auto-round SignSGD.step (world 1:
    the grads are raw and get signed first; sign exchange: already exact signs; full-sum exchange:
    sums, signed first), with the lr schedule moving both groups' lrs."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. the lr scheduler's "step() before optimizer.step()"
        fused, got = run(world, True, exchange_cls=exchange_cls)
    plain, want = run(world, False, exchange_cls=exchange_cls)
    assert fused.one_op_sign_step and not plain.one_op_sign_step
    assert "one foreach op" in fused.step_note
    for it, (g, w) in enumerate(zip(got, want, strict=True)):
        assert all(same_bits(x, y) for x, y in zip(g, w, strict=True)), f"iteration {it}"
    assert not all(same_bits(x, y) for x, y in zip(got[0], got[-1], strict=True))  # the parameters moved


@pytest.mark.parametrize("mutant", ["alpha sign", "skip signing at world 1", "one lr for all groups"])
def test_mutants_break_bitwise(monkeypatch, mutant):
    """The comparison above can fail: each broken variant of the step differs from SignSGD."""
    from dpq import tune_loop
    from dpq.engine import sign_step

    world = 2
    if mutant == "alpha sign":
        real = sign_step._apply
        monkeypatch.setattr(sign_step, "_apply", lambda groups, first: real({-a: v for a, v in groups.items()}, first))
    elif mutant == "skip signing at world 1":
        world = 1
        real_init = tune_loop.TuneEngine.__init__

        def init(self, *a, **k):
            real_init(self, *a, **k)
            self._sign_first = False

        monkeypatch.setattr(tune_loop.TuneEngine, "__init__", init)
    else:
        real_by = sign_step._by_alpha

        def one_lr(opts, signs=None):
            groups = real_by(opts, signs)
            first = next(iter(groups))
            return {first: ([p for ps, _ in groups.values() for p in ps], [g for _, gs in groups.values() for g in gs])}

        monkeypatch.setattr(sign_step, "_by_alpha", one_lr)
    _, got = run(world, True, iters=3)
    monkeypatch.undo()
    _, want = run(world, False, iters=3)
    assert not all(same_bits(x, y) for g, w in zip(got, want, strict=True) for x, y in zip(g, w, strict=True))


def test_streams_one_op_per_lane():
    """Lanes with (logical) streams: one op per lane under its issue(), stream order clean, same bits."""
    from dpqlab.stream_checker import StreamOrderChecker

    with StreamOrderChecker() as chk:
        _, got = run(2, True, iters=4, lanes=make_lanes(["cpu"] * 2))
    assert chk.violations == []
    _, want = run(2, False, iters=4)
    assert all(same_bits(x, y) for g, w in zip(got, want, strict=True) for x, y in zip(g, w, strict=True))


@pytest.mark.parametrize("case", ["momentum", "step hook", "param without a slot"])
def test_not_used_where_it_would_differ(case):
    """The engine keeps each lane's optimizer.step() and says why."""
    if case == "momentum":
        engine, _ = run(2, True, iters=1, optimizer=lambda m: make_optimizer(m, momentum=0.9))
        assert "momentum=0.9" in engine.step_note
    elif case == "step hook":
        def hooked(m):
            opt, sched = make_optimizer(m)
            opt.register_step_pre_hook(lambda *a: None)
            return opt, sched

        engine, _ = run(2, True, iters=1, optimizer=hooked)
        assert "step hooks" in engine.step_note
    else:
        def extra(m):
            opt, sched = make_optimizer(m)
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(0.1)})
            return opt, sched

        engine, _ = run(2, True, iters=1, optimizer=extra)  # world 1 has no slots (nothing exchanged)
        assert "without a gradient slot" in engine.step_note
    assert not engine.one_op_sign_step


def test_adapter_vouches_only_for_checked_signsgd(monkeypatch, caplog):
    """dpq.autoround asks for the one-op step for auto-round's pure SignSGD whose source is the
    checked one (the series module's REPRODUCED, dpq.autoround.versions); a changed source falls
    back to auto-round's step, warned once."""
    from dpq.autoround import patches, tune

    assert patches.reproduced_changes() == []
    tune._sign_sgd_unchanged.cache_clear()
    assert tune.one_op_sign_step(SignSGD, None) and tune.one_op_sign_step(SignSGD, 0.0)
    assert not tune.one_op_sign_step(SignSGD, 0.9) and not tune.one_op_sign_step(torch.optim.Adam, None)

    class Sub(SignSGD):
        pass

    assert not tune.one_op_sign_step(Sub, None)
    path = "auto_round.algorithms.quantization.sign_round.sign_sgd:_single_tensor_sgd"
    module = patches.series_module()
    monkeypatch.setattr(module, "REPRODUCED", MappingProxyType({**module.REPRODUCED, path: "0" * 16}))
    tune._sign_sgd_unchanged.cache_clear()
    try:
        assert patches.reproduced_changes() == [path]
        messages = []
        monkeypatch.setattr(tune.logger, "warning", messages.append)
        assert not tune.one_op_sign_step(SignSGD, None)
        assert not tune.one_op_sign_step(SignSGD, None)
        assert len(messages) == 1 and "_single_tensor_sgd" in messages[0] and "Fix:" in messages[0]
    finally:
        tune._sign_sgd_unchanged.cache_clear()  # the changed digest's answer must not outlive the test


def test_issue_cost_step_ab_smoke(capsys):
    """`python -m benchmarks.issue_cost --step-ab --profile-forward` on a toy shape: the A/B table
    has a row per world, and the forward's profile line is there."""
    import re

    from benchmarks import issue_cost
    from dpq.autoround import tune

    threads = torch.get_num_threads()
    real = tune.one_op_sign_step
    try:
        assert issue_cost.main(["--worlds", "1,2", "--iters", "2", "--rounds", "1", "--hidden", "32",
                                "--intermediate", "64", "--nsamples", "2", "--step-ab", "--profile-forward"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert tune.one_op_sign_step is real  # the A/B put the adapter back
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 | ", "| 2 | "))]
    ab = [line for line in rows if len(line.split("|")) == 9]
    assert len(ab) == 2, out
    assert re.search(r"forward\+loss of one lane \(world 1, one call\): \d+ aten ops; per call \d+\.\d\d ms", out), out


def test_parallel_tune_reports_the_step():
    """dpq.parallel_tune on an auto-round-wrapped tiny Llama block: the one-op step runs, and the
    result says so (``ParallelTuneResult.step``)."""
    import copy

    import dpq
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    model = build_tiny_llama(TinyLlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    inputs, others = capture_block_inputs(model, calibration_samples(4, 8))
    for world in (1, 2):
        res = dpq.parallel_tune(copy.deepcopy(model.model.layers[0]), inputs[0], input_others=others[0], world=world,
                                devices=",".join(["cpu"] * world), iters=2, batch_size=4, seed=0)
        assert res.step == "one foreach op per device and lr (dpq.engine.sign_step)", res.step
        assert res.issue_s > 0
