#!/usr/bin/env bash
# Builds the floors benchmark into benchmarks/floors/build/floors (CUDA C++17, Hopper sm_90).
# Override: NVCC=/path/to/nvcc ARCH=sm_90 bash build.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${NVCC:-}" ]]; then
  if [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
    NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  else
    NVCC="nvcc"
  fi
fi
mkdir -p "$here/build"
"$NVCC" -O3 -std=c++17 -arch="${ARCH:-sm_90}" -lineinfo -Xcompiler -Wall,-Wextra \
  -o "$here/build/floors" "$here/floors.cu" -lrt
echo "built $here/build/floors"
