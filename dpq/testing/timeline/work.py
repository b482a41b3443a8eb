"""What kind of work a kernel is, and the FLOPs of those priced by FLOPs.

A kernel is a *matmul* (cuBLAS: priced by its FLOPs at the GPU class's GEMM rate), *attention*
(scaled-dot-product attention, forward or backward: its FLOPs at the class's attention rate) or
*elementwise* (everything else, memory-bound: its bytes at the class's bandwidth). Matmul FLOPs are
torch's own formulas (``torch.utils.flop_counter``); attention's too (``sdpa_flop_count`` and
``sdpa_backward_flop_count``, which torch registers for the CUDA kernels but not for the CPU
kernels a CPU recording runs), halved under a causal mask: flash attention skips the masked half
of the score tiles, which is what a causal decoder block runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["ATTENTION", "MATMULS", "attention_flops", "named_args", "work_of"]

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
                     "extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm", "extern_kernels.baddbmm"})
_ATTENTION_FORWARD = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward"})
_ATTENTION_BACKWARD = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention_backward", "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward", "aten::_flash_attention_backward",
    "aten::_efficient_attention_backward"})
ATTENTION = _ATTENTION_FORWARD | _ATTENTION_BACKWARD


def work_of(name: str) -> str:
    if name in MATMULS:
        return "matmul"
    if name in ATTENTION:
        return "attention"
    return "elementwise"


def attention_flops(name: str, shapes: Sequence[Sequence[int]], is_causal: bool) -> float:
    """FLOPs of one attention kernel. ``shapes``: forward (query, key, value), backward (grad_out,
    query, key, value), each ``[batch, heads, seq, head_dim]``."""
    if name in _ATTENTION_FORWARD:
        flops = sdpa_flop_count(*shapes[:3])
    elif name in _ATTENTION_BACKWARD:
        flops = sdpa_backward_flop_count(*shapes[:4])
    else:
        raise ValueError(f"{name} is not an attention kernel")
    return float(flops) * (0.5 if is_causal else 1.0)


def named_args(schema, args, kwargs) -> dict:
    """An op call's arguments by their schema names (defaults filled in)."""
    return {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
            for i, a in enumerate(schema.arguments)}
