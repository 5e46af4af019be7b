#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool): build the extension for the torch found
# there, run the tests (GPU-marked ones included), the latency benchmark and the GPU floor
# benchmark under MPS, and leave full logs and JSON under $OUT.
#
#   usage: bash scripts/device_run.sh [STAGE...]   (OUT defaults to ./device_out)
#   stages: build floors tests overhead bench bench-quick   (default: all but bench-quick)
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=${*:-build floors tests overhead bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

step "machine"
{ nvidia-smi; nproc; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } \
  > "$OUT/machine.txt" 2>&1
head -3 "$OUT/machine.txt"

if has build; then
step "build"
if ! MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "build failed"; tail -30 "$OUT/build.log"; exit 1
fi
fi


step "MPS start"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && sleep 1
trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT

if has floors; then
  step "floors"
  bash benchmarks/floors/build.sh > "$OUT/floors_build.log" 2>&1 || status=1
  benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1 || status=1
  tail -25 "$OUT/floors.log"
fi

if has tests; then
  step "tests"
  python3 -m pytest -q tests -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
  tail -5 "$OUT/tests.log"
fi

if has overhead; then
  step "overhead"
  python3 benchmarks/overhead.py --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1 || status=1
  tail -5 "$OUT/overhead.log"
fi

if has bench; then
  step "bench"
  python3 -m resident_pg.bench --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  tail -80 "$OUT/bench.log"
fi
if has bench-quick; then
  step "bench (quick)"
  python3 -m resident_pg.bench --quick --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  tail -40 "$OUT/bench.log"
fi
exit $status
