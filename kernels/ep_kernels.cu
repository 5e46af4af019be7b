// EP dispatch/combine on the device (ep_args.hpp): the routing, packing and unpacking around
// the exchanges of resident_pg.moe, each one kernel that reads and writes only the rows in use.
// The CPU path (torch ops in resident_pg/moe.py) writes every row of the [L, max_slots] expert
// buffer per dispatch (hundreds of MB at hidden 7168 with 256 experts) in some thirty ops.
//
// Plain launches (no programmatic dependent launch): each kernel starts after the previous one
// on the stream completes, and the next resident kernel's griddepcontrol.wait waits for it.
#include <cuda_runtime.h>

#include <algorithm>

#include "ep_device.cuh"
#include "launch_device.cuh"

namespace resident {
namespace ep {
namespace {

// Blocks a launch aims at: two per SM of the H200 (132 SMs); more only adds scheduling.
constexpr int64_t kTargetBlocks = 264;
// Parts per item at most: enough for a pack of two sources to fill the GPU.
constexpr int kMaxParts = 132;

// Each kernel: block (item, part) of a grid of items x parts runs that item (ep_device.cuh).
template <typename V, typename X>
__global__ void __launch_bounds__(kEpThreads) routeKernel(const RouteArgs a) {
  extern __shared__ int32_t pairs_to[];  // [W] routed pairs per peer (block (0, 0) only)
  __shared__ RouteScratch sh;
  if (threadIdx.x == 0) sh.pairs_to = pairs_to;
  __syncthreads();
  routeItem<V, X>(a, blockIdx.x, blockIdx.y, gridDim.y, sh);
}

template <typename V>
__global__ void __launch_bounds__(kEpThreads) unpackKernel(const UnpackArgs a) {
  extern __shared__ int64_t per_source[];  // [3][W]: rows, first slot, first row of expert_x
  __shared__ UnpackScratch sh;
  if (threadIdx.x == 0) sh.per_source = per_source;
  __syncthreads();
  unpackItem<V>(a, blockIdx.x, blockIdx.y, gridDim.y, sh);
}

template <typename V>
__global__ void __launch_bounds__(kEpThreads) combinePackKernel(const CombinePackArgs a) {
  __shared__ unsigned long long sum;
  combinePackItem<V>(a, blockIdx.x, blockIdx.y, gridDim.y, sum);
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kEpThreads) combineReduceKernel(const CombineReduceArgs a) {
  extern __shared__ int64_t pair_rows[];  // [K] slots, then [K] float weights
  combineReduceItem<In, Out>(a, blockIdx.x, blockIdx.y, gridDim.y, pair_rows,
                             reinterpret_cast<float*>(pair_rows + a.topk));
}

// Calls f with a value of the copy unit type of `bytes`.
template <typename F>
cudaError_t byUnit(int bytes, F&& f) {
  switch (bytes) {
    case 16:
      return f(uint4{});
    case 8:
      return f(uint2{});
    case 4:
      return f(uint32_t{});
    case 2:
      return f(uint16_t{});
    default:
      return f(uint8_t{});
  }
}

// Calls f with a value of the element type of `dtype` (float, __half or __nv_bfloat16).
template <typename F>
cudaError_t byDtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32:
      return f(float{});
    case Dtype::kFloat16:
      return f(__half{});
    case Dtype::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Parts per item so that items * parts reaches about kTargetBlocks, but no more parts than
// there is work per item.
int partsFor(int64_t items, int64_t most) {
  if (items <= 0) return 1;
  int64_t parts = (kTargetBlocks + items - 1) / items;
  parts = std::min<int64_t>(std::min<int64_t>(parts, most), kMaxParts);
  return static_cast<int>(std::max<int64_t>(parts, 1));
}

std::string result(cudaError_t err) {
  if (err == cudaSuccess) err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace

bool kernelsBuilt() {
  return true;
}

std::string loadKernels() {
  const auto fn = [](auto kernel) { return reinterpret_cast<const void*>(kernel); };
  cudaError_t err = cudaSuccess;
  for (int unit : {16, 8, 4, 2, 1}) {  // every copy unit of byUnit
    if (err == cudaSuccess) {
      err = byUnit(unit, [&](auto u) {
        using V = decltype(u);
        return gpu::loadFunctions(
            {fn(routeKernel<V, void>), fn(unpackKernel<V>), fn(combinePackKernel<V>)});
      });
    }
  }
  const Dtype dtypes[] = {Dtype::kFloat32, Dtype::kFloat16, Dtype::kBFloat16};
  for (Dtype in : dtypes) {
    // the routing kernel's FP8 cast from `in`, then the combine of `in` into every dtype
    if (err == cudaSuccess)
      err = byDtype(
          in, [&](auto i) { return gpu::loadFunctions({fn(routeKernel<uint8_t, decltype(i)>)}); });
    for (Dtype out : dtypes) {
      if (err == cudaSuccess) {
        err = byDtype(in, [&](auto i) {
          return byDtype(out, [&](auto o) {
            return gpu::loadFunctions({fn(combineReduceKernel<decltype(i), decltype(o)>)});
          });
        });
      }
    }
  }
  return result(err);
}

std::string launchRoute(const RouteArgs& a, void* stream) {
  if (a.experts <= 0) return std::string();
  const int unit = unitBytes(
      a.row_bytes, {reinterpret_cast<uintptr_t>(a.x), reinterpret_cast<uintptr_t>(a.send_x),
                    static_cast<uintptr_t>(a.x_stride)});
  const dim3 grid(static_cast<unsigned>(a.experts),
                  static_cast<unsigned>(partsFor(a.experts, std::max(a.tokens, 1))));
  const size_t shared = sizeof(int32_t) * static_cast<size_t>(a.ranks);
  const auto s = static_cast<cudaStream_t>(stream);
  if (a.cast != RowCast::kCopy) {
    return result(byDtype(a.x_dtype, [&](auto x) {
      routeKernel<uint8_t, decltype(x)><<<grid, kEpThreads, shared, s>>>(a);
      return cudaGetLastError();
    }));
  }
  return result(byUnit(unit, [&](auto u) {
    routeKernel<decltype(u), void><<<grid, kEpThreads, shared, s>>>(a);
    return cudaGetLastError();
  }));
}

std::string launchUnpack(const UnpackArgs& a, void* stream) {
  if (a.local_experts <= 0) return std::string();
  const int unit = unitBytes(
      a.head_bytes, {reinterpret_cast<uintptr_t>(a.recv_x), reinterpret_cast<uintptr_t>(a.expert_x),
                     static_cast<uintptr_t>(a.row_bytes)});
  const dim3 grid(static_cast<unsigned>(a.local_experts),
                  static_cast<unsigned>(partsFor(a.local_experts, a.max_slots)));
  const size_t shared = 3 * sizeof(int64_t) * static_cast<size_t>(a.ranks);
  return result(byUnit(unit, [&](auto u) {
    unpackKernel<decltype(u)><<<grid, kEpThreads, shared, static_cast<cudaStream_t>(stream)>>>(a);
    return cudaGetLastError();
  }));
}

std::string launchCombinePack(const CombinePackArgs& a, void* stream) {
  if (a.ranks <= 0) return std::string();
  const int unit = unitBytes(a.row_bytes, {reinterpret_cast<uintptr_t>(a.expert_y),
                                           reinterpret_cast<uintptr_t>(a.comb_send)});
  const dim3 grid(static_cast<unsigned>(a.ranks),
                  static_cast<unsigned>(partsFor(a.ranks, a.slots)));
  return result(byUnit(unit, [&](auto u) {
    combinePackKernel<decltype(u)><<<grid, kEpThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
    return cudaGetLastError();
  }));
}

std::string launchCombineReduce(const CombineReduceArgs& a, void* stream) {
  if (a.tokens <= 0 || a.hidden <= 0) return std::string();
  const int64_t columns = (a.hidden + kEpThreads - 1) / kEpThreads;
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>(partsFor(a.tokens, columns)));
  const size_t shared = (sizeof(int64_t) + sizeof(float)) * static_cast<size_t>(a.topk);
  const auto s = static_cast<cudaStream_t>(stream);
  return result(byDtype(a.in_dtype, [&](auto in) {
    return byDtype(a.out_dtype, [&](auto out) {
      combineReduceKernel<decltype(in), decltype(out)><<<grid, kEpThreads, shared, s>>>(a);
      return cudaGetLastError();
    });
  }));
}

}  // namespace ep
}  // namespace resident
