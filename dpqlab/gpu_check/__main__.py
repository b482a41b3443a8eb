"""``python -m dpqlab.gpu_check STEP``: one step of the GPU check (``benchmarks/gpu_check.sh``
runs them in the plan's order, each under its own timeout), ``plan``, or ``summarize``.

Each step writes ``STATE/<step>.json``: its status ("passed", "failed: ...", "timed out", or
"skipped: ..."), its result and its proofs. A step stopped by the shell's timeout (SIGTERM) writes
what it had measured until then, as "timed out"."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path

from dpqlab.gpu_check import nccl, race
from dpqlab.gpu_check.common import SKIP_DRY, any_failed
from dpqlab.gpu_check.plan import PARTS, STEPS, names, plan_text
from dpqlab.gpu_check.summary import summarize

HIDDEN = {"race-tune": race.race_tune, "nccl-hang": nccl.nccl_hang}  # subprocesses of race and nccl


class StepTimedOut(Exception):
    """The shell's timeout sent SIGTERM."""


def _on_term(signum, frame):
    raise StepTimedOut("stopped by the step's timeout (SIGTERM)")


def run_step(name: str, args) -> int:
    partial: dict = {}
    signal.signal(signal.SIGTERM, _on_term)
    t0 = time.perf_counter()
    try:
        result = STEPS[name].module.run(args, partial)
        status = result.pop("status", "passed")
        if any_failed(result.get("proofs") or {}):
            status = "failed: a proof failed"
    except StepTimedOut:
        result, status = partial, "timed out"
    except Exception as e:
        traceback.print_exc()
        result, status = dict(partial, error=f"{type(e).__name__}: {e}"[:4000]), "failed"
    entry = {"status": status, "result": result, "step_seconds": round(time.perf_counter() - t0, 2)}
    Path(args.state, f"{name}.json").write_text(json.dumps(entry, indent=1, default=str))
    print(f"{name}: {status}")
    return 0 if status in ("passed", SKIP_DRY) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpqlab.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "summarize", "plan", *HIDDEN])
    p.add_argument("--state", help="folder for each step's result and its traces")
    p.add_argument("--out", help="folder for the summary, the calibration, the log and one trace")
    p.add_argument("--dry-run", action="store_true", help="CPU only: CUDA steps are skipped, the rest run small")
    p.add_argument("--part", default="all",
                   help=f"plan and summarize: one of {PARTS} (rest: versions and the non-core steps), or step names "
                        "joined by commas")
    p.add_argument("--names", action="store_true", help="plan: one 'step budget' line per step (for the .sh)")
    p.add_argument("--sanitizer-timeout", type=int, default=60)
    p.add_argument("--blob", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)  # race-tune: which sanitized run
    p.add_argument("--control", action="store_true", help=argparse.SUPPRESS)  # race-tune: plant the control race
    args = p.parse_args(argv)
    if args.step == "plan":
        print(names(args.part) if args.names else plan_text(args.part))
        return 0
    if args.step == "summarize":
        return summarize(Path(args.state), Path(args.out), args.dry_run, args.part)
    if args.step in HIDDEN:
        print(json.dumps(HIDDEN[args.step](args), default=str))
        return 0
    return run_step(args.step, args)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
