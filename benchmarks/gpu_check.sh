#!/usr/bin/env bash
# dpq's GPU check, prepared for a lent single-H200 machine (the `device` tool). Not run yet.
#
#   bash benchmarks/gpu_check.sh      # from the repository root; outputs under $OUT (else out/gpu_check)
#
# What it runs, each step under its own timeout (about 8.5 minutes in all; give the device
# tool timeout_s=590):
#   1. versions: GPU, torch, CuPy, auto-round
#   2. the test suite (CUDA tests run where a GPU is present; the rest as on CPU)
#   3. benchmarks/report.py on CUDA lanes: serial auto-round vs dpq world 1 vs world 2, the two
#      lanes on the same GPU with separate streams (local communicator), plus the in-process
#      communicators' all_reduce on those lanes. Two lanes on ONE GPU share it: this measures
#      overlap and overhead, not a multi-GPU speedup.
#   4. benchmarks/bench_comms.py (pytest-benchmark)
#
# The H200 image has CUDA torch, CuPy and NCCL, no network, and lacks auto-round and some of
# its needs. Bring them as wheels in .whl/ (ignored; name it in the tool's carry), made here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     auto-round==0.16.1 datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection
# (the modules auto-round imported in a CPU run here that the image's package list lacks;
# step 1 prints `pip check` to show anything else missing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
failed=()

step() {  # step NAME SECONDS COMMAND... : run with a timeout, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
  [ "$rc" = 0 ] || failed+=("$name")
}

# -- packages: auto-round from carried wheels if missing; dpq from this working tree --------
if ! "$PY" -c "import auto_round" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "auto-round is not installed and no .whl/ was carried: see the top of $0"
    exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# dpq's cuda extra is CuPy + NCCL; the image has cupy-cuda13x and nvidia-nccl-cu13. Install
# only if absent and carried (pip cannot reach a registry there).
if ! "$PY" -c "import cupy" 2>/dev/null && compgen -G ".whl/cupy*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/cupy*.whl .whl/nvidia_nccl*.whl
fi

step versions 60 bash -c "nvidia-smi -L; $PY -c 'import torch, auto_round, dpq; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); print(\"auto-round\", auto_round.__version__, \"dpq\", dpq.__version__)'; $PY -c 'import cupy; print(\"cupy\", cupy.__version__)' || echo 'no cupy'; $PY -m pip check | head -20"
step tests 180 "$PY" -m pytest tests -q -x -p no:cacheprovider
step report 240 "$PY" benchmarks/report.py --devices cuda:0,cuda:0 --iters 100 --short-iters 20 --out "$OUT"
step comms 90 "$PY" -m pytest benchmarks/bench_comms.py --benchmark-only -q -p no:cacheprovider \
  --benchmark-json "$OUT/bench_comms.json"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (logs in $OUT)"
  exit 1
fi
echo "all steps passed; outputs in $OUT"
