#!/usr/bin/env bash
# dpq's one-GPU validation for a lent single-H200 machine (the `device` tool). UNTESTED ON A GPU:
# written against the torch / CuPy / NCCL APIs without a GPU to run it on; only --dry-run has run.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; outputs under $OUT (else out/gpu_check)
#   bash benchmarks/gpu_check.sh --dry-run  # CPU only, < 60 s: what needs CUDA says "skipped: no CUDA (dry run)"
#
# Steps (the logic is benchmarks/gpu_check.py, one subcommand per step), each under its own timeout;
# the limits add up to 470 s, inside the 8 minutes a lent GPU allows (give the tool timeout_s=540):
#   a) versions  torch, CUDA, NCCL (torch.cuda.nccl.version()), CuPy and its NCCL, auto-round     30 s
#   b) nccl      both NCCL communicators, one rank on cuda:0, every collective x fp32/bf16/uint8;
#                with NCCL >= 2.30, two CuPy ranks on cuda:0 (NCCL_MULTI_RANK_GPU_ENABLE=1):
#                every collective and both exchanges, bitwise across ranks                         60 s
#   c) race      world 2 on cuda:0,cuda:0 with the identical-state check under
#                TORCH_CUDA_SANITIZER=1; with torch.cuda._sleep on the default stream before the
#                block and on lane streams before each step; world 1 vs serial auto-round, bitwise;
#                local / p2p / host communicators bitwise equal                                     130 s
#   d) suite     pytest without the CLI subprocess tests (dry run: --collect-only)                 100 s
#   e) timing    bf16 Llama-shaped block (hidden 4096, seq 2048, batch 8): serial vs dpq world 1,
#                2 and 4 lanes on the one GPU, mirror price vs measured peak, one profiler trace
#                of a world-2 block with the lanes' kernel overlap                                   150 s
# Outputs under $OUT (at most 4 files): summary.json (every step: status, rc, seconds, result),
# gpu_check.log (all steps' output), trace_world2.json.gz (the profiler trace).
#
# The H200 image has CUDA torch, CuPy (cupy-cuda13x) and NCCL (nvidia-nccl-cu13), no network, and
# lacks auto-round and some of its pure-Python needs. Bring them as wheels in .whl/ (ignored; name
# it in the device tool's `carry`), made on a machine with pip:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     auto-round==0.16.1 datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection
# (the modules auto-round imported in a CPU run that the image's package list lacks; step a)
# records auto-round's import error if one is still missing). HF_HUB_OFFLINE=1: nothing is fetched.
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

step() {  # step NAME SECONDS [VAR=value ...]: gpu_check.py NAME under a timeout; output appended to the log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$limit" env "$@" "$PY" benchmarks/gpu_check.py "$name" --state "$STATE" --out "$OUT" $DRY \
    2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "$rc $limit $((SECONDS - t0))" >"$STATE/$name.rc"
  echo "=== $name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$LOG"
}

step versions 30
step nccl 60 NCCL_MULTI_RANK_GPU_ENABLE=1
step race 130
step suite 100
step timing 150
"$PY" benchmarks/gpu_check.py summarize --state "$STATE" --out "$OUT" $DRY 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "summary: $OUT/summary.json (exit $rc)"
exit "$rc"
