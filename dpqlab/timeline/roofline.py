"""The analytic roofline of one lane's iteration: what a block's tune costs by its FLOPs and bytes
alone, on a GPU class's rates, with nothing of the record in it (a yardstick for the model's 1-lane
time, ``tests/test_timeline_pricing.py``).

Per iteration at one lane (the whole batch): the linear layers' matmuls (forward, weight gradient,
input gradient where one is needed: :meth:`BlockShape.matmul_flops`) and attention (every score
tile: :meth:`BlockShape.attention_flops`) at their rates; the weight-sized traffic at the memory
bandwidth, per weight element: the quantize-dequantize forward (read the fp32 value and the bf16
weight, write the bf16 quantized weight: 8 B) and backward (read the quantized weight's bf16
gradient, the value and the weight, write the value's fp32 gradient: 12 B), SignSGD's step at one
lane (sign the gradient in place, 8 B, then add it into the value, 12 B); the activations' elementwise
passes (bf16, per token): two RMSNorms (read and write the hidden state each), rotary embedding
of the queries and keys (read and write), the gated MLP's SiLU and product (read two intermediate
rows, write one), two residual adds (read two hidden rows, write one), the loss (read the output
and the reference), each twice more in the backward.
"""

from __future__ import annotations

from dpqlab.timeline.devices import GpuClass
from dpqlab.timeline.shapes import BlockShape

__all__ = ["roofline"]

WEIGHT_BYTES = 8 + 12 + 8 + 12  # per weight element: qdq forward, qdq backward, sign, add (module docstring)


def roofline(block: BlockShape, gpu: GpuClass) -> dict[str, float]:
    """Seconds per iteration at one lane, by part, and their sum (``total``)."""
    h, i, q, kv = block.hidden, block.intermediate, block.q_dim, block.kv_dim
    per_token_forward = (2 * (2 * h) + 2 * (q + kv) + 3 * i + 2 * (3 * h) + 2 * h) * block.dtype_bytes
    activations = 3 * per_token_forward * block.tokens
    out = {
        "matmul": block.matmul_flops() / gpu.matmul_flops,
        "attention": block.attention_flops() / gpu.attention_flops,
        "weights": WEIGHT_BYTES * block.weight_elems() / gpu.mem_bw,
        "activations": activations / gpu.mem_bw,
    }
    out["total"] = sum(out.values())
    return out
