"""Build the package's embedded default model into ``dpq/data`` (deterministic, CPU, offline).

Three stages, all seeded:

1. corpus: prose-like paragraphs from the CPython standard library that ships with this
   interpreter (PSF license): the docstrings of modules, classes and functions, read with
   ``ast`` (nothing is imported), plus the help topics of ``pydoc_data.topics`` (text generated
   from the Python reference docs). One paragraph per line, deduplicated. Whole top-level
   modules go to the held-out file (chosen by CRC32 of their name), so train and held-out are
   disjoint by module and by paragraph.
2. tokenizer: a byte-level BPE (``tokenizers``), vocab 2048, trained on the train corpus, with
   ``<|endoftext|>`` (bos/eos) and ``<|pad|>``.
3. model: a ``LlamaForCausalLM`` (hidden 256, intermediate 640, 4 layers, 4 heads, 2 kv heads,
   untied embeddings) trained with AdamW on random 256-token windows of the train stream
   (bf16 autocast on CPU, fp32 master weights), saved in bf16 with safetensors.

Prints train / held-out loss during training and compares the final held-out loss with two
unigram baselines (the train unigram model's cross-entropy on held-out text, and the held-out
text's own unigram entropy, a lower bound for any unigram model).

    .venv/bin/python scripts/train_tiny.py            # everything, into dpq/data
    .venv/bin/python scripts/train_tiny.py --steps 50 --out /tmp/tiny   # a quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "dpq" / "data"

VOCAB = 2048
EOS, PAD = "<|endoftext|>", "<|pad|>"
SEQLEN = 256
# a multiple of 128: auto-round keeps any linear with a dimension not divisible by 32 in 16 bits
# (the usual 8/3 * 256 -> 688 would leave every MLP unquantized), and group size 128 divides it
INTERMEDIATE = 640
HELDOUT_TARGET_BYTES = 100_000
HELDOUT_MAX_UNIT_BYTES = 25_000  # keeps the held-out set spread over several modules

# ---------------------------------------------------------------------------------------------
# 1. corpus
# ---------------------------------------------------------------------------------------------

# top-level stdlib entries left out: tests, the IDLE / 2to3 / demo applications, codecs tables,
# the bundled wheels, and pydoc_data (read separately below)
SKIP_TOP = {
    "site-packages", "dist-packages", "test", "idlelib", "lib2to3", "turtledemo", "pydoc_data",
    "ensurepip", "encodings", "__phello__",
}
TO_ASCII = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": " -- ",
    "\u2026": "...", "\u00a0": " ",
})
CODE_LIKE = re.compile(r">>>|::=|\bdef |\bimport |\w\(|[{}\[\]]|==|\+=|->|\$|%\(|\\|\*\*|\w_\w|\w\.\w\w*\(")
BULLET = re.compile(r"^\s*(?:[*+-]|\d+[.)]|\([a-z0-9]\))\s+")
RULE = re.compile(r"[-=~^*#]{3,}")


def _paragraphs(doc: str):
    """Blank-line separated paragraphs; list items start a new paragraph; rules are dropped."""
    cur: list[str] = []
    for line in doc.translate(TO_ASCII).splitlines():
        s = line.strip()
        if not s or BULLET.match(line):
            if cur:
                yield cur
            cur = []
            if not s:
                continue
            line = BULLET.sub("", line)
        if RULE.fullmatch(s):
            cur = []  # the line above was a heading
            continue
        cur.append(line)
    if cur:
        yield cur


def _prose(lines: list[str]) -> str | None:
    """The paragraph joined onto one line, or None if it does not read like English prose."""
    text = re.sub(r"\s+", " ", " ".join(s.strip() for s in lines)).strip()
    if not text.isascii() or len(text) < 40:
        return None
    words = text.split()
    if len(words) < 6:
        return None
    if sum(c.isalpha() or c == " " for c in text) / len(text) < 0.8:
        return None
    if len(CODE_LIKE.findall(text)) > len(words) / 8:
        return None
    if text.count(",") > len(words) / 3:  # lists of option or attribute names
        return None
    if not (text[0].isalpha() or text[0] in "\"'("):
        return None
    return text


def _stdlib_units(stdlib: Path) -> dict[str, list[str]]:
    """{top-level module: [docstring, ...]} in sorted file order, plus 'pydoc_data.topics'."""
    units: dict[str, list[str]] = {}
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        top = rel.parts[0]
        if top in SKIP_TOP or top.startswith(("config-", "_sysconfigdata")) or {"test", "tests"} & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        docs = units.setdefault(top.removesuffix(".py"), [])
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    topics_py = stdlib / "pydoc_data" / "topics.py"
    topics = ast.literal_eval(ast.parse(topics_py.read_text(encoding="utf-8")).body[-1].value)
    units["pydoc_data.topics"] = [topics[k] for k in sorted(topics)]
    return units


def build_corpus(out: Path) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    paras: dict[str, list[str]] = {}
    for unit, docs in _stdlib_units(stdlib).items():
        kept = paras.setdefault(unit, [])
        for doc in docs:
            for lines in _paragraphs(doc):
                text = _prose(lines)
                if text is not None and text not in seen:
                    seen.add(text)
                    kept.append(text)
    size = {u: sum(len(t) + 1 for t in ps) for u, ps in paras.items()}
    heldout_units, total = [], 0
    for unit in sorted(paras, key=lambda u: (zlib.crc32(u.encode()), u)):
        if total >= HELDOUT_TARGET_BYTES:
            break
        if unit == "pydoc_data.topics" or not 0 < size[unit] <= HELDOUT_MAX_UNIT_BYTES:
            continue
        heldout_units.append(unit)
        total += size[unit]
    train = [t for u, ps in paras.items() if u not in heldout_units for t in ps]
    heldout = [t for u, ps in paras.items() if u in heldout_units for t in ps]
    (out / "corpus_train.txt").write_text("\n".join(train) + "\n", encoding="ascii")
    (out / "corpus_heldout.txt").write_text("\n".join(heldout) + "\n", encoding="ascii")
    info = dict(
        stdlib=str(stdlib), python=sysconfig.get_python_version(),
        train_units=len(paras) - len(heldout_units), heldout_units=sorted(heldout_units),
        train_paragraphs=len(train), heldout_paragraphs=len(heldout),
        train_bytes=(out / "corpus_train.txt").stat().st_size,
        heldout_bytes=(out / "corpus_heldout.txt").stat().st_size,
    )
    print(f"corpus: {info['train_bytes']:,} B train ({len(train)} paragraphs, {info['train_units']} units), "
          f"{info['heldout_bytes']:,} B held-out ({len(heldout)} paragraphs) from {', '.join(sorted(heldout_units))}")
    return info


# ---------------------------------------------------------------------------------------------
# 2. tokenizer
# ---------------------------------------------------------------------------------------------


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train([str(out / "corpus_train.txt")], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None, pad_token=PAD,
        model_max_length=512, clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)
    # name the generic fast-tokenizer class (transformers 4.x and 5.x both resolve it); with
    # model_type "llama" and no class named, AutoTokenizer would build a Llama tokenizer instead
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    print(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, eos {EOS!r}={tok.token_to_id(EOS)}, "
          f"pad {PAD!r}={tok.token_to_id(PAD)}")
    return hf_tok


def encode_file(tok, path: Path) -> torch.Tensor:
    return torch.tensor(tok(path.read_text(encoding="ascii"), add_special_tokens=False, verbose=False)["input_ids"])


def unigram_baselines(train_ids: torch.Tensor, heldout_ids: torch.Tensor) -> dict:
    """Nats/token: train unigram (add-one) cross-entropy on held-out, and held-out's own entropy."""
    train_counts = torch.bincount(train_ids, minlength=VOCAB).double() + 1.0
    logp = (train_counts / train_counts.sum()).log()
    ce = -logp[heldout_ids].mean().item()
    held_counts = torch.bincount(heldout_ids, minlength=VOCAB).double()
    p = held_counts[held_counts > 0] / held_counts.sum()
    ent = -(p * p.log()).sum().item()
    return dict(unigram_train_ce_on_heldout=ce, unigram_heldout_entropy=ent)


# ---------------------------------------------------------------------------------------------
# 3. model
# ---------------------------------------------------------------------------------------------


def build_model(tok, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=INTERMEDIATE, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids(EOS), eos_token_id=tok.convert_tokens_to_ids(EOS),
        pad_token_id=tok.convert_tokens_to_ids(PAD),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def windows(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """All non-overlapping [seqlen + 1] windows (inputs and shifted targets), as rows."""
    n = (len(ids) - 1) // seqlen
    return torch.stack([ids[i * seqlen: i * seqlen + seqlen + 1] for i in range(n)])


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, batch: int = 16, autocast: bool = True) -> float:
    """Mean next-token cross-entropy (nats) over every position of ``rows``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i: i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def train_model(model, train_ids, heldout_rows, train_eval_rows, args) -> dict:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=args.weight_decay), dict(params=no_decay, weight_decay=0.0)],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed + 1)
    max_start = len(train_ids) - SEQLEN - 1
    offsets = torch.arange(SEQLEN + 1)
    model.train()
    t0, recent, history = time.perf_counter(), [], []
    for step in range(args.steps):
        starts = torch.randint(0, max_start + 1, (args.batch,), generator=gen)
        x = train_ids[starts[:, None] + offsets]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        last = step + 1 == args.steps
        if (step + 1) % args.eval_every == 0 or last:
            held = eval_loss(model, heldout_rows)
            tr = eval_loss(model, train_eval_rows)
            elapsed = time.perf_counter() - t0
            history.append(dict(step=step + 1, train_loss=tr, heldout_loss=held, seconds=elapsed))
            print(f"step {step + 1:>5}/{args.steps}  lr {lr_at(step):.2e}  batch loss {sum(recent) / len(recent):.3f}"
                  f"  train {tr:.3f}  held-out {held:.3f} (ppl {math.exp(held):.1f})  {elapsed:.0f}s", flush=True)
            recent = []
    return dict(history=history, train_seconds=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight_decay", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible, robust on a shared CPU)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(args.out)
    tok = build_tokenizer(args.out)

    train_ids = encode_file(tok, args.out / "corpus_train.txt")
    heldout_ids = encode_file(tok, args.out / "corpus_heldout.txt")
    base = unigram_baselines(train_ids, heldout_ids)
    heldout_rows = windows(heldout_ids, SEQLEN)
    all_train_rows = windows(train_ids, SEQLEN)
    train_eval_rows = all_train_rows[torch.linspace(0, len(all_train_rows) - 1, len(heldout_rows)).long()]
    bytes_per_token = corpus["train_bytes"] / len(train_ids)
    print(f"tokens: {len(train_ids):,} train ({bytes_per_token:.2f} B/token), {len(heldout_ids):,} held-out "
          f"({len(heldout_rows)} windows of {SEQLEN})")
    print(f"unigram baselines (nats/token): train unigram on held-out {base['unigram_train_ce_on_heldout']:.3f} "
          f"(ppl {math.exp(base['unigram_train_ce_on_heldout']):.1f}), held-out's own entropy "
          f"{base['unigram_heldout_entropy']:.3f} (ppl {math.exp(base['unigram_heldout_entropy']):.1f})")

    model = build_model(tok, args.seed)
    print(f"model: LlamaForCausalLM, {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"{args.steps} steps x batch {args.batch} x {SEQLEN} tokens, AdamW lr {args.lr}, seed {args.seed}, "
          f"{torch.get_num_threads()} threads")
    run = train_model(model, train_ids, heldout_rows, train_eval_rows, args)

    model = model.to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "model.safetensors").chmod(0o644)  # written 0600; package data must be world-readable
    # the shipped (bf16) weights, evaluated the way load_embedded_model() runs them: in fp32
    from transformers import AutoModelForCausalLM

    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32, local_files_only=True)
    held = eval_loss(shipped, heldout_rows, autocast=False)
    tr = eval_loss(shipped, train_eval_rows, autocast=False)
    total_seconds = time.perf_counter() - t_start
    files = {p.name: p.stat().st_size for p in sorted(args.out.iterdir()) if p.is_file()}
    summary = dict(
        corpus=corpus, train_tokens=len(train_ids), heldout_tokens=len(heldout_ids), **base,
        final_train_loss=tr, final_heldout_loss=held, final_heldout_ppl=math.exp(held),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        train_seconds=run["train_seconds"], total_seconds=total_seconds, history=run["history"],
        torch=torch.__version__, files=files,
    )
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "corpus")}, indent=1))
    print(f"shipped bf16 model (run in fp32): train {tr:.3f}, held-out {held:.3f} nats/token "
          f"(ppl {math.exp(held):.1f}) vs unigram {base['unigram_train_ce_on_heldout']:.3f} "
          f"(ppl {math.exp(base['unigram_train_ce_on_heldout']):.1f}); training {run['train_seconds']:.0f}s, "
          f"total {total_seconds:.0f}s; {sum(files.values()) / 1e6:.2f} MB in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
