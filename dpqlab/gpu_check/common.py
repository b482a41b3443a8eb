"""What every step of the GPU check shares: its outcome words, the bitwise comparisons under
deterministic algorithms, and the runs of its hidden subprocesses."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DRY = "skipped: no CUDA (dry run)"
NOT_DRY = "not proven: no CUDA (dry run)"


class CheckFailed(AssertionError):
    """A step's own check failed: the step's status becomes "failed" with this message."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


def verdict(ok: bool, detail: object = "") -> str:
    return "passed" if ok else f"failed: {detail}"


def any_failed(proofs: dict[str, str]) -> bool:
    return any(v.startswith("failed") for v in proofs.values())


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms for a bitwise comparison; yields the list of the
    nondeterministic ops met (warn_only: an op without a deterministic kernel is named, not fatal)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    met: list[str] = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield met
        finally:
            met += sorted({str(w.message).split(" does not have")[0] for w in caught
                           if "deterministic" in str(w.message)})
            torch.use_deterministic_algorithms(before)


def bitwise(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().cpu().reshape(-1).view(torch.uint8), b.detach().cpu().reshape(-1).view(torch.uint8))


def params_equal(a: dict, b: dict) -> str | None:
    """None when two ``{layer: {key: tensor}}`` parameter sets are bitwise equal, else what differs."""
    if a.keys() != b.keys():
        return f"layers differ: {sorted(a)} vs {sorted(b)}"
    for layer in a:
        for key in a[layer]:
            if not bitwise(a[layer][key], b[layer][key]):
                return f"{layer}.{key} differs"
    return None


def hidden_step(name: str, timeout: int, *args: str, env: dict | None = None) -> dict:
    """Run one of the check's hidden steps (``python -m dpqlab.gpu_check NAME``) in a
    subprocess: its JSON (last stdout line starting with '{') or what went wrong."""
    cmd = [sys.executable, "-m", "dpqlab.gpu_check", name, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        return {"rc": None, "error": f"timed out after {timeout}s", "tail": str(e.stdout or "")[-1500:]}
    text = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    return {"rc": proc.returncode, "result": result, "tail": text[-1500:], "text": text}


def freeze_imports() -> None:
    """Import what the runs use, then move every object alive now (modules, classes: never garbage) to
    the collector's permanent generation: auto-round and dpq call ``gc.collect()`` a dozen times per
    block, and each call would otherwise walk torch's and transformers' objects again (seconds of CPU
    on a tiny block). Objects made by the runs are collected as before."""
    import gc

    import torch  # noqa: F401
    from auto_round import AutoRound  # noqa: F401

    import dpq.autoround  # noqa: F401

    gc.collect()
    gc.freeze()
