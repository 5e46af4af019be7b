#include "cuda/module_loading.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

namespace resident {
namespace {
using GetLoadingModeFn = CUresult (*)(CUmoduleLoadingMode*);
}  // namespace

ModuleLoading moduleLoading(std::string* why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 11070,
                                                           cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    if (why != nullptr) *why = "the driver has no cuModuleGetLoadingMode";
    return ModuleLoading::kUnknown;
  }
  CUmoduleLoadingMode mode{};
  if (reinterpret_cast<GetLoadingModeFn>(fn)(&mode) != CUDA_SUCCESS) {
    if (why != nullptr) *why = "cuModuleGetLoadingMode failed";
    return ModuleLoading::kUnknown;
  }
  return mode == CU_MODULE_LAZY_LOADING ? ModuleLoading::kLazy : ModuleLoading::kEager;
}

}  // namespace resident
