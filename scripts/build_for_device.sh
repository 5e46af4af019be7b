#!/usr/bin/env bash
# Builds the extension on this machine for the GPU machine's image (python3.12, torch 2.11.0+cu130:
# /work/.library/device/KINDS.md), so that a device call can skip its build: carry the file this
# prints and run `bash scripts/device_run.sh build-if-needed ...`, whose build stage then only
# makes the checkout importable (if the carried extension fails to import there, it builds as usual).
#
#   usage: bash scripts/build_for_device.sh    (env: DEVICE_PYTHON, DEVICE_TORCH, MAX_JOBS)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PYTHON:-python3.12}
TORCH=${DEVICE_TORCH:-torch==2.11.0}
VENV=.venv-device
if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH" ninja numpy setuptools wheel
fi
MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_ext --inplace > "$VENV/build.log" 2>&1 \
  || { tail -30 "$VENV/build.log"; exit 1; }
SO=resident_pg/_C$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
# Without its debug information the file is ~3 MB instead of ~30 (a carry holds 64 MiB); the
# symbols stay, so profiles and backtraces there still name functions.
strip --strip-debug "$SO"
echo "$SO"
