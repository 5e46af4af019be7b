# Sourced by scripts/device_run.sh: the standalone measurement probes of benchmarks/probes
# (README.md there: what each measures and which document cites it), and the proxy's timeline.
# stage poll-probe: ll_poll_probe.cu: LL lines through mapped host memory per poll mode and block count, the credit wait, a late sender (RESIDENT_POLL_PROBE_SECTIONS: sweep,credit,abort) ($OUT/poll_probe.jsonl, ~10 s).
# stage poll-stagger-probe: poll_stagger_probe.cu: a GPU thread's poll of mapped host memory with one load or several staggered loads in flight, as a ping-pong with a CPU thread ($OUT/poll_stagger_probe.jsonl, ~5 s).
# stage ar8-probe: ar8_probe.cu: the 2-rank 8 B all_reduce in a replayed graph, the library's kernel beside the least kernel of the design ($OUT/ar8_probe.jsonl, ~10 s).
# stage ar64k-probe: ar64k_probe.cu: the 2-rank 64 KiB LL all_reduce, least kernels ordering stores and polls differently, with each variant's SASS ($OUT/ar64k_probe.jsonl, ~10 s).
# stage proxy8-probe: proxy8_probe.cu: the 2-rank 8 B all_reduce over the proxy path, the least proxy path beside the library's kernel ($OUT/proxy8_probe.jsonl, ~10 s).
# stage proxy-copy-probe: proxy_copy_probe.cu: the proxy's line check and copy on this host and the peer kernel's read of the result, per size ($OUT/proxy_copy_probe.jsonl, ~10 s).
# stage launch-probe: launch_cost_probe.cu: the host's cost of each CUDA call of an eager op (the launch with the library's CollectiveArgs or small args, the capture check and the event record through the runtime and the driver, the device guard) ($OUT/launch_cost_probe.jsonl, ~5 s).
# stage tcp-exchange-probe: tcp_exchange_probe.cpp: the 2-rank all_reduce's exchange over loopback tcp with no GPU and no library, with a stand-in of the GPU stage, per socket and thread variant ($OUT/tcp_exchange_probe.jsonl, ~1 min).
# stage proxy-trace: the 2-rank graph benchmark of proxied cells (RESIDENT_TRACE_CELLS, op:size[:KEY=VALUE...]) with RESIDENT_GPU_PROXY_TRACE, summarised by scripts/proxy_trace_summary.py ($OUT/trace_summary_<cell>.json, raw in proxy_traces.tgz).

PROBES=benchmarks/probes

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
  run_probe poll_probe "-O2 $PROBES/ll_poll_probe.cu" "${RESIDENT_POLL_PROBE_ITERS:-50}" \
    "${RESIDENT_POLL_PROBE_ALLOCS:-shared}" "${RESIDENT_POLL_PROBE_SECTIONS:-sweep,credit,abort}"
fi

if has poll-stagger-probe; then
  step "poll stagger probe"
  run_probe poll_stagger_probe "-O2 $PROBES/poll_stagger_probe.cu" "${RESIDENT_POLL_STAGGER_ITERS:-20000}"
fi

if has ar8-probe; then
  step "8 B all_reduce probe"
  run_probe ar8_probe "-O3 $PROBES/ar8_probe.cu kernels/collective_kernel.cu kernels/one_round_kernel.cu" \
    "${RESIDENT_AR8_PROBE_NODES:-200}" "${RESIDENT_AR8_PROBE_REPLAYS:-31}"
fi

if has ar64k-probe; then
  step "64 KiB all_reduce store/poll order probe"
  run_probe ar64k_probe "-O3 $PROBES/ar64k_probe.cu" \
    "${RESIDENT_AR64K_PROBE_NODES:-100}" "${RESIDENT_AR64K_PROBE_REPLAYS:-31}"
  cuobjdump --dump-sass /tmp/ar64k_probe 2>&1 | grep -E 'Function|STG|LDG|ST\.|LD\.' \
    > "$OUT/ar64k_probe_sass.txt" || true
fi

if has proxy8-probe; then
  step "proxy-path 8 B all_reduce probe"
  run_probe proxy8_probe "-O3 $PROBES/proxy8_probe.cu kernels/collective_kernel.cu kernels/one_round_kernel.cu" \
    "${RESIDENT_AR8_PROBE_NODES:-200}" "${RESIDENT_AR8_PROBE_REPLAYS:-31}"
fi

if has launch-probe; then
  step "launch cost probe"
  run_probe launch_cost_probe "-O2 $PROBES/launch_cost_probe.cu" 31
fi

if has tcp-exchange-probe; then
  step "tcp exchange probe"
  if g++ -O2 -std=c++17 -pthread -o /tmp/tcp_exchange_probe $PROBES/tcp_exchange_probe.cpp \
      > "$OUT/tcp_exchange_probe_build.log" 2>&1; then
    timeout 120 /tmp/tcp_exchange_probe | tee "$OUT/tcp_exchange_probe.jsonl" || status=1
  else
    status=1; tail -20 "$OUT/tcp_exchange_probe_build.log"
  fi
fi

if has proxy-copy-probe; then
  step "proxy copy probe"
  lscpu | grep -E "Model name|Socket|NUMA node|L3" | tee "$OUT/proxy_copy_probe_cpu.txt"
  run_probe proxy_copy_probe "-O2 -Xcompiler -msse4.1 $PROBES/proxy_copy_probe.cu" 50
fi

# Where a proxied op's time goes: the 2-rank graph benchmark of one op and size at a time with
# RESIDENT_GPU_PROXY_TRACE, then scripts/proxy_trace_summary.py over both ranks' timelines
# (default cells: all_reduce at 8 B, 16 KiB, 64 KiB and all_gather at 64 KiB;
# $OUT/trace_<cell>.{log,json}, summaries $OUT/trace_summary_<cell>.json, the raw timelines in
# $OUT/proxy_traces.tgz).
if has proxy-trace; then
  step "proxy trace (2 ranks, graph, proxy path)"
  need_floors
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
