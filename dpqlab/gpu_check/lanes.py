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
* the issuing thread at worlds 1, 2 and 4 (``issuing``): its own CPU time per steady iteration
  (``time.thread_time()`` on that thread, read in the same unprofiled iterations that give the wall
  time: Note [the issuing thread's CPU time] in ``block.py``), beside the wall time and the GPU's
  busy time (the union of its kernels' intervals in the profiled iterations that follow: world 1's
  last dpq round and world 4 profile one iteration, world 2 two). What the timeline model's host
  figure is calibrated by (``summary.dpq_issuing``); no iteration is added for it.
"""

from __future__ import annotations

import gzip
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path

from dpqlab.gpu_check import verdicts
from dpqlab.gpu_check.block import DRY, LLAMA3_8B, RunSpec, TuneResult, build_model, tune_block
from dpqlab.gpu_check.common import NOT_DRY, freeze_imports

PROOFS = [verdicts.ONE_SYNC, verdicts.IDENTICAL, verdicts.NOT_SERIALIZED]
WORLD1_GOAL = 1.02


PROFILED = {1: 1, 2: 2, 4: 1}  # iterations profiled after the timed ones, per world (world 2's: the verdicts')


def _plan(dry_run: bool, device: str) -> dict:
    c, batch = (False, 2) if dry_run else (True, 8)
    few = {"warmup": 1, "timed": 1} if dry_run else {"warmup": 2, "timed": 3}
    worlds = (2,) if dry_run else (2, 4)
    return {
        "rounds": [(None, 1)] if dry_run else [(None, 1), (1, None)],  # serial then dpq, dpq then serial
        "one_lane": lambda world, profiled=0: RunSpec(compile=c, batch=batch, world=world, devices=(device,),
                                                      profiled=profiled, **few),
        "debug": {w: RunSpec(compile=c, batch=batch, world=w, devices=(device,) * w, debug_identical=True, warmup=0,
                             timed=2 if dry_run else 3) for w in worlds},
        "timed": {w: RunSpec(compile=c, batch=batch, world=w, devices=(device,) * w, profiled=PROFILED[w], **few)
                  for w in worlds},
    }


def run(args, partial: dict) -> dict:
    shape, device = (DRY, "cpu") if args.dry_run else (LLAMA3_8B, "cuda:0")
    plan = _plan(args.dry_run, device)
    partial.update(shape=asdict(shape), device=device, rounds=[], worlds={})
    freeze_imports()
    model = build_model(shape)
    state = Path(args.state)
    world1: list[TuneResult] = []
    for r, order in enumerate(plan["rounds"]):
        times = {}
        for world in order:
            last = r == len(plan["rounds"]) - 1 and world == 1  # its steady iterations end profiled
            spec = plan["one_lane"](world, PROFILED[1] if last else 0)
            res = tune_block(model, shape, spec, device, state / "trace_world1.json" if last else None)
            times["serial" if world is None else "dpq1"] = res.median_ms
            if world == 1:
                world1.append(res)
        partial["rounds"].append(times)
    partial["issuing"] = {"1": issuing_of(world1)}
    ratios = [r["dpq1"] / r["serial"] for r in partial["rounds"] if r.get("serial") and r.get("dpq1")]
    partial["dpq_world1_vs_serial"] = round(statistics.fmean(ratios), 4) if ratios else None
    one_lane = statistics.median(r["dpq1"] for r in partial["rounds"] if r.get("dpq1"))
    for w, spec in plan["debug"].items():
        entry = partial["worlds"].setdefault(str(w), {})
        entry["identical"] = _identical(model, shape, spec, device)
        trace_to = state / f"trace_world{w}.json"
        timed = tune_block(model, shape, plan["timed"][w], device, trace_to if plan["timed"][w].profiled else None)
        entry.update(timed=timed.as_dict(), one_lane_ms=one_lane)
        partial["issuing"][str(w)] = issuing_of([timed])
        if timed.median_ms is not None:
            entry["vs_one_lane_ms"] = round(timed.median_ms - one_lane, 3)
            entry["per_lane_undivided_ms"] = round((timed.median_ms - one_lane) / (w - 1), 3)
        if trace_to.is_file() and w == 2:  # the one trace the run returns (the device tool returns 8 files)
            with open(trace_to, "rb") as src, gzip.open(Path(args.out) / f"trace_world{w}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(issuing_line(partial["issuing"]))
    partial["goal"] = {f"dpq world 1 <= {WORLD1_GOAL}x serial": None if partial["dpq_world1_vs_serial"] is None else
                       ("met" if partial["dpq_world1_vs_serial"] <= WORLD1_GOAL else "not met")}
    proofs = _proofs(partial)
    if args.dry_run:  # CPU lanes: the pipeline ran, but nothing here is a GPU's evidence
        partial["cpu_evidence"], proofs = proofs, dict.fromkeys(PROOFS, NOT_DRY)
    partial["proofs"] = proofs
    return partial


def issuing_of(runs: list[TuneResult]) -> dict:
    """One world's issuing thread (Note [the issuing thread's CPU time]): the medians over ``runs``'
    unprofiled timed iterations of the wall and the CPU ms, and the GPU's busy ms in their profiled ones."""
    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    busy = [r.profile["gpu_busy_ms_per_iteration"] for r in runs if r.profile.get("gpu_busy_ms_per_iteration")]
    return {"wall_ms": median([ms for r in runs for ms in r.iteration_ms]),
            "thread_cpu_ms": median([ms for r in runs for ms in r.thread_cpu_ms]),
            "thread_cpu_aside_ms": median([ms for r in runs for ms in r.thread_cpu_aside_ms]),
            "process_cpu_ms": median([ms for r in runs for ms in r.process_cpu_ms]),
            "gpu_busy_ms": median(busy), "iterations": sum(len(r.thread_cpu_ms) for r in runs)}


def issuing_line(issuing: dict) -> str:
    """The step's printed line: per world, the issuing thread's CPU ms per iteration (unprofiled), its
    wall and the GPU's busy ms."""
    def ms(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    return "lanes: issuing thread per iteration (time.thread_time, unprofiled; wall; GPU busy, profiled): " + "; ".join(
        f"world {w} {ms(e['thread_cpu_ms'])} ms CPU ({ms(e['thread_cpu_aside_ms'])} in the wait and backward), "
        f"wall {ms(e['wall_ms'])}, busy {ms(e['gpu_busy_ms'])}" for w, e in issuing.items())


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
