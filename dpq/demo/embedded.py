"""The embedded default: a small trained Llama that ships in ``dpq/data``, with its tokenizer and text.

Everything is local (``local_files_only=True``): ``scripts/train_tiny.py`` built the files from
CPython standard-library docstrings and help topics (PSF license); see ``dpq/data/README.md``.

    model, tok = load_embedded_model()
    calibration_jsonl("/tmp/calib.jsonl", nsamples=128, seqlen_tokens=256)   # auto-round --dataset
    samples = heldout_samples(tok, n=32, seqlen=256)                          # for KL(fp || q)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TRAIN_TEXT = DATA_DIR / "corpus_train.txt"
HELDOUT_TEXT = DATA_DIR / "corpus_heldout.txt"


def load_embedded_model(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the shipped model, offline; the model is in eval mode, on CPU, in ``dtype``."""
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    model = LlamaForCausalLM.from_pretrained(DATA_DIR, dtype=dtype, local_files_only=True).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DATA_DIR, local_files_only=True)
    return model, tokenizer


def _token_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for an HF tokenizer or a ``tokenizers.Tokenizer``."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch"):  # tokenizers.Tokenizer: no max-length warnings
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _default_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DATA_DIR / "tokenizer.json"))


def calibration_texts(nsamples: int, seqlen_tokens: int, tokenizer=None) -> list[str]:
    """``nsamples`` non-overlapping texts cut from ``corpus_train.txt``, each at least ``seqlen_tokens``
    tokens long (under ``tokenizer``, the shipped one by default; no special tokens added).

    Each text joins consecutive corpus lines (paragraphs) with newlines, starting at evenly spaced
    lines so the samples cover the whole corpus. Deterministic. Raises ValueError when the corpus
    cannot supply that many tokens.
    """
    if nsamples < 1 or seqlen_tokens < 1:
        raise ValueError(f"nsamples and seqlen_tokens must be positive, got {nsamples}, {seqlen_tokens}")
    tokenizer = tokenizer or _default_tokenizer()
    lines = TRAIN_TEXT.read_text(encoding="utf-8").splitlines()
    texts, pos = [], 0
    for i in range(nsamples):
        pos = max(pos, i * len(lines) // nsamples)
        start, count = pos, 0
        while count < seqlen_tokens:
            if pos >= len(lines):
                raise ValueError(f"corpus_train.txt cannot supply {nsamples} samples of {seqlen_tokens} tokens "
                                 f"(ran out at sample {i})")
            count += len(_token_ids(tokenizer, lines[pos])) + (pos > start)  # + the joining newline
            pos += 1
        text = "\n".join(lines[start:pos])
        while len(_token_ids(tokenizer, text)) < seqlen_tokens:  # guard; the count above is exact for BPE
            if pos >= len(lines):
                raise ValueError(f"corpus_train.txt ran out at sample {i}")
            text += "\n" + lines[pos]
            pos += 1
        texts.append(text)
    return texts


def calibration_jsonl(path, nsamples: int, seqlen_tokens: int, tokenizer=None) -> Path:
    """Write ``calibration_texts(nsamples, seqlen_tokens)`` as ``{"text": ...}`` lines to ``path``
    (a local ``.jsonl`` auto-round accepts as ``--dataset``/``dataset=``). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in calibration_texts(nsamples, seqlen_tokens, tokenizer):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def heldout_samples(tokenizer, n: int, seqlen: int) -> list[torch.Tensor]:
    """``n`` non-overlapping [1, seqlen] LongTensors from the tokenized ``corpus_heldout.txt``.

    The held-out text is tokenized as one stream and cut into consecutive ``seqlen`` windows;
    ``n`` of them are taken at evenly spaced window indices. Deterministic. Raises ValueError if
    the text has fewer than ``n`` windows.
    """
    ids = _token_ids(tokenizer, HELDOUT_TEXT.read_text(encoding="utf-8"))
    windows = len(ids) // seqlen
    if not 0 < n <= windows:
        raise ValueError(f"held-out text has {windows} windows of {seqlen} tokens; asked for {n}")
    picks = [i * windows // n for i in range(n)]
    return [torch.tensor(ids[w * seqlen: (w + 1) * seqlen], dtype=torch.long).unsqueeze(0) for w in picks]
