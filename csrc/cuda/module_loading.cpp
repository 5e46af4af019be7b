#include "cuda/module_loading.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/driver_entry.hpp"

namespace resident {
namespace {
using GetLoadingModeFn = CUresult (*)(CUmoduleLoadingMode*);
}  // namespace

ModuleLoading moduleLoading(std::string* why) {
  void* fn = driverEntryPoint("cuModuleGetLoadingMode", 11070, why);
  if (fn == nullptr) return ModuleLoading::kUnknown;
  CUmoduleLoadingMode mode{};
  if (reinterpret_cast<GetLoadingModeFn>(fn)(&mode) != CUDA_SUCCESS) {
    if (why != nullptr) *why = "cuModuleGetLoadingMode failed";
    return ModuleLoading::kUnknown;
  }
  return mode == CU_MODULE_LAZY_LOADING ? ModuleLoading::kLazy : ModuleLoading::kEager;
}

}  // namespace resident
