// Small RAII helpers of the CUDA host side: the current device, the thread's stream-capture
// mode, and CUDA errors turned into CommError. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "core/error.hpp"

namespace resident {

inline void checkCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw CommError(std::string("resident: ") + what + " failed: " + cudaGetErrorString(err));
}

// Set-up runs in relaxed capture mode, so that work issued inside a graph capture (a first op
// registering memory, a descriptor upload on a private stream) is allowed.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = prev_;
    cudaGetDevice(&now);
    if (now != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};

}  // namespace resident
