"""Per-phase seconds (collection / search / tune) of the embedded tiny Llama, serial vs world N.

``python benchmarks/phases.py --world 2 [--iters 0] [--alg_ext]``: runs auto-round with dpq's
seams (and tuner) in one process and prints a markdown row per run, plus whether the model state
is bitwise serial's.
"""

from __future__ import annotations

import time

import torch


def measure_phases(world, devices=None, *, iters: int = 0, nsamples: int = 16, seqlen: int = 64,
                   batch_size: int = 8, tune_parallel: bool = True, **ar_kwargs) -> dict:
    """Quantize the embedded tiny Llama once and return the seconds per phase (collection / search /
    tune), the block records and the wall time. ``world='off'`` measures serial auto-round."""
    from auto_round import AutoRound

    from dpq.autoround import integration, seams_common, shard_seams
    from dpq.autoround.run import Run
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpq.planning.spec import ParallelSpec

    model = build_tiny_llama(TinyLlamaConfig())
    if tune_parallel:
        integration.enable(world, devices)
    else:
        shard_seams.install(Run(ParallelSpec(world, devices), seams_only=True))  # the seams alone; tuning serial
    t0 = time.perf_counter()
    try:
        AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(nsamples, seqlen),
                  device_map="cpu", enable_torch_compile=False, iters=iters, nsamples=nsamples, seqlen=seqlen,
                  batch_size=batch_size, seed=42, **ar_kwargs).quantize()
    finally:
        wall = time.perf_counter() - t0
        phases, records = seams_common.phase_seconds(), seams_common.records()
        tune_records = integration.run_summary() if tune_parallel else []
        if tune_parallel:
            integration.disable()
        else:
            shard_seams.uninstall()
    return {"world": world, "wall": wall, "phases": phases, "records": records,
            "tune_records": tune_records, "state": {k: v.clone() for k, v in model.state_dict().items()}}



def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/phases.py``: per-phase seconds, serial vs world N, in one process."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--nsamples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--alg_ext", action="store_true", help="SignRoundV2 (enable_alg_ext)")
    p.add_argument("--no_gc_collect", action="store_true",
                   help="make gc.collect a no-op (auto-round calls it ~7x a block, ~0.2 s each on CPU)")
    args = p.parse_args(argv)
    if args.no_gc_collect:
        import gc

        gc.collect = lambda *a, **k: 0
    kw = dict(iters=args.iters, nsamples=args.nsamples, seqlen=args.seqlen, batch_size=args.batch_size)
    if args.alg_ext:
        kw["enable_alg_ext"] = True
    from auto_round.utils.device_manager import device_manager

    devices = ",".join(["cpu"] * args.world) if device_manager.device in (None, "cpu") else None
    measure_phases(1, None, tune_parallel=False, **kw)  # warm-up: first-call costs land here, not in a row
    runs = [("serial", measure_phases(1, None, tune_parallel=False, **kw)),
            (f"world {args.world}", measure_phases(args.world, devices, **kw))]
    print(f"threads {torch.get_num_threads()}, {kw}")
    print("| run | collection s | search s | tune s | quantize() wall s |")
    print("|---|---|---|---|---|")
    for label, r in runs:
        ph = r["phases"]
        print(f"| {label} | {ph['collection']:.2f} | {ph['search']:.2f} | {ph['tune']:.2f} | {r['wall']:.2f} |")
    same = all(torch.equal(runs[0][1]["state"][k], runs[1][1]["state"][k]) for k in runs[0][1]["state"])
    print(f"model state bitwise equal to serial: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
