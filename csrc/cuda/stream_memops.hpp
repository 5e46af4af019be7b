// Stream memory operations (the driver's cuStreamBatchMemOp), resolved at run time through
// the runtime's driver entry point, so the extension links no libcuda and imports where the
// driver is older: writes of 32-bit values and waits on them, enqueued on a stream (and
// captured into a graph as one batch-memop node). CUDA-free header.
#pragma once

#include <cstdint>
#include <string>

namespace resident {

struct MemOp {
  enum Kind : uint8_t { kWrite, kWaitEq } kind;
  void* address;  // device pointer (device memory, or the device alias of mapped host memory)
  uint32_t value;
};

class StreamMemOps {
 public:
  // Resolves the entry point; available() is false (and why() says why) when it cannot.
  StreamMemOps();
  bool available() const { return fn_ != nullptr; }
  const std::string& why() const { return why_; }
  // Enqueues ops[0..count) on `stream` (a cudaStream_t) as one batch, in order; count <= 8.
  // Returns a cudaError_t code (0: success).
  int enqueue(void* stream, const MemOp* ops, unsigned count) const;

 private:
  void* fn_ = nullptr;
  std::string why_;
};

}  // namespace resident
