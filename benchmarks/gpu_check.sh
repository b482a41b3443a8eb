#!/usr/bin/env bash
# dpq's one-GPU validation for a lent single-H200 machine (the `device` tool). UNTESTED ON A GPU:
# written against the torch / CuPy / NCCL APIs without a GPU to run it on; only --dry-run has run.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; outputs under $OUT (else out/gpu_check)
#   bash benchmarks/gpu_check.sh --dry-run  # CPU only (~7 s of CPU): what needs CUDA says "skipped: no CUDA (dry run)"
#
# The plan (steps, time budgets, what each proves) is benchmarks/gpu_check.py's PLAN, printed first;
# each step runs under its own timeout and the budgets add up to less than the 8 minutes a lent GPU
# allows (give the device tool timeout_s=540). A failed versions step (a missing wheel) stops the
# run there. summary.json lists, per property, "passed", "failed: ..." or "not proven: ..." (what
# this machine cannot show, e.g. NCCL send/recv between two ranks on NCCL < 2.30, is never "passed").
# Outputs under $OUT (at most 4 files): summary.json (every step: status, rc, seconds, result, and the
# proofs), gpu_check.log (all steps' output), trace_world2.json.gz (the profiler trace).
#
# The H200 image has CUDA torch, CuPy (cupy-cuda13x) and NCCL (nvidia-nccl-cu13), no network, and
# lacks auto-round and some of its pure-Python needs. Bring them as wheels in .whl/ (ignored; name
# it in the device tool's `carry`), made on a machine with pip:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     auto-round==0.16.1 datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection
# (the modules auto-round imported in a CPU run that the image's package list lacks; step a) names
# any module still missing and stops). HF_HUB_OFFLINE=1: nothing is fetched.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-python3}"
STATE="$(mktemp -d)"
trap 'rm -rf "$STATE"' EXIT
LOG="$OUT/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Before CUDA starts in any step: cuBLAS's reproducible workspace (the bitwise checks run with
# torch.use_deterministic_algorithms), and two NCCL ranks on one GPU where NCCL >= 2.30 allows it.
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_MULTI_RANK_GPU_ENABLE=1

if [ -z "$DRY" ] && ! "$PY" -c "import auto_round" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >>"$LOG" 2>&1 || echo "installing .whl/ failed (see $LOG)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "auto-round is not installed and no .whl/ was carried: see the top of $0" | tee -a "$LOG"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" benchmarks/gpu_check.py plan 2>&1 | tee -a "$LOG"

step() {  # step NAME SECONDS: gpu_check.py NAME under a timeout; output appended to the log
  local name=$1 limit=$2
  # the budgets are the H200's; a dry run on a shared CPU machine gets four times as long (its CPU
  # time is what the suite holds to a bound)
  [ -n "$DRY" ] && limit=$((limit * 4))
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$PY" benchmarks/gpu_check.py "$name" --state "$STATE" --out "$OUT" $DRY </dev/null 2>&1 \
    | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "$rc $limit $((SECONDS - t0))" >"$STATE/$name.rc"
  echo "=== $name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)') after $((SECONDS - t0))s" | tee -a "$LOG"
  return "$rc"
}

stopped=""
while read -r name limit; do
  if [ -n "$stopped" ]; then
    echo "skipped 0 0" >"$STATE/$name.rc"
    echo "=== $name: skipped ($stopped)" | tee -a "$LOG"
    continue
  fi
  if ! step "$name" "$limit" && [ "$name" = versions ]; then
    stopped="the versions step failed: see its missing wheels"
  fi
done < <("$PY" benchmarks/gpu_check.py plan --names)
"$PY" benchmarks/gpu_check.py summarize --state "$STATE" --out "$OUT" $DRY 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "summary: $OUT/summary.json (exit $rc)"
exit "$rc"
