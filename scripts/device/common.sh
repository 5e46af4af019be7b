# Sourced by scripts/device_run.sh: $OUT, the test-failure log, the GPU selection, the helpers
# every job uses (step, has, bounded, all_gpus), the machine record and the MPS daemon.

OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some stages run from another directory
# Every test stage appends each failure's text here as it happens (tests/conftest.py), so a
# stage cut off by its time bound still says why.
export RESIDENT_TESTS_FAIL_LOG=${RESIDENT_TESTS_FAIL_LOG:-$OUT/test_failures.log}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

# On a machine with several GPUs every stage but multi-gpu uses GPU 0 only (ranks share it
# under MPS, as on the one-GPU machine), so that one machine can run every stage and the
# single-GPU figures keep their meaning; multi-gpu gets the GPUs that were visible.
ALL_GPUS_SET=${CUDA_VISIBLE_DEVICES+x}
ALL_GPUS=${CUDA_VISIBLE_DEVICES-}
if (( $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') > 1 )) && [[ -z "$ALL_GPUS_SET" ]]; then
  export CUDA_VISIBLE_DEVICES=0
  echo "several GPUs: the single-GPU stages use GPU 0 (multi-gpu uses all)"
fi
all_gpus_env() {  # env(1) arguments for the GPUs that were visible when the script started
  if [[ -n "$ALL_GPUS_SET" ]]; then echo "CUDA_VISIBLE_DEVICES=$ALL_GPUS"; else echo "-u CUDA_VISIBLE_DEVICES"; fi
}
all_gpus() { env $(all_gpus_env) "$@"; }  # runs a command with those GPUs
# bounded SECONDS CMD...: CMD (a program, not a function of this script) in a process group
# of its own, stopped after SECONDS; then whatever is left of that group is killed. A pytest
# stopped by its bound leaves its spawned ranks behind otherwise, and they keep their MPS
# clients: the next stage's first group then fails with "CUDA-capable device(s) is/are busy or
# unavailable" (seen on the H200 under MPS).
bounded() {
  local limit=$1; shift
  setsid timeout -k 15 "$limit" "$@" &
  local pid=$!
  wait "$pid"; local rc=$?
  kill -KILL -- "-$pid" 2> /dev/null
  return "$rc"
}

machine_record() {
  step "machine"
  { nvidia-smi; nproc; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } \
    > "$OUT/machine.txt" 2>&1
  head -3 "$OUT/machine.txt"
}

# The MPS daemon for every later stage (ranks share the one GPU); stopped when the script exits.
mps_start() {
  step "MPS start"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && sleep 1
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
}

# The device tool brings back at most 8 files of $OUT, the first by name: past that, everything
# also goes into $OUT/all.tgz, which sorts first. Then the test failures, first lines.
finish() {
  if (( $(find "$OUT" -maxdepth 1 -type f ! -name all.tgz | wc -l) > 8 )); then
    # written beside $OUT and moved in: tar reading the folder it writes into warns and fails
    tar czf /tmp/resident_all.tgz -C "$OUT" --exclude=all.tgz . && mv /tmp/resident_all.tgz "$OUT/all.tgz" \
      && echo "more than 8 files: all in all.tgz"
  fi
  if [[ -s "$RESIDENT_TESTS_FAIL_LOG" ]]; then
    step "test failures: $(grep -c '^===== ' "$RESIDENT_TESTS_FAIL_LOG") (the first 40 lines; all in $RESIDENT_TESTS_FAIL_LOG)"
    head -40 "$RESIDENT_TESTS_FAIL_LOG" | cut -c1-300
  fi
}
