// A driver API function resolved at run time through the runtime's driver entry point, so the
// extension links no libcuda and still imports where the driver lacks the function.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace resident {

// The function `name` as of CUDA version `cuda_version` (e.g. 12000), or null with `why` set.
inline void* driverEntryPoint(const char* name, int cuda_version, std::string* why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, cuda_version, cudaEnableDefault, &status);
  if (err == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr) return fn;
  if (why != nullptr) {
    *why = std::string("the driver has no ") + name + " (" +
           (err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found") + ")";
  }
  return nullptr;
}

}  // namespace resident
