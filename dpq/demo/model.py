"""A tiny Llama-architecture causal LM built from a config with seeded weights.

No hub access anywhere: the tokenizer is a word-level vocabulary built in code, and the
calibration samples are seeded token ids. Small enough that a block tunes in seconds on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0


def build_tiny_llama(cfg: TinyLlamaConfig = TinyLlamaConfig()):
    """A LlamaForCausalLM with seeded weights (init std 0.02 scaled up so blocks do real work)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=0.08,
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf_cfg).eval()


def build_tokenizer(vocab_size: int = 512):
    """A word-level tokenizer over tokens ``w0 .. w{vocab-3}`` plus [UNK] and [PAD]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(vocab_size - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def calibration_samples(n: int, seqlen: int, vocab_size: int = 512, seed: int = 1) -> list[torch.Tensor]:
    """``n`` seeded [1, seqlen] token-id tensors (ids 2.. avoid [UNK]/[PAD])."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (1, seqlen), generator=g) for _ in range(n)]


@torch.no_grad()
def capture_block_inputs(model, samples: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[dict]]:
    """Run ``samples`` through ``model`` and record each decoder layer's hidden-state input and
    its other forward kwargs, per sample, in the layout auto-round caches them.

    Returns (inputs[layer] = [tensor per sample], input_others[layer] = {key: [value per sample]}).
    """
    layers = list(model.model.layers)
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    others: list[dict] = [{} for _ in layers]

    def hook(idx):
        def pre(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[idx].append(hidden.detach().clone())
            for key, val in kwargs.items():
                if key == "hidden_states":
                    continue
                if key in ("past_key_values", "past_key_value", "cache_position", "use_cache"):
                    continue
                if val is None:
                    others[idx][key] = None  # not per-sample: auto-round's batch selection passes it through
                else:
                    others[idx].setdefault(key, []).append(val)

        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for ids in samples:
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return inputs, others

