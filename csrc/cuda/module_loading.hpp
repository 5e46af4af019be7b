// Whether CUDA loads kernels lazily in this process (CUDA_MODULE_LOADING=LAZY, which PyTorch
// sets when it is unset). A kernel loaded lazily is loaded at its first launch, and that load
// waits for the kernels running in the context: behind a resident kernel that never leaves
// (RESIDENT_GPU_PERSISTENT_IDLE_US=0) it waits forever, and under MPS it was seen to end in
// an illegal-address fault instead (H200, benchmarks/RESULTS.md, session 17). CUDA-free header.
#pragma once

#include <string>

namespace resident {

enum class ModuleLoading { kLazy, kEager, kUnknown };

// The driver's cuModuleGetLoadingMode, resolved through the runtime's driver entry point
// (no libcuda link); kUnknown, with `why` set, when the driver cannot say.
ModuleLoading moduleLoading(std::string* why);

}  // namespace resident
