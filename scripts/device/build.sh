# Sourced by scripts/device_run.sh: the extension built for the torch found on the machine.
# stage build: pip install -e . (log $OUT/build.log); a failed build ends the call.
# stage build-if-needed: the same unless the extension imports already (built by an earlier call on
#   this warm machine, or carried from scripts/build_for_device.sh).

if has build-if-needed && python3 -c 'import resident_pg._C' > /dev/null 2>&1; then
  echo "== build: the extension of an earlier call (or one carried from scripts/build_for_device.sh) is there, not rebuilt"
  # Carried, it is not installed: make the checkout importable from anywhere and its entry points
  # (the backend's autoload, vLLM's plugin) visible, as `pip install -e .` would.
  if ! python3 -c 'import importlib.metadata as m; m.distribution("resident_pg")' > /dev/null 2>&1; then
    python3 setup.py -q egg_info > /dev/null 2>&1 \
      && echo "$PWD" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/resident_pg_checkout.pth" \
      || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
elif has build || has build-if-needed; then
  step "build"
  if ! MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    echo "build failed"; tail -30 "$OUT/build.log"; exit 1
  fi
fi
