# Sourced by scripts/device_run.sh: the latency benchmarks (python -m resident_pg.bench), CUDA
# rows with ratios to this call's floors (measured first when no floors stage ran).
# stage overhead: benchmarks/overhead.py, where an 8 B all_reduce's time goes, CPU tensors, then CUDA tensors beside a bare torch kernel launch with the eager-op target, 4 fresh process pairs ($OUT/overhead.json, $OUT/overhead_cuda.json).
# stage bench: the CPU ladder ($OUT/bench.json, ~1.5 min on the H200 host), then the CUDA ladder as bench-cuda.
# stage bench-cuda: the CUDA ladder: direct and proxy path, eager and graph, 2/4/8 ranks on the one GPU under MPS ($OUT/bench_cuda.json and latency_cuda.png, ~2-3 min, no new group after 4 min).
# stage bench-quick: bench, short (~1 min in all).
# stage bench-tcp: CUDA tensors over tcp beside the proxy path over shm, then CPU tensors over tcp beside shm and gloo, 2 ranks ($OUT/bench_tcp_{cuda,cpu}.json, ~3 min; RESIDENT_TCP_SIZES, RESIDENT_TCP_BACKENDS).
# stage bench-pytest: pytest benchmarks/ on CUDA tensors, 2 ranks (RESIDENT_PYTEST_BENCH_WS), ratios to this call's floors, gated against benchmarks/baselines/h200-mps.json ($OUT/bench_pytest.json in pytest-benchmark's format, $OUT/bench_pytest.log; bounded by RESIDENT_BENCH_LIMIT_S, default 420 s).
# stage bench-small: 2 ranks, graph mode, 8 B / 64 B / 4 KiB, both paths ($OUT/bench_small.json, ~20 s).
# stage bench-ep: benchmarks/ep_bench.py (resident_pg.ep.Buffer beside the padded MoEDispatcher and bare all_to_alls), CUDA graphs, at RESIDENT_EP_RANKS (default 8) ranks on each of RESIDENT_EP_PATHS (default "direct proxy proxy+tcp"), hidden 2048 and 7168, 1/16/128 tokens, 64/256 experts, or the benchmark's arguments in RESIDENT_EP_ARGS (e.g. "--hidden 7168 --tokens 1,16 --experts 256 --fp8") ($OUT/ep_bench.log, $OUT/ep_bench_<ranks>r_<path>.json; ~1.5 min per path).
# stage interference: a bf16 decode GEMM alone and next to all_reduces per mode (RESIDENT_INTERFERENCE_MODES, _WS default "2", _LIMIT_S) ($OUT/interference_ws<N>.json, ~1 min per world size).

if has overhead; then
  step "overhead"
  python3 benchmarks/overhead.py --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1 || status=1
  tail -5 "$OUT/overhead.log"
  python3 benchmarks/overhead.py --device cuda --backends resident --iters 4000 --spawns 4 \
    --json "$OUT/overhead_cuda.json" > "$OUT/overhead_cuda.log" 2>&1 || status=1
  tail -7 "$OUT/overhead_cuda.log"
fi

# The CUDA ladder: resident on the direct and the proxy path, eager and graph modes, all ranks
# on the one GPU under the MPS daemon, ratios to the floors of this machine (the tcp rows to
# GPU + tcp + GPU). --time-limit: no new group after that many seconds, so a slow or hanging
# backend cannot push the call past the device's 10-minute limit (groups not run are reported
# as such).
cuda_bench() {  # extra bench options, e.g. --quick
  [[ -s "$OUT/floors.json" ]] || { step "floors (for the cuda bench)"; need_floors; }
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

if has bench-tcp; then
  need_floors
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

if has bench-pytest; then
  need_floors
  [[ -s "$OUT/tcp_floors.json" ]] || tcp_floors
  step "bench (pytest benchmarks/, cuda, gate)"
  bounded "${RESIDENT_BENCH_LIMIT_S:-420}" python3 -m pytest benchmarks/ -q -p no:cacheprovider \
    --resident-device cuda --resident-world-sizes "${RESIDENT_PYTEST_BENCH_WS:-2}" \
    --resident-floors "$OUT/floors.json" --resident-floors "$OUT/tcp_floors.json" \
    --resident-gate benchmarks/baselines/h200-mps.json --benchmark-json "$OUT/bench_pytest.json" \
    --resident-ladder-json "$OUT" > "$OUT/bench_pytest.log" 2>&1 || status=1
  tail -n 40 "$OUT/bench_pytest.log"
fi

if has bench-small; then
  step "bench (cuda, 2 ranks, graph, small sizes)"
  need_floors
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv --sizes 8,64,4K \
    --backends "resident:path=direct,resident:path=proxy" --floors "$OUT/floors.json" \
    --timeout 30 --time-limit 60 --json "$OUT/bench_small.json" > "$OUT/bench_small.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench_small.log"
fi

if has bench-ep; then
  for path in ${RESIDENT_EP_PATHS:-direct proxy proxy+tcp}; do
    step "EP dispatch + combine, ${RESIDENT_EP_RANKS:-8} ranks, path $path"
    # shellcheck disable=SC2086  # RESIDENT_EP_ARGS: several words
    timeout 180 python3 benchmarks/ep_bench.py --ranks "${RESIDENT_EP_RANKS:-8}" --path "$path" \
      ${RESIDENT_EP_ARGS:---hidden 2048,7168 --tokens 1,16,128 --experts 64,256} \
      --json "$OUT/ep_bench_${RESIDENT_EP_RANKS:-8}r_${path/+/_}.json" >> "$OUT/ep_bench.log" 2>&1 || status=1
    tail -n 14 "$OUT/ep_bench.log"
  done
fi

# Modes: "default"; "proxy": RESIDENT_PATH=proxy. World sizes e.g. "2 4 8", one run each.
if has interference; then
  for ws in ${RESIDENT_INTERFERENCE_WS:-2}; do
    step "bench (interference: GEMM next to the communicator, per mode, $ws ranks)"
    timeout $(( ${RESIDENT_INTERFERENCE_LIMIT_S:-120} + 120 )) python3 -m resident_pg.bench.interference \
      --ws "$ws" --modes "${RESIDENT_INTERFERENCE_MODES:-default}" \
      --time-limit ${RESIDENT_INTERFERENCE_LIMIT_S:-120} --timeout 60 \
      --json "$OUT/interference_ws$ws.json" > "$OUT/interference_ws$ws.log" 2>&1 || status=1
    tail -n 30 "$OUT/interference_ws$ws.log"
  done
fi
