"""Measure what the statistical parity tests bound (dpqlab/parity_stats.py), on this machine:
serial's own seed-to-seed spread of each quantity, and the paired differences of parallel runs
(the same seeds) from serial, per test setting.

    DPQ_TEST_CPU_BF16=off .venv/bin/python tests/parity_spread.py engine --seeds 0-7 --worlds 2
    .venv/bin/python tests/parity_spread.py cli --seeds 42-49 --worlds 2 --mutant "lane 1 gradient dropped"

Settings (each exactly as its test runs it):

- ``engine``: tests/test_parity.py (auto-round's quantize_block vs ``dpq.parallel_tune`` on the
  two ``longer_blocks``: 30 iterations, 32 samples x 64 tokens, batch 8, one thread);
- ``model``: tests/test_integration.py's model-level test (``enable()`` + AutoRound on the tiny
  Llama, 20 iterations, 16 x 64, batch 8) with KL on its held-out samples;
- ``algs``: tests/test_integration.py's ALGORITHMS at 6 iterations;
- ``cli``: the ``auto-round-dp`` CLI on the embedded model (tests/test_integration.py's
  CLI_ITERS iterations), KL on held-out text; ``--compile``: with auto-round's torch.compile on
  (tests/test_compile_cli.py, its ITERS), else off.

Blocks and seeds are pairs; ``--mutant`` runs the parallel side with a tests/mutants.py bug. Prints
one JSON line per run, then per (config, quantity): serial's pooled relative spread (stdev of
each block's values over seeds around their mean, pooled over blocks) and, per world, the mean
and stdev of the paired relative difference, next to sqrt(2) x the serial spread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.conftest  # noqa: E402  (applies DPQ_TEST_CPU_BF16 here and for subprocesses)
from dpqlab import parity_stats  # noqa: E402
from dpqlab.autoround_blocks import record_autoround_blocks  # noqa: E402
from tests import mutants  # noqa: E402


def run_engine(seeds, worlds, mutant):
    import pytest
    import torch

    from tests import test_parity as tp

    torch.set_num_threads(1)
    blocks = record_autoround_blocks(iters=30, nsamples=32, seqlen=64, batch_size=8)
    for world in [1, *worlds]:
        with pytest.MonkeyPatch.context() as mp:
            if world > 1 and mutant:
                mutants.apply(mp.setattr, mutant)
            for b, rec in enumerate(blocks):
                for seed in seeds:
                    tp._seeded(seed)
                    if world == 1:
                        with pytest.MonkeyPatch.context() as inner:
                            losses = tp.serial_run(rec, inner, restore=False)[1]
                    else:
                        losses = rec.dpq_parallel_tune(rec.fresh_block(), ["cpu"] * world).losses
                    yield {"config": "engine", "world": world, "seed": seed, "block": f"block{b}",
                           **parity_stats.loss_stats(losses)}


def run_integration(config, iters, alg, seeds, worlds, mutant, kl, serial=True):
    import pytest

    from dpq.demo.metrics import kl_fp_quantized
    from dpq.demo.model import calibration_samples
    from tests import test_integration as ti

    held_out = calibration_samples(4, 64, seed=99)
    for world in [1, *worlds] if serial else worlds:
        for seed in seeds:
            with pytest.MonkeyPatch.context() as mp:
                if world > 1 and mutant:
                    mutants.apply(mp.setattr, mutant)
                devices = ",".join(["cpu"] * world) if world > 1 else None
                model, records, fp = ti.quantize(world, devices, iters=iters, seed=seed, return_model=True, **alg)
            extra = {"kl": kl_fp_quantized(fp, model, held_out)} if kl else {}
            for r in records:
                yield {"config": config, "world": world, "seed": seed, "block": r.name,
                       **parity_stats.loss_stats(r.losses), **extra}


def run_cli(seeds, worlds, mutant, torch_compile=False, iters=None):
    import torch
    from transformers import AutoModelForCausalLM

    from dpq.demo.embedded import heldout_samples, load_embedded_model
    from dpq.demo.metrics import kl_fp_quantized
    from tests import test_integration as ti

    fp, tok = load_embedded_model(torch.float32)
    samples = heldout_samples(tok, 8, 64)
    with tempfile.TemporaryDirectory() as tmp:
        runs, envs = {}, {}
        for world in [1, *worlds]:
            for seed in seeds:
                out = f"w{world}s{seed}"
                runs[out] = ["--seed", str(seed), "--parallel_quantization", str(world)]
                if world > 1:
                    runs[out] += ["--parallel_devices", ",".join(["cpu"] * world)]
                    if mutant:
                        envs[out] = {tests.conftest.SITE_HOOKS.MUTANT_ENV: mutant}
        done = ti._cli_many(Path(tmp), runs, envs, torch_compile=torch_compile, iters=iters)
        for out, r in done.items():
            world, seed = (int(x) for x in out[1:].split("s"))
            q = AutoModelForCausalLM.from_pretrained(r["dir"], device_map="cpu", local_files_only=True).eval()
            kl = kl_fp_quantized(fp, q, samples)
            config = "cli+compile" if torch_compile else "cli"
            for b in r["report"]["blocks"]:
                yield {"config": config, "world": world, "seed": seed, "block": b["name"],
                       **parity_stats.loss_stats(b["losses"]), "kl": kl}


def summarize(rows):
    by_config = {}
    for row in rows:
        by_config.setdefault(row["config"], []).append(row)
    for config, rs in by_config.items():
        serial = {(r["block"], r["seed"]): r for r in rs if r["world"] == 1}
        blocks = sorted({b for b, _ in serial})
        seeds = sorted({s for _, s in serial})
        for q in ("best", "trajectory", "kl"):
            if q not in rs[0]:
                continue
            groups = [[serial[b, s][q] for s in seeds] for b in (blocks if q != "kl" else blocks[:1])]
            spread, nu = parity_stats.pooled_relative_spread(groups)
            line = f"{config} {q}: serial spread {spread:.3%} ({nu} dof, {len(seeds)} seeds x {len(groups)} blocks)"
            for world in sorted({r["world"] for r in rs} - {1}):
                d = [parity_stats.rel(r[q], serial[r["block"], r["seed"]][q]) for r in rs
                     if r["world"] == world and (q != "kl" or r["block"] == blocks[0])]
                sd = statistics.stdev(d) if len(d) > 1 else float("nan")
                line += (f"; world {world}: paired d mean {statistics.fmean(d):+.3%} stdev {sd:.3%} "
                         f"(sqrt2 x spread {math.sqrt(2) * spread:.3%}, max |d| {max(abs(x) for x in d):.3%})")
            print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("setting", choices=["engine", "model", "algs", "cli"])
    p.add_argument("--seeds", default="0-7", help="a range a-b or a list a,b,c")
    p.add_argument("--worlds", default="2", help="parallel worlds, e.g. 2,4 ('': serial runs only)")
    p.add_argument("--mutant", default="", choices=["", *mutants.MUTANTS])
    p.add_argument("--algs", default="", help="algs: only these ALGORITHMS indices, e.g. 2,3,4 (default all)")
    p.add_argument("--no-serial", action="store_true",
                   help="model/algs: only the parallel runs (their serial rows from an earlier run's log)")
    p.add_argument("--compile", action="store_true", help="cli: auto-round's torch.compile on (its default)")
    p.add_argument("--iters", type=int, help="cli: iterations (default: the test's, tests/test_integration.py "
                                             "CLI_ITERS; tests/test_compile_cli.py ITERS with --compile)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    a, _, b = args.seeds.partition("-")
    seeds = list(range(int(a), int(b) + 1)) if b else [int(x) for x in args.seeds.split(",")]
    worlds = [int(w) for w in args.worlds.split(",") if w]  # none: serial only (its spread)
    if args.setting == "engine":
        gen = run_engine(seeds, worlds, args.mutant)
    elif args.setting == "model":
        gen = run_integration("model", 20, {}, seeds, worlds, args.mutant, kl=True)
    elif args.setting == "cli":
        iters = args.iters
        if iters is None and args.compile:
            from tests.test_compile_cli import ITERS as iters
        gen = run_cli(seeds, worlds, args.mutant, torch_compile=args.compile, iters=iters)
    else:
        from tests.test_integration import ALGORITHMS

        def gen_algs():
            picked = [int(i) for i in args.algs.split(",")] if args.algs else range(len(ALGORITHMS))
            for alg, name in (ALGORITHMS[i] for i in picked):
                yield from run_integration(f"{name} {alg}", 6, alg, seeds, worlds, args.mutant, kl=False,
                                           serial=not args.no_serial)

        gen = gen_algs()
    rows = []
    for row in gen:
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    summarize(rows)


if __name__ == "__main__":
    main()
