"""``python -m dpq.demo.tune_blocks``: tune every block of the embedded tiny Llama serially and data-parallel.

Prints, per block, the best loss and wall time at world 1 (the serial loop) and at the
requested world on CPU lanes (or GPUs when present), and writes the table as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpq.demo.tune_blocks", description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--devices", default=None, help="lane devices, e.g. cpu,cpu or 0,1 (default: cpu x world)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--output", default="out/demo_parallel_tune.json")
    args = ap.parse_args(argv)

    import dpq

    model = build_tiny_llama(TinyLlamaConfig(num_hidden_layers=args.layers))
    samples = calibration_samples(args.nsamples, args.seqlen)
    inputs, others = capture_block_inputs(model, samples)
    devices = args.devices or ",".join(["cpu"] * args.world)
    rows = []
    print(f"dpq demo: tiny Llama, {args.layers} blocks, {args.nsamples} samples x {args.seqlen} tokens, "
          f"{args.iters} iters, batch {args.batch_size}; world {args.world} on {devices}")
    print(f"{'block':>5} {'serial loss':>12} {'parallel loss':>13} {'rel diff':>9} "
          f"{'serial s':>9} {'parallel s':>10} {'speedup':>8}")
    for idx, layer in enumerate(model.model.layers):
        layer = layer.to(torch.bfloat16)
        runs = {}
        for name, world, devs in (("serial", 1, "cpu"), ("parallel", args.world, devices)):
            block = copy.deepcopy(layer)
            t0 = time.perf_counter()
            res = dpq.parallel_tune(
                block, inputs[idx], input_others=others[idx], world=world, devices=devs,
                iters=args.iters, batch_size=args.batch_size, seed=42,
            )
            runs[name] = (res, time.perf_counter() - t0)
        (s, ts), (p, tp) = runs["serial"], runs["parallel"]
        rel = abs(p.best_loss - s.best_loss) / s.best_loss
        rows.append(dict(block=idx, serial_best_loss=s.best_loss, parallel_best_loss=p.best_loss, rel_diff=rel,
                         serial_seconds=ts, parallel_seconds=tp, world=p.world, communicator=p.communicator,
                         wire_bytes=p.wire_bytes, serial_losses=s.losses, parallel_losses=p.losses))
        print(f"{idx:>5} {s.best_loss:>12.4e} {p.best_loss:>13.4e} {rel:>8.2%} {ts:>9.2f} {tp:>10.2f} {ts / tp:>7.2f}x")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), blocks=rows), indent=2))
    print(f"wrote {out}  (CPU lanes share the CPU: expect no speedup on CPU; the point is parity)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
