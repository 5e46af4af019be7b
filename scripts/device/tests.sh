# Sourced by scripts/device_run.sh: the test suites. Each failure's text is appended to
# $RESIDENT_TESTS_FAIL_LOG as it happens; a bounded stage stops after RESIDENT_GPU_TESTS_LIMIT_S
# and kills what it left (bounded), so a hang still leaves its log and the later stages' time.
# stage tests: the whole suite, GPU-marked tests included ($OUT/tests.log).
# stage gpu-tests: the GPU-marked tests but test_cuda_tcp.py ($OUT/gpu_tests.log; limit default 480 s; RESIDENT_GPU_TESTS_K selects).
# stage gpu-tests-tcp: tests/test_cuda_tcp.py, CUDA tensors over tcp at RESIDENT_GPU_TESTS_WS (default 2,4,8) ranks, network namespaces where this machine can make them ($OUT/gpu_tests_tcp.log; limit default 480 s).
# stage gpu-tests-ws2: the collectives (test_cuda_collectives, test_cuda_async_ops), send/recv call-order and graph suites at 2 ranks ($OUT/gpu_tests_ws2.log; limit default 150 s).
# stage gpu-tests-own: those suites at 2 and 4 ranks with RESIDENT_GPU_P2P_STREAM=own ($OUT/gpu_tests_own.log; limit default 300 s).
# stage p2p-order-suite: tests/test_cuda_p2p_order.py at 2 ranks, -x, -k "$RESIDENT_ORDER_K" (default ws2) ($OUT/p2p_order_suite.log; limit default 200 s).

if has tests; then
  step "tests"
  python3 -m pytest -q tests -p no:cacheprovider > "$OUT/tests.log" 2>&1 || status=1
  tail -5 "$OUT/tests.log"
fi

if has gpu-tests; then
  step "gpu tests"
  bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-480}" python3 -m pytest -q -m gpu tests \
    --ignore=tests/test_cuda_tcp.py ${RESIDENT_GPU_TESTS_K:+-k "$RESIDENT_GPU_TESTS_K"} \
    -p no:cacheprovider -rf --durations=15 \
    > "$OUT/gpu_tests.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests.log"
fi

# CUDA tensors over tcp: on one host with RESIDENT_TRANSPORT=tcp, and between network
# namespaces when this machine can make them (as root, over rtnetlink: tests/netns.py, no
# iproute2 needed; said first, with why not; the namespace tests skip where not). 8 ranks: the
# reduced dtypes; 4 laid out [0,0,1,1].
if has gpu-tests-tcp; then
  step "gpu tests over tcp"
  if [[ $(id -u) != 0 ]]; then
    netns="no: not root"
  elif why=$(cd tests && python3 -c "import netns; netns.add_netns('rpcheck$$'); netns.del_netns('rpcheck$$')" 2>&1); then
    netns="yes (a namespace made as root over rtnetlink)"
  else
    netns="no: making one failed: $(echo "$why" | tail -1)"
  fi
  echo "network namespaces: $netns" | tee "$OUT/gpu_tests_tcp.log"
  RESIDENT_GPU_TESTS_WS=${RESIDENT_GPU_TESTS_WS:-2,4,8} bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-480}" \
    python3 -m pytest -q -m gpu tests/test_cuda_tcp.py ${RESIDENT_GPU_TESTS_K:+-k "$RESIDENT_GPU_TESTS_K"} \
    -p no:cacheprovider -rfs --durations=15 >> "$OUT/gpu_tests_tcp.log" 2>&1 || status=1
  grep -m 5 "^SKIPPED" "$OUT/gpu_tests_tcp.log" | cut -c1-300  # e.g. why no namespaces
  tail -5 "$OUT/gpu_tests_tcp.log"
fi

# A short check for a short device budget: every op x dtype x size on the direct, proxy and
# knob-variant jobs, the send/recv call orders and the graph suite, at 2 ranks only.
if has gpu-tests-ws2; then
  step "gpu tests, 2 ranks"
  RESIDENT_GPU_TESTS_WS=2 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-150}" python3 -m pytest -q -m gpu \
    tests/test_cuda_collectives.py tests/test_cuda_async_ops.py tests/test_cuda_p2p_order.py \
    tests/test_cuda_graphs.py -p no:cacheprovider -rf > "$OUT/gpu_tests_ws2.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests_ws2.log"
fi

# The other launch policy of send/recv: every job's send/recv launched at once on their own streams.
if has gpu-tests-own; then
  step "gpu tests, 2 and 4 ranks, RESIDENT_GPU_P2P_STREAM=own"
  RESIDENT_GPU_P2P_STREAM=own RESIDENT_GPU_TESTS_WS=2,4 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-300}" \
    python3 -m pytest -q -m gpu tests/test_cuda_collectives.py tests/test_cuda_async_ops.py \
    tests/test_cuda_p2p_order.py tests/test_cuda_graphs.py -p no:cacheprovider -rf \
    > "$OUT/gpu_tests_own.log" 2>&1 || status=1
  tail -5 "$OUT/gpu_tests_own.log"
fi

# A job's own bound is 120 s, below the stage's, so that a hang still reports.
if has p2p-order-suite; then
  step "send/recv call-order suite, 2 ranks, to the first failure (-k \"${RESIDENT_ORDER_K:-ws2}\")"
  RESIDENT_GPU_TESTS_WS=2 bounded "${RESIDENT_GPU_TESTS_LIMIT_S:-200}" python3 -m pytest -x -q \
    tests/test_cuda_p2p_order.py -k "${RESIDENT_ORDER_K:-ws2}" -p no:cacheprovider -rf \
    > "$OUT/p2p_order_suite.log" 2>&1 || status=1
  tail -n 60 "$OUT/p2p_order_suite.log" | cut -c1-300
fi
