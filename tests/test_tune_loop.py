"""The iteration engine on a toy module: slicing, weighting, one backward, identical lanes."""

from __future__ import annotations

import pytest
import torch

from dpq.exchange import FullSumExchange, SignExchange
from dpq.fallback_p2p import LocalCommunicator
from dpq.mirror import ReplicaSet
from dpq.streams import make_lanes
from dpq.tune_loop import TuneEngine, contiguous_slices


@pytest.mark.parametrize("n,world", [(8, 1), (8, 2), (8, 3), (7, 4), (4, 4), (13, 3)])
def test_contiguous_slices(n, world):
    idx = list(range(100, 100 + n))
    slices = contiguous_slices(idx, world)
    assert len(slices) == world
    assert [i for s in slices for i in s] == idx  # contiguous, in order, nothing lost
    sizes = [len(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float32))
        self.frozen = torch.nn.Parameter(torch.randn(5, dtype=torch.float32), requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.w.T) + self.frozen.sum()


DATA = [torch.randn(1, 3, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(i)) for i in range(16)]
TARGET = [
    torch.randn(1, 3, 6, dtype=torch.float32, generator=torch.Generator().manual_seed(100 + i)) for i in range(16)
]


def lane_loss_for(reduction):
    def lane_loss(lane, module, indices):
        x = torch.cat([DATA[i] for i in indices])
        y = torch.cat([TARGET[i] for i in indices])
        return torch.nn.functional.mse_loss(module(x), y, reduction=reduction)

    return lane_loss


def serial_grad(indices, reduction):
    m = Toy()
    lane_loss_for(reduction)(None, m, indices).backward()
    return m.w.grad


class PlainSGD(torch.optim.SGD):
    pass


def make_engine(world, reduction="mean", exchange_cls=FullSumExchange, micro_batch=None):
    model = Toy()
    lanes = make_lanes(["cpu"] * world)
    rs = ReplicaSet(model, lanes, ["w"])
    engine = TuneEngine(
        rs,
        lane_loss_for(reduction),
        lambda m: (PlainSGD([m.w], lr=0.1), None),
        exchange_cls(LocalCommunicator(lanes)),
        reduction=reduction,
        micro_batch=micro_batch,
        sample_numel=lambda i: DATA[i].numel(),
        debug_identical=True,
    )
    return engine, rs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction,micro", [("mean", None), ("sum", None), ("sum", 2)])
def test_sum_of_lane_grads_is_serial_grad(world, reduction, micro):
    engine, rs = make_engine(world, reduction, micro_batch=micro)
    idx = [3, 9, 1, 14, 0, 7, 5, 11]
    losses = engine.backward(idx)
    expected = serial_grad(idx, reduction)
    for k in range(world):
        torch.testing.assert_close(rs.tuned_params(k)[0].grad, expected, rtol=1e-5, atol=1e-6)
    full = lane_loss_for(reduction)(None, Toy(), idx).item()
    assert sum(losses) == pytest.approx(full, rel=1e-5)
    engine.step()  # debug_identical: raises if lanes diverged
    assert engine.last.slices == contiguous_slices(idx, world)


def test_one_backward_per_micro_step(monkeypatch):
    calls = []
    orig = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda roots, *a, **k: (calls.append(len(roots)), orig(roots))[1])
    engine, _ = make_engine(3, "sum", micro_batch=2)
    engine.backward([0, 1, 2, 3, 4, 5, 6, 7])  # lane slices 3,3,2 -> chunks (2,1),(2,1),(2)
    assert calls == [3, 2]


def test_sign_exchange_gives_sign_of_sum():
    engine, rs = make_engine(3, "mean", exchange_cls=SignExchange)
    idx = [2, 4, 6, 8, 10, 12]
    engine.backward(idx)
    expected = torch.sign(serial_grad(idx, "mean"))
    for k in range(3):
        assert torch.equal(rs.tuned_params(k)[0].grad, expected)


def test_mean_with_micro_batch_is_refused():
    with pytest.raises(ValueError, match="reduction='sum'"):
        make_engine(2, "mean", micro_batch=2)
