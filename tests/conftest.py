"""Shared fixtures: a tiny Llama and the real blocks auto-round tunes, recorded mid-run."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
import torch

from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples


@dataclass
class RecordedBlock:
    """One ``SignRoundQuantizer.quantize_block`` call of a real auto-round run, replayable."""

    quantizer: object
    block: torch.nn.Module  # unwrapped, as it arrived (deep copy)
    fp_inputs: list
    input_others: dict
    fp_outputs: list
    q_inputs: list | None
    block_ctx: object
    input_ids: list | None
    py_state: object
    torch_state: torch.Tensor

    def fresh_block(self) -> torch.nn.Module:
        return copy.deepcopy(self.block)

    def restore_rng(self) -> None:
        random.setstate(self.py_state)
        torch.set_rng_state(self.torch_state)

    def serial_quantize_block(self, block: torch.nn.Module) -> dict:
        """auto-round's own serial ``quantize_block`` on ``block`` with the recorded arguments."""
        return self.quantizer.quantize_block(
            block, list(self.fp_inputs), dict(self.input_others), list(self.fp_outputs), self.q_inputs,
            self.block_ctx, self.input_ids,
        )


def record_autoround_blocks(iters: int = 4, nsamples: int = 16, seqlen: int = 64, batch_size: int = 8, **ar_kwargs):
    """Run ``AutoRound(...).quantize()`` on the tiny Llama and record every block's call."""
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    model = build_tiny_llama(TinyLlamaConfig())
    recorded: list[RecordedBlock] = []
    orig = SignRoundQuantizer.quantize_block

    def recording(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids=None, **kw):
        recorded.append(
            RecordedBlock(
                quantizer=self,
                block=copy.deepcopy(block),
                fp_inputs=list(fp_inputs),
                input_others={k: (list(v) if isinstance(v, list) else v) for k, v in input_others.items()},
                fp_outputs=list(fp_outputs),
                q_inputs=list(q_inputs) if q_inputs is not None else None,
                block_ctx=block_ctx,
                input_ids=list(input_ids) if input_ids is not None else None,
                py_state=random.getstate(),
                torch_state=torch.get_rng_state(),
            )
        )
        return orig(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kw)

    SignRoundQuantizer.quantize_block = recording
    try:
        ar = AutoRound(
            model,
            tokenizer=build_tokenizer(),
            dataset=calibration_samples(nsamples, seqlen),
            device_map="cpu",
            enable_torch_compile=False,
            iters=iters,
            nsamples=nsamples,
            seqlen=seqlen,
            batch_size=batch_size,
            seed=42,
            **ar_kwargs,
        )
        ar.quantize()
    finally:
        SignRoundQuantizer.quantize_block = orig
    return recorded


@pytest.fixture(scope="session")
def recorded_blocks():
    return record_autoround_blocks()
