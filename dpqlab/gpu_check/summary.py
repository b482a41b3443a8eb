"""The run's two outputs: ``summary.json`` (every step's status, budget, seconds and result, and
every proof's verdict) and ``calibration.json`` (schema ``dpq-calibration/1``,
``dpqlab/timeline/calibration.py``: what the paths and lanes steps measured, for the timeline
model). A proof whose step did not run, failed before its verdict or timed out reads "not proven",
never "passed"."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dpqlab.gpu_check.block import BlockShape
from dpqlab.gpu_check.common import SKIP_DRY, any_failed
from dpqlab.gpu_check.plan import PLAN, budgets, chosen
from dpqlab.timeline.calibration import SCHEMA

PASSING = ("passed", SKIP_DRY)
GPU_CLASSES = {"H200": "h200", "H100": "h100", "3090": "3090"}  # the timeline model's classes, by card name
PHASES_NOTE = ("GPU time per iteration by kernel class (dpqlab/gpu_check/trace.py); under torch.compile the "
               "quantize-dequantize phases are inductor's kernels whose names hold 'round' (an approximation), "
               "eagerly they are the kernels launched inside the wrapper's quantize-dequantize and its backward")


def gpu_class(card: str) -> str:
    return next((c for key, c in GPU_CLASSES.items() if key in card), "")


def read_steps(state: Path, part: str = "all") -> dict[str, dict]:
    """Each planned step's entry: its result file, its exit code and seconds from the shell."""
    steps = {}
    for step in chosen(part):
        f, rc_file = state / f"{step.name}.json", state / f"{step.name}.rc"
        entry = json.loads(f.read_text()) if f.exists() else {}
        if rc_file.exists():
            rc, budget, secs = rc_file.read_text().split()
            entry.update(rc=int(rc) if rc.lstrip("-").isdigit() else rc, limit_s=int(budget), seconds=float(secs),
                         timed_out=rc in ("124", "137"))
            if not f.exists():
                entry["status"] = "timed out" if entry["timed_out"] else (
                    "skipped: versions failed" if rc == "skipped" else "failed (no result written)")
        else:
            entry.setdefault("status", "not run")
        steps[step.name] = entry
    return steps


def proofs_of(steps: dict[str, dict]) -> dict[str, str]:
    proofs = {}
    for step in (s for s in PLAN if s.name in steps):
        entry = steps[step.name]
        got = (entry.get("result") or {}).get("proofs") or {}
        for p in step.proofs:
            proofs[p] = got.get(p) or f"not proven: the {step.name} step {entry.get('status', 'did not run')}"
    return proofs


def calibration(steps: dict[str, dict], date: str) -> dict:
    """calibration.json from the versions, paths and lanes steps' results (what they did not
    measure is absent: the model keeps its own figure there)."""
    v = (steps.get("versions") or {}).get("result") or {}
    p = (steps.get("paths") or {}).get("result") or {}
    lanes = (steps.get("lanes") or {}).get("result") or {}
    card = v.get("card", "unknown")
    out: dict = {"schema": SCHEMA, "card": card, "gpu_class": gpu_class(card), "date": date,
                 "driver": v.get("driver"), "torch": v.get("torch"), "auto_round": v.get("auto_round"),
                 "command": "bash benchmarks/gpu_check.sh", "phases_note": PHASES_NOTE}
    if p.get("shape"):
        out["block"] = BlockShape(**p["shape"]).as_calibration()
    paths: dict = {}
    compile_s = None
    for run in (p.get("runs") or {}).values():
        spec, prof = run["spec"], run.get("profile") or {}
        path = "compile" if spec["compile"] else "eager"
        paths.setdefault(path, {})[str(spec["batch"])] = {
            "iteration_ms": run.get("median_ms"), "phases_ms": prof.get("phases_ms", {}),
            "host_ms_per_iteration": prof.get("host_ms_per_iteration"),
            "launches_per_iteration": prof.get("launches_per_iteration"),
            "thread_cpu_ms_per_iteration": (run.get("cpu_median") or {}).get("thread_cpu_ms")}
        if spec["compile"] and compile_s is None:
            compile_s = run.get("compile_s")
    out["paths"] = paths
    out["compile_s"] = {"block": compile_s, "second_device": None}  # one GPU: no second lane device
    out["dpq_world1_vs_serial"] = lanes.get("dpq_world1_vs_serial")
    out["dpq_issuing"] = dpq_issuing(lanes)
    out.update(p.get("ceilings") or {})
    return out


def dpq_issuing(lanes: dict) -> dict | None:
    """dpq's issuing thread on lanes of one GPU (compile on, the block at batch 8 over the lanes): the
    profiled world's own ms per iteration (outside blocking calls, the readback wait and the backward
    call) and per lane-iteration, with its outermost ops; every world's unprofiled wall per
    iteration (the bound of Note [the profiler's bound], dpqlab/timeline/calibration.py); and
    per world 1, 2, 4 the issuing thread's own CPU ms per unprofiled iteration (``time.thread_time``:
    Note [the issuing thread's CPU time], dpqlab/gpu_check/block.py), the process's, and the GPU's
    busy ms: what the timeline model's host costs are re-based on (the CPU time where present, the
    walls only as a bound). None when the step measured none of it."""
    worlds = sorted((lanes.get("worlds") or {}).items(), key=lambda kv: int(kv[0]))
    walls = {str(w): ms for w, e in worlds if (ms := (e.get("timed") or {}).get("median_ms"))}
    issuing = lanes.get("issuing") or {}
    walls.update({w: e["wall_ms"] for w, e in issuing.items() if e.get("wall_ms")})
    out: dict = {}
    for w, entry in worlds:
        profile = ((entry.get("timed") or {}).get("profile")) or {}
        own = profile.get("issuing_own_ms_per_iteration")
        if own:
            ops = profile.get("issuing_ops_per_iteration") or {}
            out = {"world": int(w), "own_ms_per_iteration": own, "own_ms_per_lane_iteration": round(own / int(w), 3),
                   "ops_per_lane_iteration": {k: v / int(w) for k, v in ops.items()} or None}
            break
    by_world = {key: {w: e[field] for w, e in sorted(issuing.items(), key=lambda kv: int(kv[0])) if e.get(field)}
                for key, field in (("thread_cpu_ms_per_iteration", "thread_cpu_ms"),
                                   ("thread_cpu_aside_ms_per_iteration", "thread_cpu_aside_ms"),
                                   ("process_cpu_ms_per_iteration", "process_cpu_ms"),
                                   ("gpu_busy_ms_per_iteration", "gpu_busy_ms"))}
    if not out and not by_world["thread_cpu_ms_per_iteration"]:
        return None
    if "world" not in out:  # no profiled world: the CPU time's smallest world of several lanes
        several = sorted(int(w) for w in by_world["thread_cpu_ms_per_iteration"] if int(w) > 1)
        out["world"] = several[0] if several else 1
    walls = dict(sorted(walls.items(), key=lambda kv: int(kv[0])))
    return {"world": out.pop("world"), "path": "compile", "batch": 8, **out, "wall_ms_per_iteration": walls,
            **{k: v for k, v in by_world.items() if v}}


def summarize(state: Path, out: Path, dry_run: bool, part: str = "all") -> int:
    steps = read_steps(state, part)
    proofs = proofs_of(steps)
    ok = all(e.get("status") in PASSING for e in steps.values()) and not any_failed(proofs)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    core_s, total_s = budgets(part)
    summary = {"dry_run": dry_run, "passed": ok, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "core_only": part == "core", "part": part, "budget_s": {"core": core_s, "total": total_s},
               "proofs": proofs, "steps": steps}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "calibration.json").write_text(json.dumps(calibration(steps, date), indent=1, default=str))
    print(json.dumps({k: v.get("status") for k, v in steps.items()}, indent=1))
    print("proofs:")
    for name, v in proofs.items():
        print(f"  {name}: {v.splitlines()[0][:200]}")
    return 0 if ok else 1
