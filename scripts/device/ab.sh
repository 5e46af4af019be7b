# Sourced by scripts/device_run.sh: variants side by side in one run (2 ranks, graph mode unless
# said, ratios to this call's floors), so that machine noise between runs cannot decide.
# stage bench-ab: backends side by side, each twice (default: the direct and proxy paths and tcp; RESIDENT_AB_BACKENDS, RESIDENT_AB_SIZES) ($OUT/bench_ab.json, ~1 min).
# stage bench-ab-tree: this tree against the one in RESIDENT_AB_TREE, alternately, RESIDENT_AB_TREE_RUNS rounds (default 2) ($OUT/bench_ab_tree_{this,other}_N.json, ~1.5 min to build the other tree unless its extension imports already).
# stage overhead-ab-tree: benchmarks/overhead.py's CUDA part (the eager op's host time beside a bare kernel) in this tree and in the one in RESIDENT_AB_TREE, alternately, RESIDENT_AB_TREE_RUNS rounds (default 2) of 2 process pairs each ($OUT/overhead_ab_{this,other}_N.json; the other tree is built unless its extension imports already).
# stage bench-protocol: RESIDENT_GPU_PROTOCOL simple (the default) beside ll, twice each, direct path, 2/4/8 ranks, 64 KiB..1 MiB ($OUT/bench_protocol.json; RESIDENT_BENCH_LIMIT_S).
# stage bench-p2p: send/recv (and all_reduce) 8 B..1 MiB, eager and graph, direct, direct with RESIDENT_GPU_P2P_STREAM=own, proxy ($OUT/bench_p2p.json, ~1 min; RESIDENT_P2P_BACKENDS, RESIDENT_P2P_SIZES).

# The A/B run of bench-ab and bench-ab-tree: the five ops, sizes $RESIDENT_AB_SIZES (default
# $1) and backends $RESIDENT_AB_BACKENDS (default $2), no new group after $3 s, into
# $OUT/$4.json.
ab_bench() {
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv \
    --sizes "${RESIDENT_AB_SIZES:-$1}" --backends "${RESIDENT_AB_BACKENDS:-$2}" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit "$3" --json "$OUT/$4.json"
}

if has bench-ab; then
  step "bench (cuda, knob A/B)"
  need_floors
  ab_bench 8,4K,16K,64K "resident:path=direct,resident:path=proxy,resident:transport=tcp,resident:path=direct,resident:path=proxy,resident:transport=tcp" \
    200 bench_ab > "$OUT/bench_ab.log" 2>&1 || status=1
  tail -n 70 "$OUT/bench_ab.log"
fi

# RESIDENT_AB_TREE: a directory holding the other revision's setup.py, csrc, kernels and
# resident_pg (`git archive REV setup.py pyproject.toml csrc kernels resident_pg | tar -x -C
# abold`). ab_tree_built: that tree built in place unless its extension imports already (e.g.
# one built by scripts/build_for_device.sh, carried); false, and the build's tail printed, if the
# build fails.
ab_tree_built() {
  (cd "$RESIDENT_AB_TREE" && python3 -c 'import resident_pg._C') > /dev/null 2>&1 && return 0
  (cd "$RESIDENT_AB_TREE" && MAX_JOBS=16 python3 setup.py build_ext --inplace) \
    > "$OUT/build_ab_tree.log" 2>&1 && return 0
  echo "build of $RESIDENT_AB_TREE failed"; tail -30 "$OUT/build_ab_tree.log"
  return 1
}

# ab_tree_rounds TAG PATTERN FUNCTION: RESIDENT_AB_TREE_RUNS rounds (default 2) of FUNCTION in
# this tree and in RESIDENT_AB_TREE, the first side changing every round (neither always first).
# FUNCTION runs in the side's tree with the run's name (TAG_<side>_<round>) as $1; its log is
# $OUT/<name>.log, whose lines matching PATTERN are printed. The side's tree comes first on
# sys.path (PYTHONPATH; a script's own directory and python -m's working directory only before
# it), so each run and its spawned ranks import that tree's package; the log says which file.
ab_tree_rounds() {
  local tag=$1 pattern=$2 fn=$3 round side sides dir name
  for ((round = 1; round <= ${RESIDENT_AB_TREE_RUNS:-2}; ++round)); do
    sides="this other"; ((round % 2 == 0)) && sides="other this"
    for side in $sides; do
      dir=.; [[ $side == other ]] && dir=$RESIDENT_AB_TREE
      name=${tag}_${side}_$round
      (cd "$dir" && export PYTHONPATH=$PWD &&
        python3 -c 'import resident_pg._C as c; print("module:", c.__file__)' && "$fn" "$name") \
        > "$OUT/$name.log" 2>&1 || status=1
      grep -E "^module:|$pattern" "$OUT/$name.log"
    done
  done
}

tree_bench() {
  ab_bench 8,16K,64K "resident:path=direct,resident:path=proxy" 120 "$1"
}

AB_THIS_TREE=$PWD
tree_overhead() {  # this tree's script on both sides: only the library differs
  python3 "$AB_THIS_TREE/benchmarks/overhead.py" --device cuda --backends resident --iters 4000 \
    --spawns 2 --json "$OUT/$1.json"
}

if has bench-ab-tree; then
  step "bench (this tree against $RESIDENT_AB_TREE)"
  need_floors
  if ab_tree_built; then
    ab_tree_rounds bench_ab_tree "^all_reduce|^send_recv" tree_bench
  else
    status=1
  fi
fi

if has overhead-ab-tree; then
  step "overhead (this tree against $RESIDENT_AB_TREE)"
  if ab_tree_built; then
    ab_tree_rounds overhead_ab "^TARGET|^the vLLM" tree_overhead
  else
    status=1
  fi
fi

# Sizes where a round to one peer carries over 32 KiB at some rank count (those go simple;
# smaller ones are LL lines under both settings).
if has bench-protocol; then
  step "bench (cuda, protocol A/B)"
  need_floors
  python3 -m resident_pg.bench --device cuda --mode graph --world-sizes 2,4,8 \
    --ops all_reduce,all_gather,reduce_scatter,all_to_all_single,send_recv --sizes 64K,256K,1M \
    --backends "resident:path=direct,resident:path=direct:RESIDENT_GPU_PROTOCOL=ll,resident:path=direct,resident:path=direct:RESIDENT_GPU_PROTOCOL=ll" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit ${RESIDENT_BENCH_LIMIT_S:-200} \
    --json "$OUT/bench_protocol.json" > "$OUT/bench_protocol.log" 2>&1 || status=1
  tail -n 70 "$OUT/bench_protocol.log"
fi

if has bench-p2p; then
  step "bench (cuda, send/recv stream placement A/B)"
  need_floors
  python3 -m resident_pg.bench --device cuda --mode eager,graph --world-sizes 2 \
    --ops send_recv,all_reduce --sizes "${RESIDENT_P2P_SIZES:-8,4K,64K,1M}" \
    --backends "${RESIDENT_P2P_BACKENDS:-resident:path=direct,resident:path=direct:RESIDENT_GPU_P2P_STREAM=own,resident:path=proxy}" \
    --floors "$OUT/floors.json" --timeout 30 --time-limit 120 \
    --json "$OUT/bench_p2p.json" > "$OUT/bench_p2p.log" 2>&1 || status=1
  tail -n 40 "$OUT/bench_p2p.log"
fi
