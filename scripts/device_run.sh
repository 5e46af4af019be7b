#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool): build the extension for the torch found
# there, run the tests (GPU-marked ones included), the latency benchmark and the GPU floor
# benchmark under MPS, and leave full logs and JSON under $OUT.
#
#   usage: bash scripts/device_run.sh [STAGE...]   (OUT defaults to ./device_out)
#   stages: build build-if-needed floors tests gpu-tests gpu-tests-ws2 gpu-tests-tcp
#           overhead bench bench-cuda bench-tcp bench-ab bench-protocol bench-small bench-p2p bench-quick doctor examples multi-gpu
#           p2p-debug p2p-order-suite p2p-order-probe gpu-tests-own
#           interference poll-probe replica-probe pdl-probe ar8-probe ar64k-probe proxy8-probe proxy-copy-probe
#           p2p-timeline proxy-trace
#           (default: build floors tests overhead bench)
#   On a machine with several GPUs every stage but multi-gpu runs on GPU 0 alone.
#   Test stages append each failure's text to $OUT/test_failures.log as it happens (printed
#   at the end), so a stage cut off by its time bound still says why.
#   bench:       CPU ladder ($OUT/bench.json, ~1.5 min on the H200 host) and CUDA ladder
#                (resident direct + proxy path, eager + graph mode, 2/4/8 ranks on the one
#                GPU under MPS, ratios to $OUT/floors.json and, for rows over tcp,
#                $OUT/tcp_floors.json: $OUT/bench_cuda.json, ~2-3 min, no new group after
#                4 min) and its plot $OUT/latency_cuda.png.  Without a floors stage in the same
#                call the floors are measured first (~20 s).
#   bench-quick: the same, short (~1 min in all).
#   bench-cuda:  only the CUDA ladder (as in `bench`).
#   bench-ab:    2 ranks, graph mode, both paths: the defaults beside RESIDENT_GPU_PREFETCH=0 and
#                (proxy) RESIDENT_GPU_PROXY_STREAMING=0 and RESIDENT_GPU_TRIGGER_FENCE=1, side by
#                side in one run ($OUT/bench_ab.json, ~1 min; $RESIDENT_AB_BACKENDS, $RESIDENT_AB_SIZES).
#   interference: the interference benchmark: a bf16 decode GEMM alone and next to all_reduces,
#                per mode ($RESIDENT_INTERFERENCE_MODES, default "default"; "proxy": RESIDENT_PATH=proxy;
#                world sizes $RESIDENT_INTERFERENCE_WS, default "2", e.g. "2 4 8";
#                $OUT/interference_ws<N>.{json,log}, ~1 min per world size;
#                $RESIDENT_INTERFERENCE_LIMIT_S).
#   poll-probe:  scripts/ll_poll_probe.cu: LL lines through mapped host memory, writer and
#                reader kernels in one process, serial and with the reader polling first, per
#                poll mode and block count, the credit wait, a late sender with abort-word
#                reads ($RESIDENT_POLL_PROBE_SECTIONS: sweep,credit,abort) ($OUT/poll_probe.jsonl, ~10 s).
#   replica-probe: scripts/replica_poll_probe.cu: two blocks ping-pong an LL line through mapped
#                host memory, the line stored as K copies at a stride and polled by K staggered
#                warps; and one uncached host read's round trip ($OUT/replica_probe.jsonl, ~10 s).
#   pdl-probe:   scripts/pdl_chain_probe.cu: per-node time of a graph of back-to-back kernels:
#                plain, PDL with griddepcontrol.wait, PDL with a device-word spin instead; with
#                and without one host read per kernel ($OUT/pdl_probe.jsonl, ~10 s).
#   ar8-probe:   scripts/ar8_probe.cu: the 2-rank 8 B all_reduce in a replayed graph, two
#                processes under MPS: the library's collective kernel beside the least kernel of
#                the design and variants between the two ($OUT/ar8_probe.jsonl, ~10 s).
#   ar64k-probe: scripts/ar64k_probe.cu: the 2-rank 64 KiB LL all_reduce in a replayed graph, two
#                processes under MPS: least kernels that order their stores and polls
#                differently (blocks x lines per thread, polls issued L lines behind the stores),
#                with each variant's SASS order of stores and loads ($OUT/ar64k_probe.jsonl, ~10 s).
#   proxy8-probe: scripts/proxy8_probe.cu: the 2-rank 8 B all_reduce over the proxy path in a
#                replayed graph, two processes under MPS with a proxy thread each: the least
#                proxy path beside the library's kernel served by a least proxy
#                ($OUT/proxy8_probe.jsonl, ~10 s).
#   proxy-copy-probe: scripts/proxy_copy_probe.cu: the proxy's line check and copy on this host
#                (check+memcpy, fused, fused with non-temporal stores) and the peer kernel's read
#                of the result, per size ($OUT/proxy_copy_probe.jsonl, ~10 s).
#   p2p-timeline: scripts/p2p_timeline.py: eager 2-rank ping-pong with CUDA events between the
#                ops, per size (paths $RESIDENT_PROBE_PATHS, default direct; extra environment
#                $RESIDENT_TIMELINE_ENV) ($OUT/p2p_timeline.log).
#   proxy-trace: the 2-rank graph benchmark of proxied cells ($RESIDENT_TRACE_CELLS, op:size[:KEY=VALUE...], default
#                all_reduce at 8 B, 16 KiB, 64 KiB and all_gather at 64 KiB) with the proxy's timeline
#                on (RESIDENT_GPU_PROXY_TRACE), summarised by scripts/proxy_trace_summary.py
#                ($OUT/trace_summary_<op>_<size>.json; raw timelines in $OUT/proxy_traces.tgz).
#   doctor:      python -m resident_pg.doctor (text and --json).
#   examples:    the TP and EP decode examples on the GPU (2 ranks under MPS, CUDA graphs,
#                --check against gloo), batch 1 and 8.
#   gpu-tests:   the GPU-marked tests but the tcp transport's (gpu-tests-tcp)
#                ($OUT/gpu_tests.log; stopped after $RESIDENT_GPU_TESTS_LIMIT_S, default 480 s;
#                only those pytest -k "$RESIDENT_GPU_TESTS_K" selects, when set);
#                `tests` runs everything.
#   multi-gpu:   (needs >= 2 GPUs, e.g. the nvidia-h200-x2 kind) one rank per GPU, no
#                MPS: the GPU tests at ws = number of GPUs, then the CUDA ladder of resident
#                (direct, proxy) beside NCCL (default; NCCL_P2P_DISABLE=1; NCCL_P2P_DISABLE=1
#                NCCL_SHM_DISABLE=1, its socket path), eager and graph, 8 B..1 MiB, all_reduce,
#                all_to_all_single, send/recv ($OUT/multi_gpu_tests.log, $OUT/bench_nccl.json,
#                $OUT/bench_nccl.png; tests bounded by $RESIDENT_GPU_TESTS_LIMIT_S, default 300 s,
#                the ladder by $RESIDENT_BENCH_LIMIT_S, default 420 s). Prints a skip line on a
#                machine with one GPU.
#   p2p-debug:   scripts/p2p_probe.py (blocking send/recv ping-pong, irecv before isend;
#                RESIDENT_DEBUG=debug, RESIDENT_GPU_P2P_STREAM=auto unless set) on both paths,
#                then the send/recv call-order suite at 2 ranks to its first failure
#                ($OUT/p2p_debug.log).
#   gpu-tests-own: the collectives, call-order and graph suites at 2 and 4 ranks with
#                RESIDENT_GPU_P2P_STREAM=own for every job ($OUT/gpu_tests_own.log; bounded by
#                $RESIDENT_GPU_TESTS_LIMIT_S, default 300 s; ~3.5 min when all pass).
#   p2p-order-suite: tests/test_cuda_p2p_order.py at 2 ranks, -x, -k "$RESIDENT_ORDER_K" (default
#                ws2), bounded by $RESIDENT_GPU_TESTS_LIMIT_S (default 200 s; a job's own bound is
#                120 s, so a hang still reports) ($OUT/p2p_order_suite.log).
#   p2p-order-probe: the call-order cases one by one in 2 ranks, each start/end printed
#                (RESIDENT_GPU_P2P_STREAM=auto unless set)
#                ($OUT/p2p_order_probe.log; RESIDENT_PROBE_PATH, RESIDENT_PROBE_LIMIT_S).
#   gpu-tests-ws2: the collectives, send/recv call-order and graph suites at 2 ranks only
#                ($OUT/gpu_tests_ws2.log, ~2.5 min).
#   gpu-tests-tcp: tests/test_cuda_tcp.py, CUDA tensors over the tcp transport: the collectives,
#                send/recv call-order and graph suites' cases with RESIDENT_TRANSPORT=tcp at 2, 4
#                and 8 ranks (8: the reduced dtypes), subgroups, and ranks in network namespaces
#                (2 ranks in 2 namespaces; 4 laid out [0,0,1,1]: shm inside, tcp across). It says
#                first whether network namespaces can be made here (`ip netns add` as root; the
#                namespace tests skip, saying why, where not) ($OUT/gpu_tests_tcp.log; stopped
#                after $RESIDENT_GPU_TESTS_LIMIT_S, default 480 s; $RESIDENT_GPU_TESTS_WS limits the
#                world sizes, $RESIDENT_GPU_TESTS_K selects).
#   bench-small: 2 ranks, graph mode, 8 B / 64 B / 4 KiB, both paths ($OUT/bench_small.json, ~20 s).
#   bench-ab-tree: this tree against another revision, side by side in one call: the bench-ab
#                run ($RESIDENT_AB_BACKENDS, $RESIDENT_AB_SIZES), from this tree and from
#                $RESIDENT_AB_TREE (a directory in this tree holding the other revision's setup.py,
#                csrc, kernels and resident_pg, e.g. `git archive REV setup.py pyproject.toml csrc
#                kernels resident_pg | tar -x -C abold`; built in place there), alternately,
#                $RESIDENT_AB_TREE_RUNS rounds (default 2), the first side changing every round
#                ($OUT/bench_ab_tree_{this,other}_N.{json,log}, ~1.5 min to build the other tree).
#   bench-protocol: RESIDENT_GPU_PROTOCOL simple (the default) beside ll, twice each, direct path,
#                2/4/8 ranks, graph, 64 KiB..1 MiB ($OUT/bench_protocol.json; $RESIDENT_BENCH_LIMIT_S).
#   bench-p2p:   2 ranks, eager and graph, send/recv (and all_reduce) 8 B..1 MiB, both paths,
#                each by default, direct also with RESIDENT_GPU_P2P_STREAM=own (at once, on a
#                stream of their own), side by side ($OUT/bench_p2p.json, ~1 min). Other variants:
#                RESIDENT_P2P_BACKENDS (bench --backends), RESIDENT_P2P_SIZES (bench --sizes).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=${*:-build floors tests overhead bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some stages run from another directory
# Every test stage appends each failure's text here as it happens (tests/conftest.py), so a
# stage cut off by its time bound still says why.
export RESIDENT_TESTS_FAIL_LOG=${RESIDENT_TESTS_FAIL_LOG:-$OUT/test_failures.log}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

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

step "machine"
{ nvidia-smi; nproc; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } \
  > "$OUT/machine.txt" 2>&1
head -3 "$OUT/machine.txt"

# build-if-needed: a later call on the same (warm) machine reuses the build of an earlier one.
if has build-if-needed && python3 -c 'import resident_pg._C' > /dev/null 2>&1; then
  echo "== build: the extension of an earlier call is there, not rebuilt"
elif has build || has build-if-needed; then
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

# The tcp floors (benchmarks/floors/tcp_floor: loopback, and two network namespaces on a veth
# pair, which needs root and iproute2) into $OUT/tcp_floors.json, its table appended to
# floors.log (at most 8 files come back from $OUT).
tcp_floors() {
  { [[ -x benchmarks/floors/build/tcp_floor ]] || bash benchmarks/floors/build.sh; } \
    >> "$OUT/floors_build.log" 2>&1 \
    && { echo "== tcp_floor"; benchmarks/floors/build/tcp_floor --json "$OUT/tcp_floors.json"; } \
    >> "$OUT/floors.log" 2>&1 \
    || { status=1; echo "tcp_floor failed (see floors*.log): rows over tcp have no ratios"; }
}

if has floors; then
  step "floors"
  bash benchmarks/floors/build.sh > "$OUT/floors_build.log" 2>&1 || status=1
  benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1 || status=1
  tail -25 "$OUT/floors.log"
  tcp_floors
  tail -24 "$OUT/floors.log"
fi

if has tests; then
  step "tests"
  python3 -m pytest -q tests -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
  tail -5 "$OUT/tests.log"
fi

if has gpu-tests; then
  step "gpu tests"
  # Bounded, so that a hang still leaves the log and the later stages inside the call's limit.
  bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-480}" python3 -m pytest -q -m gpu tests \
    --ignore=tests/test_cuda_tcp.py ${RESIDENT_GPU_TESTS_K:+-k "$RESIDENT_GPU_TESTS_K"} \
    -p no:cacheprovider -rf --durations=15 \
    > "$OUT/gpu_tests.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests.log"
fi

# CUDA tensors over tcp: on one host with RESIDENT_TRANSPORT=tcp, and between network
# namespaces when this machine can make them (said first, with why not).
if has gpu-tests-tcp; then
  step "gpu tests over tcp"
  if [[ $(id -u) != 0 ]]; then
    netns="no: not root"
  elif ! command -v ip > /dev/null; then
    netns="no: iproute2 (ip) is not installed"
  elif why=$(ip netns add "rpcheck$$" 2>&1); then
    ip netns del "rpcheck$$"
    netns="yes (ip netns add as root worked)"
  else
    netns="no: ip netns add failed: $why"
  fi
  echo "network namespaces: $netns" | tee "$OUT/gpu_tests_tcp.log"
  RESIDENT_GPU_TESTS_WS=${RESIDENT_GPU_TESTS_WS:-2,4,8} bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-480}" \
    python3 -m pytest -q -m gpu tests/test_cuda_tcp.py ${RESIDENT_GPU_TESTS_K:+-k "$RESIDENT_GPU_TESTS_K"} \
    -p no:cacheprovider -rfs --durations=15 >> "$OUT/gpu_tests_tcp.log" 2>&1 || status=1
  grep -m 5 "^SKIPPED" "$OUT/gpu_tests_tcp.log" | cut -c1-300  # e.g. why no namespaces
  tail -5 "$OUT/gpu_tests_tcp.log"
fi

# A short check for a short device budget: the collectives suite (every op x dtype x size,
# direct, proxy and the knob variants), the send/recv call orders and the graph suite, at 2
# ranks only.
if has gpu-tests-ws2; then
  step "gpu tests, 2 ranks"
  RESIDENT_GPU_TESTS_WS=2 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-150}" python3 -m pytest -q -m gpu \
    tests/test_cuda_collectives.py tests/test_cuda_p2p_order.py tests/test_cuda_graphs.py \
    -p no:cacheprovider -rf > "$OUT/gpu_tests_ws2.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests_ws2.log"
fi

if has p2p-debug; then
  step "send/recv probe"
  for path in ${RESIDENT_PROBE_PATHS:-direct proxy}; do
    echo "== probe path=$path" >> "$OUT/p2p_debug.log"
    RESIDENT_PATH=$path RESIDENT_DEBUG=debug RESIDENT_GPU_P2P_STREAM=${RESIDENT_GPU_P2P_STREAM:-auto} \
      timeout 60 python3 scripts/p2p_probe.py \
      >> "$OUT/p2p_debug.log" 2>&1 || { status=1; echo "probe ($path) failed"; }
  done
  grep -E "^rank|launched|called|wait on|rror" "$OUT/p2p_debug.log" | tail -80
  [[ -n "${RESIDENT_PROBE_ONLY:-}" ]] || {
  step "send/recv call-order suite, 2 ranks, to the first failure"
  RESIDENT_GPU_TESTS_WS=2 bounded 100 python3 -m pytest -x -q tests/test_cuda_p2p_order.py \
    -p no:cacheprovider -rf >> "$OUT/p2p_debug.log" 2>&1 || status=1
  tail -n 40 "$OUT/p2p_debug.log"; }
fi

# The other launch policy of send/recv: the collectives, call-order and graph suites at 2 and
# 4 ranks with every job's send/recv launched at once on their own streams.
if has gpu-tests-own; then
  step "gpu tests, 2 and 4 ranks, RESIDENT_GPU_P2P_STREAM=own"
  RESIDENT_GPU_P2P_STREAM=own RESIDENT_GPU_TESTS_WS=2,4 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-300}" \
    python3 -m pytest -q -m gpu tests/test_cuda_collectives.py tests/test_cuda_p2p_order.py \
    tests/test_cuda_graphs.py -p no:cacheprovider -rf > "$OUT/gpu_tests_own.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests_own.log"
fi

if has p2p-order-suite; then
  step "send/recv call-order suite, 2 ranks, to the first failure (-k \"${RESIDENT_ORDER_K:-ws2}\")"
  RESIDENT_GPU_TESTS_WS=2 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-200}" python3 -m pytest -x -q \
    tests/test_cuda_p2p_order.py -k "${RESIDENT_ORDER_K:-ws2}" -p no:cacheprovider -rf \
    > "$OUT/p2p_order_suite.log" 2>&1 || status=1
  tail -n 60 "$OUT/p2p_order_suite.log" | cut -c1-300
fi

if has p2p-order-probe; then
  step "send/recv call-order cases, one by one (scripts/p2p_order_probe.py)"
  RESIDENT_PATH=${RESIDENT_PROBE_PATH:-direct} RESIDENT_GPU_P2P_STREAM=${RESIDENT_GPU_P2P_STREAM:-auto} \
    timeout -k 5 "${RESIDENT_PROBE_LIMIT_S:-100}" \
    python3 scripts/p2p_order_probe.py > "$OUT/p2p_order_probe.log" 2>&1 || status=1
  grep -E "^rank" "$OUT/p2p_order_probe.log" | tail -40
fi

if has overhead; then
  step "overhead"
  python3 benchmarks/overhead.py --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1 || status=1
  tail -5 "$OUT/overhead.log"
fi

# The CUDA ladder: resident on the direct and the proxy path, eager and graph modes, all ranks
# on the one GPU under the MPS daemon started above, ratios to the floors of this machine.
# --time-limit: no new group after that many seconds, so a slow or hanging backend cannot push
# the call past the device's 10-minute limit (groups not run are reported as such).
cuda_bench() {  # extra bench options, e.g. --quick
  if [[ ! -s "$OUT/floors.json" ]]; then
    step "floors (for the cuda bench)"
    { [[ -x benchmarks/floors/build/floors ]] || bash benchmarks/floors/build.sh; } \
      > "$OUT/floors_build.log" 2>&1 \
      && benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1 \
      || { status=1; echo "floors failed (see floors*.log): the cuda bench has no ratios"; }
  fi
  [[ -s "$OUT/tcp_floors.json" ]] || tcp_floors
  local tcp_opt=()
  [[ -s "$OUT/tcp_floors.json" ]] && tcp_opt=(--floors "$OUT/tcp_floors.json")
  step "bench (cuda)"
  python3 -m resident_pg.bench --device cuda --floors "$OUT/floors.json" \
    ${tcp_opt[@]+"${tcp_opt[@]}"} --timeout 30 "$@" \
    --json "$OUT/bench_cuda.json" > "$OUT/bench_cuda.log" 2>&1 || status=1
  tail -n 60 "$OUT/bench_cuda.log"
  # (its log goes to the end of bench_cuda.log: at most 8 files come back from $OUT)
  python3 benchmarks/plot_latency.py "$OUT/bench_cuda.json" -o "$OUT/latency_cuda.png" \
    >> "$OUT/bench_cuda.log" 2>&1 || { status=1; tail -3 "$OUT/bench_cuda.log"; }
}

if has bench; then
  step "bench (cpu)"
  python3 -m resident_pg.bench --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  tail -80 "$OUT/bench.log"
  cuda_bench --time-limit 240
fi
if has bench-cuda; then
  cuda_bench --time-limit 240
fi
# The network path on one host: CUDA tensors over tcp (RESIDENT_TRANSPORT=tcp) beside the proxy
# path over shm, 2 ranks, graph and eager, the five ops at 8 B-64 KiB, ratios to this call's
# floors (the tcp rows to GPU + tcp + GPU); then CPU tensors over tcp beside shm and gloo
# ($OUT/bench_tcp_cuda.{json,log}, $OUT/bench_tcp_cpu.{json,log}; ~3 min).
if has bench-tcp; then
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
  [[ -s "$OUT/tcp_floors.json" ]] || tcp_floors
  step "bench (cuda over tcp)"
  python3 -m resident_pg.bench --device cuda --mode graph,eager --world-sizes 2 \
    --ops all_reduce,all_gather_into_tensor,reduce_scatter_tensor,all_to_all_single,send_recv \
    --sizes "${RESIDENT_TCP_SIZES:-8,1K,16K,64K}" \
    --backends "${RESIDENT_TCP_BACKENDS:-resident:transport=tcp,resident:path=proxy}" \
    --floors "$OUT/floors.json" --floors "$OUT/tcp_floors.json" --timeout 30 \
    --time-limit "${RESIDENT_BENCH_LIMIT_S:-150}" \
    --json "$OUT/bench_tcp_cuda.json" > "$OUT/bench_tcp_cuda.log" 2>&1 || status=1
  tail -n 45 "$OUT/bench_tcp_cuda.log"
  step "bench (cpu over tcp)"
  python3 -m resident_pg.bench --world-sizes 2 --sizes 8,1K,64K \
    --backends resident:transport=tcp,resident,gloo --floors "$OUT/tcp_floors.json" \
    --timeout 30 --time-limit 90 \
    --json "$OUT/bench_tcp_cpu.json" > "$OUT/bench_tcp_cpu.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench_tcp_cpu.log"
fi

if has bench-quick; then
  step "bench (cpu, quick)"
  python3 -m resident_pg.bench --quick --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  tail -40 "$OUT/bench.log"
  cuda_bench --quick --time-limit 75
fi

# The A/B benchmark of bench-ab and bench-ab-tree: 2 ranks, graph mode (the issue-3 targets'
# setting), the five ops, sizes $RESIDENT_AB_SIZES (default $1) and backends
# $RESIDENT_AB_BACKENDS (default $2) side by side, ratios to this call's floors, no new group
# after $3 s, into $OUT/$4.json (the floors: ab_floors first).
ab_floors() {  # the floors of this call, measured now when no stage did
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
}
ab_bench() {
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv \
    --sizes "${RESIDENT_AB_SIZES:-$1}" --backends "${RESIDENT_AB_BACKENDS:-$2}" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit "$3" --json "$OUT/$4.json"
}

if has bench-ab; then
  # The CUDA path's knobs side by side: defaults, prefetch on; on the proxy path memcpy instead
  # of streaming stores, and fenced triggers.
  step "bench (cuda, knob A/B)"
  ab_floors
  ab_bench 8,4K,16K,64K "resident:path=direct,resident:path=direct:RESIDENT_GPU_PREFETCH=0,resident:path=proxy,resident:path=proxy:RESIDENT_GPU_PROXY_STREAMING=0,resident:path=proxy:RESIDENT_GPU_TRIGGER_FENCE=1" \
    200 bench_ab > "$OUT/bench_ab.log" 2>&1 || status=1
  tail -n 70 "$OUT/bench_ab.log"
fi

if has bench-ab-tree; then
  step "bench (this tree against $RESIDENT_AB_TREE)"
  ab_floors
  if ! (cd "$RESIDENT_AB_TREE" && MAX_JOBS=16 python3 setup.py build_ext --inplace) \
      > "$OUT/build_ab_tree.log" 2>&1; then
    echo "build of $RESIDENT_AB_TREE failed"; tail -30 "$OUT/build_ab_tree.log"; status=1
  else
    for ((round = 1; round <= ${RESIDENT_AB_TREE_RUNS:-2}; ++round)); do
      sides="this other"; ((round % 2 == 0)) && sides="other this"  # neither always first
      for side in $sides; do
        dir=.; [[ $side == other ]] && dir=$RESIDENT_AB_TREE
        # python -m puts the working directory first on sys.path (the spawned ranks inherit it),
        # so each run imports the package of its own tree; the log says which file it loaded.
        (cd "$dir" && python3 -c 'import resident_pg._C as c; print("module:", c.__file__)' &&
          ab_bench 8,16K,64K "resident:path=direct,resident:path=proxy" 120 \
            "bench_ab_tree_${side}_$round") > "$OUT/bench_ab_tree_${side}_$round.log" 2>&1 ||
          status=1
        grep -E "^module:|^all_reduce|^send_recv" "$OUT/bench_ab_tree_${side}_$round.log"
      done
    done
  fi
fi

if has bench-protocol; then
  # RESIDENT_GPU_PROTOCOL=simple (default) against ll, side by side: 2, 4 and 8 ranks, direct
  # path, graph mode, sizes where a round to one peer carries over 32 KiB at some rank count
  # (those go simple; smaller ones are LL lines under both settings).
  step "bench (cuda, protocol A/B)"
  [[ -x benchmarks/floors/build/floors ]] || bash benchmarks/floors/build.sh > "$OUT/floors_build.log" 2>&1
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2,4,8 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv --sizes 64K,256K,1M \
    --backends "resident:path=direct,resident:path=direct:RESIDENT_GPU_PROTOCOL=ll,resident:path=direct,resident:path=direct:RESIDENT_GPU_PROTOCOL=ll" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit ${RESIDENT_BENCH_LIMIT_S:-200} \
    --json "$OUT/bench_protocol.json" > "$OUT/bench_protocol.log" 2>&1 || status=1
  tail -n 70 "$OUT/bench_protocol.log"
fi

if has bench-small; then
  step "bench (cuda, 2 ranks, graph, small sizes)"
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv --sizes 8,64,4K \
    --backends "resident:path=direct,resident:path=proxy" --floors "$OUT/floors.json" \
    --timeout 30 --time-limit 60 --json "$OUT/bench_small.json" > "$OUT/bench_small.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench_small.log"
fi

if has bench-p2p; then
  step "bench (cuda, send/recv stream placement A/B)"
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
  python3 -m resident_pg.bench --device cuda --mode eager,graph --world-sizes 2 \
    --ops send_recv,all_reduce --sizes "${RESIDENT_P2P_SIZES:-8,4K,64K,1M}" \
    --backends "${RESIDENT_P2P_BACKENDS:-resident:path=direct,resident:path=direct:RESIDENT_GPU_P2P_STREAM=own,resident:path=proxy}" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit 120 \
    --json "$OUT/bench_p2p.json" > "$OUT/bench_p2p.log" 2>&1 || status=1
  tail -n 40 "$OUT/bench_p2p.log"
fi

if has interference; then
  # One run per world size in $RESIDENT_INTERFERENCE_WS (default 2): interference_ws<N>.*
  for ws in ${RESIDENT_INTERFERENCE_WS:-2}; do
    step "bench (interference: GEMM next to the communicator, per mode, $ws ranks)"
    timeout $(( ${RESIDENT_INTERFERENCE_LIMIT_S:-120} + 120 )) python3 -m resident_pg.bench_interference \
      --ws "$ws" --modes "${RESIDENT_INTERFERENCE_MODES:-default}" \
      --time-limit ${RESIDENT_INTERFERENCE_LIMIT_S:-120} --timeout 60 \
      --json "$OUT/interference_ws$ws.json" > "$OUT/interference_ws$ws.log" 2>&1 || status=1
    tail -n 30 "$OUT/interference_ws$ws.log"
  done
fi

# run_probe NAME "NVCC FLAGS AND SOURCES" ARGS...: builds a standalone probe as /tmp/NAME (its
# build log $OUT/NAME_build.log), runs it with ARGS for 120 s at most, its JSON lines in
# $OUT/NAME.jsonl; a failed build or run sets the call's status.
run_probe() {
  local name=$1 sources=$2
  shift 2
  # shellcheck disable=SC2086  # the flags and sources are words
  if nvcc -std=c++17 -arch=sm_90 -Ikernels -Icsrc $sources -o "/tmp/$name" > "$OUT/${name}_build.log" 2>&1; then
    timeout 120 "/tmp/$name" "$@" | tee "$OUT/$name.jsonl" || status=1
  else
    status=1; tail -20 "$OUT/${name}_build.log"
  fi
}

if has poll-probe; then
  step "LL poll probe"
  { for f in /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled \
      /proc/sys/vm/nr_hugepages /proc/cmdline; do echo "$f: $(cat $f 2>&1)"; done
    grep -i huge /proc/meminfo; echo "iommu: $(ls /sys/class/iommu 2>&1 | tr '\n' ' ')"; } \
    | tee "$OUT/poll_probe_host.txt"
  run_probe poll_probe "-O2 scripts/ll_poll_probe.cu" "${RESIDENT_POLL_PROBE_ITERS:-50}" \
    "${RESIDENT_POLL_PROBE_ALLOCS:-shared}" "${RESIDENT_POLL_PROBE_SECTIONS:-sweep,credit,abort}"
fi

if has replica-probe; then
  step "replica poll probe"
  run_probe replica_probe "-O2 scripts/replica_poll_probe.cu" "${RESIDENT_REPLICA_PROBE_ITERS:-2000}" 7
fi

if has pdl-probe; then
  step "PDL chain probe"
  run_probe pdl_probe "-O2 scripts/pdl_chain_probe.cu" 200 51
fi

if has ar8-probe; then
  step "8 B all_reduce probe"
  run_probe ar8_probe "-O3 scripts/ar8_probe.cu kernels/collective_kernel.cu kernels/one_round_kernel.cu" \
    "${RESIDENT_AR8_PROBE_NODES:-200}" "${RESIDENT_AR8_PROBE_REPLAYS:-31}"
fi

if has ar64k-probe; then
  step "64 KiB all_reduce store/poll order probe"
  run_probe ar64k_probe "-O3 scripts/ar64k_probe.cu" \
    "${RESIDENT_AR64K_PROBE_NODES:-100}" "${RESIDENT_AR64K_PROBE_REPLAYS:-31}"
  cuobjdump --dump-sass /tmp/ar64k_probe 2>&1 | grep -E 'Function|STG|LDG|ST\.|LD\.' \
    > "$OUT/ar64k_probe_sass.txt" || true
fi

if has proxy8-probe; then
  step "proxy-path 8 B all_reduce probe"
  run_probe proxy8_probe "-O3 scripts/proxy8_probe.cu kernels/collective_kernel.cu kernels/one_round_kernel.cu" \
    "${RESIDENT_AR8_PROBE_NODES:-200}" "${RESIDENT_AR8_PROBE_REPLAYS:-31}"
fi

if has proxy-copy-probe; then
  step "proxy copy probe"
  lscpu | grep -E "Model name|Socket|NUMA node|L3" | tee "$OUT/proxy_copy_probe_cpu.txt"
  run_probe proxy_copy_probe "-O2 -Xcompiler -msse4.1 scripts/proxy_copy_probe.cu" 50
fi

if has p2p-timeline; then
  step "send/recv timeline (CUDA events, eager ping-pong)"
  for path in ${RESIDENT_PROBE_PATHS:-direct}; do
    echo "== path=$path ${RESIDENT_TIMELINE_ENV:-}" | tee -a "$OUT/p2p_timeline.log"
    env RESIDENT_PATH=$path ${RESIDENT_TIMELINE_ENV:-} timeout 120 python3 scripts/p2p_timeline.py 2>&1 \
      | tee -a "$OUT/p2p_timeline.log" | grep -E "^rank|rror" || status=1
  done
  { which nsys ncu; ls /usr/local/cuda/bin 2>&1 | head -40; } > "$OUT/cuda_tools.txt" 2>&1
fi

if has proxy-trace; then
  # Where a proxied op's time goes: the 2-rank graph benchmark of one op and size at a time with
  # RESIDENT_GPU_PROXY_TRACE, then scripts/proxy_trace_summary.py over both ranks' timelines
  # ($RESIDENT_TRACE_CELLS: op:size pairs; $OUT/trace_<op>_<size>.{log,json}, summaries
  # $OUT/trace_summary_<op>_<size>.json, the raw timelines in $OUT/proxy_traces.tgz).
  step "proxy trace (2 ranks, graph, proxy path)"
  [[ -s "$OUT/floors.json" ]] || benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1
  mkdir -p "$OUT/traces"
  for cell in ${RESIDENT_TRACE_CELLS:-all_reduce:8 all_reduce:16K all_reduce:64K all_gather_into_tensor:64K}; do
    op=${cell%%:*}; rest=${cell#*:}; size=${rest%%:*}; extra=${rest#"$size"}  # extra: :KEY=VALUE...
    label="${op}_$size$(echo "$extra" | tr ':=' '_-')"
    python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2 --ops "$op" --sizes "$size" \
      --backends "resident:path=proxy$extra:RESIDENT_GPU_PROXY_TRACE=$OUT/traces/$label" \
      --floors "$OUT/floors.json" --timeout 30 --time-limit 60 \
      --json "$OUT/trace_$label.json" > "$OUT/trace_$label.log" 2>&1 || status=1
    echo "== $label: $(grep -E "^ *$op" "$OUT/trace_$label.log" | tail -n 1)"
    python3 scripts/proxy_trace_summary.py "$OUT/traces/$label" \
      --json "$OUT/trace_summary_$label.json" > /dev/null || status=1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['ranks']; print({k: v['median_us'] for k, v in r.items()})" \
      "$OUT/trace_summary_$label.json" || status=1
  done
  tar czf "$OUT/proxy_traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
fi

if has multi-gpu; then
  step "multi-gpu (one rank per GPU, beside NCCL)"
  ngpu=$(all_gpus python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if (( ngpu < 2 )); then
    echo "multi-gpu: skipped, this machine has $ngpu GPU(s)" | tee "$OUT/multi_gpu.log"
  else
    # An empty pipe directory: the ranks do not find the MPS daemon and own their GPU.
    mkdir -p /tmp/no-mps
    CUDA_MPS_PIPE_DIRECTORY=/tmp/no-mps RESIDENT_GPU_TESTS_WS=$ngpu \
      bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-300}" env $(all_gpus_env) python3 -m pytest -q -m gpu \
      tests/test_cuda_collectives.py tests/test_cuda_graphs.py -p no:cacheprovider \
      > "$OUT/multi_gpu_tests.log" 2>&1 || status=1
    tail -5 "$OUT/multi_gpu_tests.log"
    ws_list=2; (( ngpu >= 4 )) && ws_list=2,4; (( ngpu >= 8 )) && ws_list=2,4,8
    floors_opt=()
    [[ -s "$OUT/floors.json" ]] && floors_opt=(--floors "$OUT/floors.json")
    CUDA_MPS_PIPE_DIRECTORY=/tmp/no-mps all_gpus python3 -m resident_pg.bench --device cuda \
      --mode eager,graph --world-sizes "$ws_list" --ops all_reduce,all_to_all_single,send_recv \
      --sizes 8,64,512,4K,16K,64K,256K,1M \
      --backends "resident:path=direct,resident:path=proxy,nccl,nccl:NCCL_P2P_DISABLE=1,nccl:NCCL_P2P_DISABLE=1:NCCL_SHM_DISABLE=1" \
      ${floors_opt[@]+"${floors_opt[@]}"} --timeout 60 --time-limit ${RESIDENT_BENCH_LIMIT_S:-420} \
      --json "$OUT/bench_nccl.json" > "$OUT/bench_nccl.log" 2>&1 || status=1
    tail -n 80 "$OUT/bench_nccl.log"
    python3 benchmarks/plot_latency.py "$OUT/bench_nccl.json" -o "$OUT/bench_nccl.png" \
      > /dev/null 2>&1 || echo "plot failed"
  fi
fi

if has doctor; then
  step "doctor"
  python3 -m resident_pg.doctor > "$OUT/doctor.log" 2>&1
  python3 -m resident_pg.doctor --json > "$OUT/doctor.json" 2>> "$OUT/doctor.log"
  tail -20 "$OUT/doctor.log"
fi

if has examples; then
  step "examples"
  for b in 1 8; do
    timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 examples/tp_decode.py \
      --device cuda --graph --layers 8 --batch "$b" --check --check-backend gloo \
      >> "$OUT/examples.log" 2>&1 || status=1
    timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 examples/ep_decode.py \
      --device cuda --graph --layers 4 --batch "$b" --check --check-backend gloo \
      >> "$OUT/examples.log" 2>&1 || status=1
  done
  tail -40 "$OUT/examples.log"
fi

# The device tool brings back at most 8 files of $OUT, the first by name: past that, everything
# also goes into $OUT/all.tgz, which sorts first.
if (( $(find "$OUT" -maxdepth 1 -type f ! -name all.tgz | wc -l) > 8 )); then
  # written beside $OUT and moved in: tar reading the folder it writes into warns and fails
  tar czf /tmp/resident_all.tgz -C "$OUT" --exclude=all.tgz . && mv /tmp/resident_all.tgz "$OUT/all.tgz" \
    && echo "more than 8 files: all in all.tgz"
fi
if [[ -s "$RESIDENT_TESTS_FAIL_LOG" ]]; then
  step "test failures: $(grep -c '^===== ' "$RESIDENT_TESTS_FAIL_LOG") (the first 40 lines; all in $RESIDENT_TESTS_FAIL_LOG)"
  head -40 "$RESIDENT_TESTS_FAIL_LOG" | cut -c1-300
fi
exit $status
