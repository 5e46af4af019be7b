// Host helpers shared by the standalone CUDA probes in scripts/ (each prints JSON lines).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace probe {

// Any failed CUDA call ends the probe with one JSON error line and exit status 2.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("{\"error\": \"%s: %s\"}\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

// The upper median (0 for no samples).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace probe
