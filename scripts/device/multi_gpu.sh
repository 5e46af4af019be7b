# Sourced by scripts/device_run.sh: one rank per GPU, no MPS (needs >= 2 GPUs, e.g. the nvidia-h200-x2 kind).
# stage multi-gpu: the collectives and graph suites at ws = number of GPUs ($OUT/multi_gpu_tests.log; limit RESIDENT_GPU_TESTS_LIMIT_S, default 300 s), then the CUDA ladder of resident beside NCCL ($OUT/bench_nccl.json and .png; RESIDENT_BENCH_LIMIT_S, default 420 s); a skip line with one GPU.

# The ladder: resident (direct, proxy) beside NCCL (default; NCCL_P2P_DISABLE=1;
# NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, its socket path), eager and graph, 8 B..1 MiB,
# all_reduce, all_to_all_single, send/recv.
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
      tests/test_cuda_collectives.py tests/test_cuda_async_ops.py tests/test_cuda_graphs.py \
      -p no:cacheprovider \
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
