"""Model-level quality: KL(fp || quantized) of next-token distributions on held-out samples."""

from __future__ import annotations

import torch


@torch.no_grad()
def kl_fp_quantized(fp_model, q_model, samples: list[torch.Tensor]) -> float:
    """Mean over tokens of KL(p_fp || p_q), computed in fp32."""
    total, count = 0.0, 0
    for ids in samples:
        p = torch.log_softmax(fp_model(input_ids=ids).logits.float(), dim=-1)
        q = torch.log_softmax(q_model(input_ids=ids).logits.float(), dim=-1)
        total += torch.sum(p.exp() * (p - q)).item()
        count += ids.numel()
    return total / count
