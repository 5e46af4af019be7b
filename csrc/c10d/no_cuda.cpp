// Built instead of work_cuda.cpp when the extension is compiled without CUDA: CUDA tensors
// then get a clear error naming the reason.
#include "c10d/work_cuda.hpp"

#include "core/error.hpp"

namespace resident {

bool cudaPathBuilt() {
  return false;
}

class CudaStreams {};

c10::intrusive_ptr<c10d::Work> runCudaOp(Communicator&, std::shared_ptr<GpuCommunicator>&,
                                         std::shared_ptr<CudaStreams>&, uint64_t, int, c10d::OpType,
                                         const char*, const std::vector<at::Tensor>&,
                                         const std::vector<at::Tensor>&, bool,
                                         c10::function_ref<void(GpuCommunicator&, void*)>) {
  throw InvalidArgument(
      "resident: this build of resident_pg has no CUDA path (built without nvcc)");
}

c10::intrusive_ptr<c10d::Work> runCudaP2P(Communicator&, std::shared_ptr<GpuCommunicator>&,
                                          std::shared_ptr<CudaStreams>&, uint64_t, int,
                                          c10d::OpType, const char*, const at::Tensor&, bool, int) {
  throw InvalidArgument(
      "resident: this build of resident_pg has no CUDA path (built without nvcc)");
}

void flushPendingP2P() {}

void shutdownCuda(std::shared_ptr<GpuCommunicator>&, std::shared_ptr<CudaStreams>&) {}

}  // namespace resident
