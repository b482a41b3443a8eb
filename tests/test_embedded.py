"""The shipped embedded model: loads offline, predicts held-out text far better than a unigram model,
and its calibration / held-out helpers cut what they promise."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dpq.demo.embedded import (
    DATA_DIR,
    calibration_jsonl,
    calibration_texts,
    heldout_samples,
    load_embedded_model,
)

# scripts/train_tiny.py measured 3.89 nats/token (ppl 49) on the whole held-out text, and the 16
# windows checked here give 4.07; the held-out text's own unigram entropy is 6.19 nats/token
# (ppl 488), the best any unigram model can do on it (see dpq/data/README.md).
HELDOUT_LOSS_BOUND = 4.3


@pytest.fixture(scope="module")
def embedded():
    return load_embedded_model()


def test_files_shipped():
    names = {p.name for p in DATA_DIR.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "corpus_train.txt", "corpus_heldout.txt", "README.md"):
        assert name in names
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir() if p.is_file()) < 11e6


def test_model_and_tokenizer(embedded):
    model, tok = embedded
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 2048, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, False)
    assert next(model.parameters()).dtype == torch.float32
    assert len(tok) == 2048 and tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    text = "Return the number of items in the sequence.\nRaise ValueError if it is empty."
    assert tok.decode(tok(text)["input_ids"]) == text


@torch.no_grad()
def test_heldout_loss_beats_unigram(embedded):
    model, tok = embedded
    ids = torch.tensor(tok(DATA_DIR.joinpath("corpus_heldout.txt").read_text(), add_special_tokens=False,
                           verbose=False)["input_ids"])
    counts = torch.bincount(ids, minlength=len(tok)).double()
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = -(p * p.log()).sum().item()  # the best any unigram model can do on this text

    samples = heldout_samples(tok, n=16, seqlen=256)
    x = torch.cat(samples)
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item()
    assert unigram_entropy > 5.5
    assert loss < HELDOUT_LOSS_BOUND, (loss, unigram_entropy)
    assert math.exp(loss) < math.exp(unigram_entropy) / 6, (loss, unigram_entropy)  # perplexity 6x lower


def test_heldout_samples(embedded):
    _, tok = embedded
    samples = heldout_samples(tok, n=8, seqlen=128)
    assert len(samples) == 8
    assert all(s.shape == (1, 128) and s.dtype == torch.long for s in samples)
    assert len({tuple(s[0].tolist()) for s in samples}) == 8
    again = heldout_samples(tok, n=8, seqlen=128)
    assert all(torch.equal(a, b) for a, b in zip(samples, again, strict=True))
    # windows are disjoint slices of the one tokenized stream
    ids = tok(DATA_DIR.joinpath("corpus_heldout.txt").read_text(), add_special_tokens=False,
              verbose=False)["input_ids"]
    starts = []
    for s in samples:
        row = s[0].tolist()
        start = next(i for i in range(0, len(ids) - 127, 128) if ids[i:i + 128] == row)
        starts.append(start)
    assert starts == sorted(starts) and len(set(starts)) == 8
    with pytest.raises(ValueError):
        heldout_samples(tok, n=10_000, seqlen=256)


def test_calibration_jsonl(tmp_path, embedded):
    _, tok = embedded
    path = calibration_jsonl(tmp_path / "calib.jsonl", nsamples=16, seqlen_tokens=128)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 16 and all(set(r) == {"text"} for r in rows)
    lengths = [len(tok(r["text"], verbose=False)["input_ids"]) for r in rows]  # as auto-round tokenizes them
    assert min(lengths) >= 128
    assert len({r["text"] for r in rows}) == 16
    train_text = DATA_DIR.joinpath("corpus_train.txt").read_text()
    assert all(r["text"] in train_text for r in rows)
    assert calibration_texts(16, 128) == [r["text"] for r in rows]
