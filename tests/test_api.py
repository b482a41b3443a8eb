"""parallel_tune's argument checks: every bad input raises before any work, naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch

import dpq
from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs


@pytest.fixture(scope="module")
def tiny_block():
    model = build_tiny_llama(TinyLlamaConfig(num_hidden_layers=1))
    inputs, others = capture_block_inputs(model, calibration_samples(8, 32))
    return model.model.layers[0], inputs[0], others[0]


def _call(tiny_block, **kw):
    block, inputs, others = tiny_block
    block = copy.deepcopy(block)
    args = dict(input_others=others, iters=2, batch_size=4)
    args.update(kw)
    inputs = args.pop("inputs", inputs)
    try:
        return dpq.parallel_tune(block, inputs, **args)
    finally:
        # every refusal happens before the block is wrapped
        assert not any(hasattr(m, "orig_layer") for m in block.modules())


@pytest.mark.parametrize("world", [0, -1, "two", 1.5])
def test_bad_world(tiny_block, world):
    with pytest.raises(ValueError, match="world must be 'off', 'auto' or an integer >= 1"):
        _call(tiny_block, world=world)


def test_more_lanes_than_samples_per_iteration(tiny_block):
    with pytest.raises(ValueError, match="every lane needs at least one sample"):
        _call(tiny_block, world=3, devices="cpu,cpu,cpu", batch_size=2)


def test_mismatched_input_shapes(tiny_block):
    _, inputs, _ = tiny_block
    bad = list(inputs)
    bad[3] = bad[3][:, :16]
    with pytest.raises(ValueError, match=r"mismatched shapes.*samples \[3\]"):
        _call(tiny_block, inputs=bad)


def test_device_that_does_not_exist(tiny_block):
    with pytest.raises(ValueError, match=r"cuda:0 does not exist"):
        _call(tiny_block, world=2, devices=["cpu", "cuda:0"])


def test_too_few_devices_for_world(tiny_block):
    with pytest.raises(ValueError, match="world 3 needs 3 devices"):
        _call(tiny_block, world=3, devices="cpu,cpu")


def test_auto_on_cpu_runs_serial_and_applies_best(tiny_block):
    block, inputs, others = tiny_block
    block = copy.deepcopy(block)
    w_before = block.mlp.down_proj.weight.clone()
    res = dpq.parallel_tune(block, inputs, input_others=others, iters=3, batch_size=4, world="auto")
    assert res.world == 1 and res.communicator == "local"
    assert len(res.losses) == 3 and res.best_loss == min(res.losses)
    assert not any(hasattr(m, "orig_layer") for m in block.modules())
    assert not torch.equal(block.mlp.down_proj.weight, w_before)  # quantized weights applied


def test_world2_reports_lanes_and_bytes(tiny_block):
    block, inputs, others = tiny_block
    res = dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=2, batch_size=4,
                            world=2, devices="cpu,cpu")
    assert res.world == 2 and res.devices == ["cpu", "cpu"]
    assert res.wire_bytes > 0 and res.communicator == "local"
