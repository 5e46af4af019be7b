// Built instead of work_cuda.cpp when the extension is compiled without CUDA: CUDA tensors
// then get a clear error naming the reason.
#include "c10d/work_cuda.hpp"

#include "core/error.hpp"
#include "ep_args.hpp"

namespace resident {

bool cudaPathBuilt() {
  return false;
}

class CudaStreams {};

namespace {
[[noreturn]] void noCudaPath() {
  throw InvalidArgument(
      "resident: this build of resident_pg has no CUDA path (built without nvcc)");
}
}  // namespace

c10::intrusive_ptr<c10d::Work> CudaPath::collective(
    c10d::OpType, const char*, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, bool,
    c10::function_ref<void(GpuCommunicator&, void*)>) {
  noCudaPath();
}

c10::intrusive_ptr<c10d::Work> CudaPath::pointToPoint(c10d::OpType, const char*, const at::Tensor&,
                                                      bool, int) {
  noCudaPath();
}

void CudaPath::setTimeoutMs(uint64_t ms) {
  timeout_ms_ = ms;
}

void CudaPath::shutdown() {}

void flushPendingP2P() {}

namespace ep {

bool kernelsBuilt() {
  return false;
}

namespace {
const char* const kNoKernels = "this build of resident_pg has no CUDA path (built without nvcc)";
}

std::string launchRoute(const RouteArgs&, void*) {
  return kNoKernels;
}
std::string launchUnpack(const UnpackArgs&, void*) {
  return kNoKernels;
}
std::string launchCombinePack(const CombinePackArgs&, void*) {
  return kNoKernels;
}
std::string launchCombineReduce(const CombineReduceArgs&, void*) {
  return kNoKernels;
}

}  // namespace ep

}  // namespace resident
