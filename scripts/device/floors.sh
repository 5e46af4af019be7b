# Sourced by scripts/device_run.sh: the floors the CUDA rows are held to (benchmarks/floors).
# stage floors: the GPU floors ($OUT/floors.json) and the tcp floors ($OUT/tcp_floors.json), tables in $OUT/floors.log (~20 s).

# The tcp floors (benchmarks/floors/tcp_floor: loopback, and two network namespaces on a veth
# pair, which needs root) into $OUT/tcp_floors.json, its table appended to
# floors.log (at most 8 files come back from $OUT).
tcp_floors() {
  { [[ -x benchmarks/floors/build/tcp_floor ]] || bash benchmarks/floors/build.sh; } \
    >> "$OUT/floors_build.log" 2>&1 \
    && { echo "== tcp_floor"; benchmarks/floors/build/tcp_floor --json "$OUT/tcp_floors.json"; } \
    >> "$OUT/floors.log" 2>&1 \
    || { status=1; echo "tcp_floor failed (see floors*.log): rows over tcp have no ratios"; }
}

# The GPU floors of this call, measured now (built first where needed) when no stage did.
need_floors() {
  [[ -s "$OUT/floors.json" ]] && return 0
  { [[ -x benchmarks/floors/build/floors ]] || bash benchmarks/floors/build.sh; } \
    > "$OUT/floors_build.log" 2>&1 \
    && benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1 \
    || { status=1; echo "floors failed (see floors*.log): the cuda bench has no ratios"; }
}

if has floors; then
  step "floors"
  bash benchmarks/floors/build.sh > "$OUT/floors_build.log" 2>&1 || status=1
  benchmarks/floors/build/floors --json "$OUT/floors.json" > "$OUT/floors.log" 2>&1 || status=1
  tail -25 "$OUT/floors.log"
  tcp_floors
  tail -24 "$OUT/floors.log"
fi
