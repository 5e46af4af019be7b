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

// Replays graph `ge` on `s` `replays` times after 3 untimed ones, timed with events; returns
// microseconds per node of each timed replay. before(r) runs before replay r; false stops (the
// replays so far are returned).
template <class Before>
std::vector<double> timeReplays(cudaGraphExec_t ge, cudaStream_t s, int nodes, int replays,
                                Before before) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<double> per_node;
  for (int r = 0; r < replays + 3 && before(r); ++r) {
    check(cudaEventRecord(e0, s), "record");
    check(cudaGraphLaunch(ge, s), "graph launch");
    check(cudaEventRecord(e1, s), "record");
    check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (r >= 3) per_node.push_back(1000.0 * ms / nodes);
  }
  check(cudaEventDestroy(e0), "event");
  check(cudaEventDestroy(e1), "event");
  return per_node;
}

}  // namespace probe
