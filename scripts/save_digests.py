"""Digests of what auto-round-dp saves, for a refactoring's "behaviour unchanged" check.

Runs the CLI on the embedded model at ``--parallel_quantization off``, ``1``, ``2`` and ``auto``
in one process, and at ``1`` under torchrun with two processes (2x1), and prints one SHA-256 per
run over every saved tensor (name, dtype, shape, bytes, in name order). Run it before and after a
change on the same machine: equal digests mean bitwise equal saved models.

    python scripts/save_digests.py [--runs off,1,2,auto,torchrun-2x1] [--iters 4]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {"off": (None, "off"), "1": (None, "1"), "2": (None, "2"), "auto": (None, "auto"),
        "torchrun-2x1": (2, "1")}


# One intra-op thread in every run, as torchrun gives each of its processes: under bf16 autocast a
# CPU kernel can round differently with another thread count, and world 2 in one process is then
# not bitwise world 2 as 2 processes (tests/test_torchrun.py runs the same way).
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def digest(folder: Path) -> str:
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.rglob("*.safetensors")):
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return f"{h.hexdigest()[:16]} ({len(tensors)} tensors)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--iters", default="4")
    args = p.parse_args()
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = tmp / "calib.jsonl"
        calibration_jsonl(calib, 16, 32)
        for name in args.runs.split(","):
            nproc, world = RUNS[name]
            out = tmp / name
            head = [sys.executable, "-m", "dpq.autoround.cli"] if nproc is None else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "dpq.autoround.cli"]
            cmd = [*head, "--model", str(DATA_DIR), "--dataset", str(calib), "--iters", args.iters, "--nsamples", "8",
                   "--seqlen", "32", "--batch_size", "4", "--device_map", "cpu", "--disable_torch_compile",
                   "--lr", "0.02", "--seed", "42", "--output_dir", str(out), "--parallel_quantization", world]
            if nproc is None and world in ("2", "auto"):
                cmd += ["--parallel_devices", "cpu,cpu"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
            if proc.returncode != 0:
                print(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            print(f"{name:14s} {digest(out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
