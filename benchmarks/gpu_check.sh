#!/usr/bin/env bash
# dpq's one-GPU check for a lent single-H200 machine (the `device` tool). First run on an H200 on
# 2026-12-04 (docs/PERFORMANCE.md, "Measured on a GPU"); its budgets are what that lease measured.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine: core steps, then the rest (655 s of budgets)
#   bash benchmarks/gpu_check.sh --core          # the core steps only (360 s): the first call of a lease
#   bash benchmarks/gpu_check.sh --rest          # versions and the steps outside the core, after a --core run
#   bash benchmarks/gpu_check.sh --only=race,cli # versions and the steps named: a rerun of those
#   bash benchmarks/gpu_check.sh --dry-run       # CPU only: CUDA steps say "skipped: no CUDA (dry run)"
#   bash benchmarks/gpu_check.sh --fetch-wheels  # here, with the package index: the pinned wheels into .whl/
#
# The plan (steps, budgets, what each proves) is printed first; its last line is
# `gpu_check_plan core_s=<n> total_s=<m>`. Each step runs under its own timeout (a dry run gets four
# times as long). A failed versions step (a missing wheel) stops the run there. Outputs under $OUT
# (else out/gpu_check), up to five files: summary.json (every step and proof: "passed", "failed: ..."
# or "not proven: ..."), calibration.json (dpq-calibration/1, for the timeline model), gpu_check.log,
# trace_world2.json.gz (lanes), csan_report.txt (race). `python -m benchmarks.gpu_report OUT1 [OUT2 ...]
# --write` puts one lease's runs into docs/PERFORMANCE.md and the calibration under benchmarks/calibration/.
#
# The H200 image has CUDA torch 2.11, CuPy and NCCL, no network, and lacks auto-round and some of its
# pure-Python needs: benchmarks/gpu_wheels.txt pins them (tests/test_gpu_wheels.py resolves the set
# offline against the image's package list). Bring them in .whl/ (ignored; name it in the device
# tool's `carry`): `bash benchmarks/gpu_check.sh --fetch-wheels` here, then on the device tool:
#   run(command="bash benchmarks/gpu_check.sh --core", carry=[".whl"], timeout_s=400)
# then at once (the machine stays warm 30 s) the same with --rest, timeout_s=360; what is left reruns
# named steps (--only=race,cli).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY="" PART="all"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY="--dry-run" ;;
    --core) PART="core" ;;
    --rest) PART="rest" ;;
    --only=*) PART="${arg#--only=}" ;;
    --fetch-wheels)
      PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
      exec "$PY" -m dpqlab.gpu_check.wheels fetch --dest .whl ;;
    *) echo "unknown argument: $arg (see the top of $0)" >&2; exit 2 ;;
  esac
done
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

"$PY" -m dpqlab.gpu_check plan --part "$PART" 2>&1 | tee -a "$LOG"

step() {  # step NAME SECONDS: one step under a timeout; output appended to the log
  local name=$1 limit=$2
  [ -n "$DRY" ] && limit=$((limit * 4))
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$PY" -m dpqlab.gpu_check "$name" --state "$STATE" --out "$OUT" $DRY </dev/null 2>&1 \
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
done < <("$PY" -m dpqlab.gpu_check plan --names --part "$PART")
"$PY" -m dpqlab.gpu_check summarize --state "$STATE" --out "$OUT" $DRY --part "$PART" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "summary: $OUT/summary.json, calibration: $OUT/calibration.json (exit $rc)"
exit "$rc"
