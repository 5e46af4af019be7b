// Functions shared by device code and host code (the host channel, the CPU unit tests that
// check the kernels' protocol rules): host-and-device under nvcc, plain inline under g++.
#pragma once

#ifdef __CUDACC__
#define RESIDENT_HOST_DEVICE __host__ __device__
#define RESIDENT_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define RESIDENT_HOST_DEVICE
#define RESIDENT_HOST_DEVICE_INLINE inline
#endif
