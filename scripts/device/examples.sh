# Sourced by scripts/device_run.sh: what a user runs first.
# stage doctor: python -m resident_pg.doctor, text and --json ($OUT/doctor.log, doctor.json).
# stage examples: the TP and EP decode examples on the GPU, 2 ranks under MPS, CUDA graphs, --check against gloo, batch 1 and 8 ($OUT/examples.log).

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
