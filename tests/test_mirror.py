"""ReplicaSet: aliasing, sharing, identical-state checks, teardown."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dpq.mirror import ReplicaMismatchError, ReplicaSet
from dpq.streams import make_lanes


def _wrapped_block(recorded_blocks):
    from auto_round.wrapper import wrapper_block

    block = recorded_blocks[0].fresh_block()
    wrapper_block(block, True, False, enable_torch_compile=False, device="cpu")
    return block


def _tuned_names(block):
    return [f"{n}.{k}" for n, m in block.named_modules() if hasattr(m, "orig_layer") for k in m.params]


def test_aliases_survive_mirroring(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    names = _tuned_names(block)
    rs = ReplicaSet(block, make_lanes(["cpu"] * 3), names)
    assert rs.home is block
    for mirror in rs.modules[1:]:
        assert mirror is not block
        named = dict(mirror.named_parameters())
        for n, m in mirror.named_modules():
            if hasattr(m, "orig_layer"):
                for key, p in m.params.items():
                    assert p is getattr(m, key), "params dict and attribute must be one tensor"
                    assert named[f"{n}.{key}"] is p
    # tuned params are copies (never shared), frozen weights are shared on the same device
    for k in (1, 2):
        for a, b in zip(rs.tuned_params(0), rs.tuned_params(k), strict=True):
            assert a is not b and a.data_ptr() != b.data_ptr()
            assert torch.equal(a, b)
    w0 = block.self_attn.q_proj.orig_layer.weight
    w1 = rs.modules[1].self_attn.q_proj.orig_layer.weight
    assert w0.data_ptr() == w1.data_ptr()
    rs.check_identical()
    rs.close()


def test_no_sharing_copies_frozen_too(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    rs = ReplicaSet(block, make_lanes(["cpu"] * 2), _tuned_names(block), share_frozen=False)
    w0 = block.self_attn.q_proj.orig_layer.weight
    w1 = rs.modules[1].self_attn.q_proj.orig_layer.weight
    assert w0.data_ptr() != w1.data_ptr() and torch.equal(w0, w1)
    rs.close()


def test_gradients_flow_through_mirror_params(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    rs = ReplicaSet(block, make_lanes(["cpu"] * 2), _tuned_names(block))
    mirror = rs.modules[1]
    # the block's own dtype: bf16 where auto-round chose bf16 autocast, fp32 where it did not
    x = torch.randn(1, 4, 256, dtype=mirror.self_attn.q_proj.orig_layer.weight.dtype)
    out = mirror.self_attn.q_proj(x).float().sum()
    out.backward()
    assert mirror.self_attn.q_proj.value.grad is not None
    assert block.self_attn.q_proj.value.grad is None
    rs.close()


def test_check_identical_detects_divergence(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    rs = ReplicaSet(block, make_lanes(["cpu"] * 2), _tuned_names(block))
    with torch.no_grad():
        rs.tuned_params(1)[3].view(-1)[0] += 1e-3
    with pytest.raises(ReplicaMismatchError, match="lane 1 diverged"):
        rs.check_identical()
    rs.close()


def test_close_frees_mirrors_and_leaves_home(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    rs = ReplicaSet(block, make_lanes(["cpu"] * 3), _tuned_names(block))
    refs = [weakref.ref(m) for m in rs.modules[1:]] + [weakref.ref(p) for p in rs.tuned_params(2)]
    rs.close()
    gc.collect()
    assert all(r() is None for r in refs), "mirror memory must be released on close()"
    assert rs.modules == [block]
    for n, p in block.named_parameters():
        assert torch.equal(p, before[n])


def test_unknown_tuned_name_is_refused(recorded_blocks):
    block = _wrapped_block(recorded_blocks)
    with pytest.raises(ValueError, match="not found"):
        ReplicaSet(block, make_lanes(["cpu"] * 2), ["nope.value"])


def test_gather_of_one_sample_is_a_tensor_of_its_own():
    """Note [one sample, no concatenation]: one sample brought from elsewhere is the copy itself (no
    concatenation); one that already lives on the lane is still copied, so the lane never holds the
    pool's own tensor; several are concatenated as before."""
    from types import SimpleNamespace

    from dpq.mirror import LaneData

    pool = [torch.randn(1, 3, 4) for _ in range(3)]
    here = make_lanes(["cpu"])[0]
    out = LaneData().gather(here, pool, [1])
    assert out is not pool[1] and out.data_ptr() != pool[1].data_ptr() and torch.equal(out, pool[1])
    copies = []
    elsewhere = SimpleNamespace(accelerator=False, bring=lambda t: copies.append(t.clone()) or copies[-1])
    out = LaneData().gather(elsewhere, pool, [2])
    assert out is copies[-1] and torch.equal(out, pool[2])
    out = LaneData().gather(elsewhere, pool, [0, 2])
    assert out.shape == (2, 3, 4) and torch.equal(out, torch.cat([pool[0], pool[2]]))
