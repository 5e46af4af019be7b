# Sourced by scripts/device_run.sh: the extension built for the torch found on the machine.
# stage build: pip install -e . (log $OUT/build.log); a failed build ends the call.
# stage build-if-needed: the same unless the extension of an earlier call on this (warm) machine imports.

if has build-if-needed && python3 -c 'import resident_pg._C' > /dev/null 2>&1; then
  echo "== build: the extension of an earlier call is there, not rebuilt"
elif has build || has build-if-needed; then
  step "build"
  if ! MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    echo "build failed"; tail -30 "$OUT/build.log"; exit 1
  fi
fi
