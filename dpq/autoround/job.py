"""What every rank of a torchrun job must agree on before any work: the whole job.

:func:`settings` reads this rank's job from its command line, through auto-round's own parser (so
``--iters 4``, ``--iters=4`` and an abbreviation are one value, and an option left at its default
is its default), together with dpq's flags and the recipe. The model and the calibration data
count by content: a local model folder, a local data file (and any other option naming an
existing local path) by a cheap digest of its bytes (:func:`content_digest`), not by its path,
which ranks on other hosts may mount elsewhere; a hub name by its name. Left out, as legitimately
per rank: the devices (``--device_map``, ``--parallel_devices``: each process its own),
``--output_dir`` (rank 0 alone writes), ``--parallel_report`` (rank 0's), ``--parallel_timeout``,
and the options of an evaluation, which does not run under torchrun (``--tasks`` is refused).
:func:`dpq.planning.distributed.agree_job` compares every rank's settings and stops every rank, naming
each differing setting with every rank's value, before the model loads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

__all__ = ["PER_RANK", "content_digest", "dataset_entries", "settings"]

# auto-round's options that may differ between ranks (their argparse dests)
PER_RANK = frozenset({
    "device_map", "output_dir",
    # evaluation only (auto-round evaluates after quantizing; under torchrun --tasks is refused)
    "tasks", "eval_bs", "eval_backend", "eval_model_dtype", "eval_task_by_task", "eval_gen_kwargs", "limit",
    "num_fewshot", "fewshot_as_multiturn", "metrics", "vllm_args", "image_save_dir", "prompt", "prompt_file",
})
OUR_COMPARED = ("parallel_quantization", "parallel_debug", "parallel_overlap")  # dpq's flags every rank shares

FULL_BYTES = 16 << 20  # a file up to this size is hashed whole
SAMPLE_BYTES, SAMPLE_EVERY = 64 << 10, 64 << 20  # a larger one: 64 KiB every 64 MiB, its first and last


def content_digest(path: str | os.PathLike) -> str:
    """A cheap digest of a file's or a folder's bytes (16 hex digits): every file's size, small files
    whole, a larger one sampled (its first and last 64 KiB and 64 KiB every 64 MiB: about 0.1% of a
    checkpoint's bytes), a safetensors file's header whole (every tensor's name, dtype, shape and
    offsets); in a folder also each file's path relative to it (a model's files are found by name).
    A single file's own name is not content: byte-identical copies under other names agree. Hidden
    entries (``.git``, caches) are left out. Two models or data files that differ anywhere but
    between samples get different digests."""
    root = Path(path)
    hidden = lambda p: any(part.startswith(".") for part in p.relative_to(root).parts)  # noqa: E731
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and not hidden(p))
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{'' if f is root else f.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= FULL_BYTES:
                h.update(fh.read())
                continue
            if f.suffix == ".safetensors":
                header = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(header, size - 8)))
            for offset in [*range(0, size - SAMPLE_BYTES, SAMPLE_EVERY), size - SAMPLE_BYTES]:
                fh.seek(offset)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def _by_content(value: str) -> tuple[str, str]:
    """(what is compared, what is shown) for an option's value: a local path by its bytes."""
    if value and os.path.exists(value):
        digest = content_digest(value)
        return f"content {digest}", f"{value} (content {digest})"
    return value, value


def _dataset_entry(entry: str) -> tuple[str, str, str]:
    """(name or path, ":" or "", options) of one ``--dataset`` entry."""
    name, sep, options = entry.partition(":")
    if not os.path.exists(name) and os.path.exists(entry):  # a path with a colon in it
        return entry, "", ""
    return name, sep, options


def dataset_entries(value: str | None) -> list[str]:
    """The names or paths of auto-round's ``--dataset`` (comma-separated entries, each a name or path
    with ``:options``), options left off."""
    return [_dataset_entry(entry)[0] for entry in value.split(",")] if value else []


def _dataset(value: str | None) -> tuple[str, str]:
    """auto-round's ``--dataset`` by content (:func:`_by_content` of each entry's name or path)."""
    if not value:
        return repr(value), repr(value)
    parts = []
    for entry in value.split(","):
        name, sep, options = _dataset_entry(entry)
        parts.append(tuple(text + sep + options for text in _by_content(name)))
    return ",".join(p[0] for p in parts), ",".join(p[1] for p in parts)


def settings(ours: argparse.Namespace, rest: list[str], recipe: str | None) -> dict[str, tuple[str, str]] | None:
    """This rank's job: ``--option`` -> (what is compared, what is shown). None when auto-round's
    parser rejects the arguments (auto-round then says why, on the rank it rejects them)."""
    from .args import autoround_args

    parsed = autoround_args(rest)
    if parsed is None:
        return None
    args = vars(parsed)
    model = args.pop("model", None) or args.get("model_name")
    args.pop("model_name", None)
    out = {"recipe": (repr(recipe), recipe or "auto-round"), "--model": _by_content(model or ""),
           "--dataset": _dataset(args.pop("dataset", None))}
    for dest, value in sorted(args.items()):
        if dest in PER_RANK:
            continue
        shown = repr(value)
        out[f"--{dest}"] = _by_content(value) if isinstance(value, str) and os.sep in value else (shown, shown)
    for dest in OUR_COMPARED:
        value = getattr(ours, dest)
        out[f"--{dest}"] = (_by_meaning(dest, value), repr(value))
    return out


def _by_meaning(dest: str, value: object) -> str:
    """What is compared of one of dpq's flags: the world as dpq reads it (``01``, `` 1`` and ``1``
    are one world; ``AUTO`` is ``auto``), the others as given. A world dpq rejects is left as
    written (the argument check refuses it on its own rank)."""
    if dest == "parallel_quantization":
        from dpq.planning.lane_devices import validate_world

        try:
            return repr(validate_world(value))
        except ValueError:
            pass
    return repr(value)
