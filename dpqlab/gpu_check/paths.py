"""The paths step (core): one lane, auto-round's own tune of a Llama-3-8B-shaped bf16 block on
cuda:0 (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, seq 2048, random weights), torch.compile
on and off, at batch 8 (serial's batch) and batch 1 (a lane's slice at 8 lanes): ms per iteration
(median of the timed iterations, no profiler), GPU ms per phase, the issuing thread's host time and
the kernel launches per iteration (the profiled iterations: ``trace``), the compile seconds of the
block; and the card's two ceilings (an 8192^3 bf16 matmul, a device-to-device copy). Measurements,
not verdicts: they are what ``calibration.json`` carries. Compile-on runs first (the decisive path);
each finished run is in the step's result even if a later one overruns the budget."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from dpqlab.gpu_check.block import DRY, LLAMA3_8B, RunSpec, build_model, ceilings, tune_block
from dpqlab.gpu_check.common import freeze_imports

PROOFS: list[str] = []


def specs(dry_run: bool) -> list[RunSpec]:
    """Compile first, batch 8 then 1; on CPU (dry run) the eager path only, at batches 2 and 1
    (inductor's C++ compile of a block takes tens of CPU-seconds)."""
    if dry_run:
        return [RunSpec(compile=False, batch=b, warmup=1, timed=1, profiled=1) for b in (2, 1)]
    return [RunSpec(compile=c, batch=b, warmup=2, timed=3, profiled=2) for c in (True, False) for b in (8, 1)]


def run(args, partial: dict) -> dict:
    shape, device = (DRY, "cpu") if args.dry_run else (LLAMA3_8B, "cuda:0")
    partial.update(shape=asdict(shape), device=device, runs={})
    freeze_imports()
    if not args.dry_run:
        partial["ceilings"] = ceilings(device)
    model = build_model(shape)
    for spec in specs(args.dry_run):
        trace_to = Path(args.state) / f"trace_{spec.label}.json"
        partial["runs"][spec.label] = tune_block(model, shape, spec, device, trace_to).as_dict()
    partial["proofs"] = {}
    return partial
