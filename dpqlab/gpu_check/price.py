"""The price step (not core): world 2 on cuda:0,cuda:0 with the Llama-3-8B-shaped block, eager, two
iterations: home's and the mirror's memory price and the lanes' runtime (``dpq.planning.plan``) against what
the run allocated above its start (the allocator's peak)."""

from __future__ import annotations

from dpqlab.gpu_check import verdicts
from dpqlab.gpu_check.block import LLAMA3_8B, RunSpec, build_model, tune_block
from dpqlab.gpu_check.common import NOT_DRY, SKIP_DRY, freeze_imports

PROOFS = [verdicts.PRICE]


def run(args, partial: dict) -> dict:
    if args.dry_run:  # the world-2 path runs on CPU in the lanes step; prices are of GPU memory
        return {"status": SKIP_DRY, "proofs": dict.fromkeys(PROOFS, NOT_DRY)}
    from dpq.planning.plan import BlockPrice, price_runtime

    freeze_imports()
    shape, device = LLAMA3_8B, "cuda:0"
    spec = RunSpec(compile=False, batch=8, world=2, devices=(device, device), warmup=1, timed=1)

    def price(quantizer, block, fp_inputs, input_others):
        import torch

        p = BlockPrice(block, fp_inputs, spec.batch, compute_dtype=quantizer.model_context.amp_dtype)
        partial["price"] = {"home": p.home(2), "mirror": p.mirror(2), "runtime": sum(
            price_runtime(torch.device(device), home=k == 0, communicator="local", world=2) for k in range(2))}

    res = tune_block(build_model(shape), shape, spec, device, on_block=price)
    partial["peak_bytes_over_start"] = res.peak_bytes
    priced = sum(partial.get("price", {}).values())
    partial["proofs"] = {verdicts.PRICE: verdicts.price_covers_peak(res.peak_bytes or 0, priced)}
    return partial
