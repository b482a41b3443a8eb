"""The suite step (not core): the GPU-relevant tests (watchdog, NCCL lifecycle, memory, issuer marks,
inputs on another device type), run with the machine's CUDA torch and CuPy; the selection is checked
against the files first (a stale exclusion would let a slow test in unnoticed)."""

from __future__ import annotations

import subprocess
import sys
import time

from dpqlab.gpu_check.common import ROOT, check, verdict

PROOFS = ["suite subset"]
# The suite step: the tests of the GPU paths (the watchdog, NCCL's lifecycle, memory and its price,
# the communication streams) run with the box's CUDA torch and CuPy installed, and the one test that
# needs a second device type; those among them that tune whole blocks on CPU lanes (tens of seconds
# each, nothing GPU-specific in them) are left out.
SUITE = ["tests/test_watchdog.py", "tests/test_nccl_lifecycle.py", "tests/test_memory.py", "tests/test_comm_streams.py",
         "tests/test_api.py::test_inputs_on_another_device"]
SUITE_EXCLUDE = ["mirror_price", "lane_streams", "prices_what_every_lane", "ordered_and_change", "missing_join",
                 "parallel_tune_with_overlap", "comm_lanes_have"]
PYTEST_DEADLINE_S = 75  # inside the plan's budget for the step (90 s): the step then reports what pytest printed
SUITE_K = " and ".join(f"not {name}" for name in SUITE_EXCLUDE)


def suite_selection() -> dict:
    """The suite step's tests, read from the files (nothing imported): every node named in
    :data:`SUITE` exists, every name in :data:`SUITE_EXCLUDE` leaves out at least one test (a stale
    exclusion would let a slow test in unnoticed), and what is left."""
    import ast

    selected, problems, excluded = [], [], {name: 0 for name in SUITE_EXCLUDE}
    for node in SUITE:
        path, _, only = node.partition("::")
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
            continue
        tests = [f.name for f in ast.parse(file.read_text()).body
                 if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name.startswith("test")]
        if only and only not in tests:
            problems.append(f"{node}: no such test")
        for name in [only] if only else tests:
            hits = [x for x in SUITE_EXCLUDE if x in name]
            for x in hits:
                excluded[x] += 1
            if not hits:
                selected.append(f"{path}::{name}")
    problems += [f"-k 'not {x}' leaves out no test" for x, n in excluded.items() if n == 0]
    return {"selected": selected, "problems": problems}


def run(args, partial: dict) -> dict:
    cmd = [sys.executable, "-m", "pytest", *SUITE, "-k", SUITE_K, "-p", "no:cacheprovider"]  # -q from pyproject
    sel = suite_selection()
    out = {"command": " ".join(cmd[1:]), "tests": len(sel["selected"]), "problems": sel["problems"]}
    check(not sel["problems"] and sel["selected"], f"the suite subset is stale: {sel['problems']}")
    if args.dry_run:  # the selection is checked above; pytest runs on the GPU box only
        out["proofs"] = {"suite subset": "not proven: selection checked, not run (dry run)"}
        return out
    t0 = time.perf_counter()
    try:  # ended before the shell's limit, so what pytest printed is kept
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=PYTEST_DEADLINE_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(tail[-6000:])
        out.update(seconds=round(time.perf_counter() - t0, 1), rc=None, tail=tail[-3000:],
                   summary=f"pytest ran past {PYTEST_DEADLINE_S} s")
        out["proofs"] = {"suite subset": f"failed: pytest ran past {PYTEST_DEADLINE_S} s"}
        check(False, out["summary"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    out.update(rc=proc.returncode, summary=lines[-1] if lines else "")
    out["proofs"] = {"suite subset": verdict(proc.returncode == 0, out["summary"])}
    check(proc.returncode == 0, f"pytest exited {proc.returncode}: {out['summary']}")
    return out
