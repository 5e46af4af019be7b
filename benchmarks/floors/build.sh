#!/usr/bin/env bash
# Builds the floor benchmarks into benchmarks/floors/build/:
#   tcp_floor  (C++17, no CUDA) wherever a C++ compiler exists ($CXX, default g++);
#   floors     (CUDA C++17, Hopper sm_90) where nvcc exists.
# Override: CXX=clang++ NVCC=/path/to/nvcc ARCH=sm_90 bash build.sh
# Fails when a compiler that was found fails, or when neither program could be built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$here/build"
built=0

CXX="${CXX:-g++}"
if command -v "$CXX" > /dev/null; then
  csrc="$here/../../csrc"  # the library's address helpers, as the tcp transport writes them
  "$CXX" -O2 -std=c++17 -Wall -Wextra -I "$csrc" -o "$here/build/tcp_floor" "$here/tcp_floor.cpp" \
    "$csrc/core/transport/tcp_address.cpp"
  echo "built $here/build/tcp_floor"
  built=$((built + 1))
else
  echo "no C++ compiler ($CXX): tcp_floor not built"
fi

if [[ -z "${NVCC:-}" ]]; then
  if [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
    NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  else
    NVCC="nvcc"
  fi
fi
if command -v "$NVCC" > /dev/null; then
  "$NVCC" -O3 -std=c++17 -arch="${ARCH:-sm_90}" -lineinfo -Xcompiler -Wall,-Wextra \
    -o "$here/build/floors" "$here/floors.cu" -lrt
  echo "built $here/build/floors"
  built=$((built + 1))
else
  echo "no nvcc ($NVCC): floors (the GPU floors) not built"
fi

[[ $built -gt 0 ]] || { echo "nothing built" >&2; exit 1; }
