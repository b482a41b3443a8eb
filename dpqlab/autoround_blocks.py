"""Real auto-round blocks, recorded mid-run and replayable: what the parity tests, the benchmarks and
the timeline model tune. :func:`record_autoround_blocks` runs ``AutoRound(...).quantize()`` and
records each ``SignRoundQuantizer.quantize_block`` call with its arguments and RNG state; a
:class:`RecordedBlock` replays auto-round's own serial call or ``dpq.parallel_tune`` on a fresh copy."""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass

import torch

from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples

__all__ = ["RecordedBlock", "record_autoround_blocks"]


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

    @functools.cached_property
    def valid_token_mask(self) -> list | None:
        """The loss mask auto-round derives from the input ids (computed once: benchmarks time calls)."""
        return self.quantizer._compute_valid_token_mask(self.input_ids) if self.input_ids else None

    def dpq_parallel_tune(self, block: torch.nn.Module, devices, **kw):
        """``dpq.parallel_tune`` on ``block`` with the recorded run's inputs and settings, on one
        lane per entry of ``devices``, drawing from the current RNG state (restore it first)."""
        import dpq

        q = self.quantizer
        inputs = self.q_inputs if (self.q_inputs is not None and q.enable_quanted_input) else self.fp_inputs
        return dpq.parallel_tune(
            block, list(inputs), outputs=list(self.fp_outputs), input_others=dict(self.input_others),
            world=len(devices), devices=[str(d) for d in devices], iters=q.iters,
            batch_size=q.calibration_context.batch_size, lr=q.lr, minmax_lr=q.minmax_lr,
            amp=q.model_context.amp, amp_dtype=q.model_context.amp_dtype,
            valid_token_mask=self.valid_token_mask, seed=None, **kw,
        )



class _Recorded(Exception):
    """Stops ``record_autoround_blocks`` once it holds the blocks asked for."""



def record_autoround_blocks(iters: int = 4, nsamples: int = 16, seqlen: int = 64, batch_size: int = 8,
                            stop_after: int | None = None, *, model=None, tokenizer=None, dataset=None,
                            device_map: str = "cpu", **ar_kwargs):
    """Run ``AutoRound(...).quantize()`` on the tiny Llama (or ``model`` with ``tokenizer`` and
    ``dataset``) and record every block's call. ``stop_after``: stop the run once that many blocks
    are recorded (before the last one is tuned: for timing runs that need only the blocks, not
    auto-round's own run of them). ``device_map``: auto-round's (the GPU check records on
    ``cuda:0``); torch.compile stays off unless ``ar_kwargs`` turns it on."""
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    model = build_tiny_llama(TinyLlamaConfig()) if model is None else model
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
        if stop_after is not None and len(recorded) >= stop_after:
            raise _Recorded
        return orig(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kw)

    SignRoundQuantizer.quantize_block = recording
    try:
        ar = AutoRound(
            model,
            tokenizer=build_tokenizer() if tokenizer is None else tokenizer,
            dataset=calibration_samples(nsamples, seqlen) if dataset is None else dataset,
            device_map=device_map,
            iters=iters,
            nsamples=nsamples,
            seqlen=seqlen,
            batch_size=batch_size,
            seed=42,
            **{"enable_torch_compile": False, **ar_kwargs},
        )
        ar.quantize()
    except _Recorded:
        pass
    finally:
        SignRoundQuantizer.quantize_block = orig
    return recorded
