// Device helpers shared by the standalone CUDA probes in benchmarks/probes/ whose least kernels
// stand in for the library's (ar8_probe.cu, proxy8_probe.cu).
#pragma once

#include <cstdint>

#include "launch_device.cuh"
#include "ll_device.cuh"

namespace probe {

// This op's number (ops done + 1), taken and advanced by thread 0 before the wait for the
// previous kernel, as the library's kernels do; every thread returns it after the wait.
__device__ __forceinline__ uint32_t enterOp(uint32_t* seq) {
  __shared__ uint32_t base;
  if (threadIdx.x == 0) {
    base = *reinterpret_cast<volatile uint32_t*>(seq);
    *reinterpret_cast<volatile uint32_t*>(seq) = base + 1;
    __threadfence();
  }
  __syncthreads();
  resident::gpu::pdlEnter();
  return base + 1;
}

// Polls the LL line at p until it carries flag g (its payload into data); false, with *error
// set, after timeout_ns.
__device__ __forceinline__ bool pollLine(const unsigned char* p, uint32_t g, uint64_t& data,
                                         int* error, uint64_t timeout_ns) {
  const uint64_t deadline = resident::gpu::globalTimerNs() + timeout_ns;
  for (uint32_t spins = 0; !resident::gpu::loadLine(p, g, data);) {
    if (++spins == 128) {
      spins = 0;
      if (resident::gpu::globalTimerNs() > deadline) {
        *error = 1;
        return false;
      }
    }
  }
  return true;
}

}  // namespace probe
