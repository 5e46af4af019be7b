#include "cuda/stream_memops.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "cuda/driver_entry.hpp"

namespace resident {
namespace {
using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
}  // namespace

StreamMemOps::StreamMemOps() {
  fn_ = driverEntryPoint("cuStreamBatchMemOp", 12000, &why_);  // in the body: why_ exists
}

int StreamMemOps::enqueue(void* stream, const MemOp* ops, unsigned count) const {
  if (fn_ == nullptr || count > 8) return cudaErrorNotSupported;
  CUstreamBatchMemOpParams params[8];
  std::memset(params, 0, sizeof(params));
  for (unsigned i = 0; i < count; ++i) {
    const auto address = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ops[i].address));
    // NOLINTNEXTLINE(bugprone-branch-clone): writeValue and waitValue are different union members
    if (ops[i].kind == MemOp::kWrite) {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      params[i].writeValue.address = address;
      params[i].writeValue.value = ops[i].value;
      params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    } else {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      params[i].waitValue.address = address;
      params[i].waitValue.value = ops[i].value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
    }
  }
  const CUresult r =
      reinterpret_cast<BatchMemOpFn>(fn_)(reinterpret_cast<CUstream>(stream), count, params, 0);
  // The driver's and the runtime's codes agree for the errors this can return.
  return static_cast<int>(r);
}

}  // namespace resident
