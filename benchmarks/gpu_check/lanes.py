"""The lanes step (core): the same block with torch.compile on, through dpq.

* dpq at world 1 against auto-round's own serial tune, batch 8, in interleaved rounds (serial, dpq,
  dpq, serial): the ratio of their median iteration times, dpq's overhead on a GPU (goal <= 1.02).
* world 2 and 4 on ``cuda:0,cuda:0[,...]`` at batch 8 (4 and 2 samples a lane): a run with
  ``debug_identical`` (every lane's replica compared with home's after every step: the proof of
  identical replicas), then a run without it, timed, whose last iterations at world 2 are profiled:
  the host syncs of each iteration on every thread (set-up excluded: only the iterations count) and
  the lanes' forwards on the GPU. The iteration time at W lanes against one lane (dpq world 1) at
  the same total batch is reported, not judged: on a GPU the lanes saturate, their difference is
  (W - 1) x the per-lane work that does not divide with the batch.
"""

from __future__ import annotations

import gzip
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path

from benchmarks.gpu_check import verdicts
from benchmarks.gpu_check.block import DRY, LLAMA3_8B, RunSpec, build_model, tune_block
from benchmarks.gpu_check.common import NOT_DRY, freeze_imports

PROOFS = [verdicts.ONE_SYNC, verdicts.IDENTICAL, verdicts.NOT_SERIALIZED]
WORLD1_GOAL = 1.02


def _plan(dry_run: bool, device: str) -> dict:
    c, batch = (False, 2) if dry_run else (True, 8)
    few = {"warmup": 1, "timed": 1} if dry_run else {"warmup": 2, "timed": 3}
    worlds = (2,) if dry_run else (2, 4)
    return {
        "rounds": [(None, 1)] if dry_run else [(None, 1), (1, None)],  # serial then dpq, dpq then serial
        "one_lane": lambda world: RunSpec(compile=c, batch=batch, world=world, devices=(device,), **few),
        "debug": {w: RunSpec(compile=c, batch=batch, world=w, devices=(device,) * w, debug_identical=True, warmup=0,
                             timed=2 if dry_run else 3) for w in worlds},
        "timed": {w: RunSpec(compile=c, batch=batch, world=w, devices=(device,) * w, profiled=2 if w == 2 else 0, **few)
                  for w in worlds},
    }


def run(args, partial: dict) -> dict:
    shape, device = (DRY, "cpu") if args.dry_run else (LLAMA3_8B, "cuda:0")
    plan = _plan(args.dry_run, device)
    partial.update(shape=asdict(shape), device=device, rounds=[], worlds={})
    freeze_imports()
    model = build_model(shape)
    for order in plan["rounds"]:
        times = {}
        for world in order:
            res = tune_block(model, shape, plan["one_lane"](world), device)
            times["serial" if world is None else "dpq1"] = res.median_ms
        partial["rounds"].append(times)
    ratios = [r["dpq1"] / r["serial"] for r in partial["rounds"] if r.get("serial") and r.get("dpq1")]
    partial["dpq_world1_vs_serial"] = round(statistics.fmean(ratios), 4) if ratios else None
    one_lane = statistics.median(r["dpq1"] for r in partial["rounds"] if r.get("dpq1"))
    for w, spec in plan["debug"].items():
        entry = partial["worlds"].setdefault(str(w), {})
        entry["identical"] = _identical(model, shape, spec, device)
        trace_to = Path(args.state) / f"trace_world{w}.json"
        timed = tune_block(model, shape, plan["timed"][w], device, trace_to if plan["timed"][w].profiled else None)
        entry.update(timed=timed.as_dict(), one_lane_ms=one_lane)
        if timed.median_ms is not None:
            entry["vs_one_lane_ms"] = round(timed.median_ms - one_lane, 3)
            entry["per_lane_undivided_ms"] = round((timed.median_ms - one_lane) / (w - 1), 3)
        if trace_to.is_file():
            with open(trace_to, "rb") as src, gzip.open(Path(args.out) / f"trace_world{w}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    partial["goal"] = {f"dpq world 1 <= {WORLD1_GOAL}x serial": None if partial["dpq_world1_vs_serial"] is None else
                       ("met" if partial["dpq_world1_vs_serial"] <= WORLD1_GOAL else "not met")}
    proofs = _proofs(partial)
    if args.dry_run:  # CPU lanes: the pipeline ran, but nothing here is a GPU's evidence
        partial["cpu_evidence"], proofs = proofs, dict.fromkeys(PROOFS, NOT_DRY)
    partial["proofs"] = proofs
    return partial


def _identical(model, shape, spec: RunSpec, device: str) -> dict:
    """A debug run's identical-state record; a mismatch stops the run (dpq raises), recorded here."""
    try:
        return tune_block(model, shape, spec, device).identical
    except Exception as e:
        got = getattr(e, "result", None)
        record = dict(got.identical) if got is not None and got.identical else {"steps": 0, "checked": 0}
        record["mismatch"] = record.get("mismatch") or f"{type(e).__name__}: {e}"[:400]
        return record


def _proofs(result: dict) -> dict:
    profiled = (result["worlds"].get("2", {}).get("timed", {}).get("profile") or {}).get("per_iteration", [])
    identical = {w: e["identical"] for w, e in result["worlds"].items() if e.get("identical")}
    return {verdicts.ONE_SYNC: verdicts.one_host_sync_per_iteration(profiled),
            verdicts.IDENTICAL: verdicts.replicas_identical(identical),
            verdicts.NOT_SERIALIZED: verdicts.host_does_not_serialize_lanes(profiled)}
