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

__all__ = ["ATTENTION", "MATMULS", "attention_flops", "is_view", "is_view_schema", "named_args", "work_of"]

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


def is_view_schema(schema) -> bool:
    """An op that only makes views (every output aliases an input, none written): metadata, no
    kernel. On an accelerator it still costs the issuing thread an op's dispatch (``view_op_s``)."""
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


def is_view(name: str) -> bool:
    """:func:`is_view_schema` for a profiler's op name (``aten::slice``): some overload of it is a view."""
    import torch

    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None) if name.startswith("aten::") else None
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    except (AttributeError, RuntimeError):
        return False
    return any(is_view_schema(o._schema) for o in overloads)


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
