// EP dispatch/combine on the device (ep_args.hpp): the routing, packing and unpacking around
// the exchanges of resident_pg.moe, each one kernel that reads and writes only the rows in use.
// The CPU path (torch ops in resident_pg/moe.py) writes every row of the [L, max_slots] expert
// buffer per dispatch (hundreds of MB at hidden 7168 with 256 experts) in some thirty ops.
//
// Plain launches (no programmatic dependent launch): each kernel starts after the previous one
// on the stream completes, and the next resident kernel's griddepcontrol.wait waits for it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "ep_args.hpp"
#include "launch_device.cuh"

namespace resident {
namespace ep {
namespace {

constexpr int kEpThreads = 256;
constexpr int kEpWarps = kEpThreads / 32;
// Blocks a launch aims at: two per SM of the H200 (132 SMs); more only adds scheduling.
constexpr int64_t kTargetBlocks = 264;
// Parts per item at most: enough for a pack of two sources to fill the GPU.
constexpr int kMaxParts = 132;

__device__ __forceinline__ int64_t nonNegative(int64_t v) {
  return v > 0 ? v : 0;
}

// Expert of pair `p`, or -1 when it names none (-1, or out of range: not routed, as DeepEP).
__device__ __forceinline__ int32_t expertAt(const RouteArgs& a, int64_t p) {
  const int64_t v = a.index_bytes == 8 ? static_cast<const int64_t*>(a.topk_idx)[p]
                                       : static_cast<const int32_t*>(a.topk_idx)[p];
  return v >= 0 && v < a.experts ? static_cast<int32_t>(v) : -1;
}

__device__ __forceinline__ float toFloat(float v) {
  return v;
}
__device__ __forceinline__ float toFloat(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float toFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ float fromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// FP8 rows (RouteArgs::cast): one warp casts one group of 128 channels, 4 per lane.
constexpr int kFp8Group = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8MaxInv = 1.0f / 448.0f;  // as DeepEP's; the reference's FP8_MAX_INV
constexpr float kFp8AmaxFloor = 1e-4f;       // DeepEP's kFP8Margin

// Lane `lane`'s 4 channels of group g of activation row `in` cast to e4m3 (the clamp to +-448
// then round to nearest even of resident_pg.ep_fp8.quantize), stored at `out` (the FP8 row),
// lane 0 also storing the group's scale after the row's `hidden` value bytes.
template <typename X>
__device__ __forceinline__ void castGroup(const RouteArgs& a, const X* in, unsigned char* out,
                                          int g, int lane) {
  const X* from = in + g * kFp8Group + lane * 4;
  float v[4];
  float amax = 0.f;
  for (int i = 0; i < 4; ++i) {
    v[i] = toFloat(from[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  amax = fmaxf(amax, kFp8AmaxFloor);
  float scale, scale_inv;
  if (a.round_scale) {  // 2^ceil(log2(amax / 448)) from the float's bits, as the reference
    const uint32_t bits = __float_as_uint(amax * kFp8MaxInv);
    const int e = static_cast<int>((bits >> 23) & 0xFFu) - 127 + ((bits & 0x7FFFFFu) != 0u);
    scale_inv = __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
    scale = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
  } else {
    scale_inv = amax * kFp8MaxInv;
    scale = __fdiv_rn(kFp8Max, amax);  // a true division, as the reference's
  }
  uint32_t packed = 0;
  for (int i = 0; i < 4; ++i) {
    const float q = fminf(fmaxf(__fmul_rn(v[i], scale), -kFp8Max), kFp8Max);
    packed |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(out + g * kFp8Group + lane * 4) = packed;
  if (lane != 0) return;
  if (a.cast == RowCast::kFp8Ue8m0)
    out[a.hidden + g] = static_cast<unsigned char>((__float_as_uint(scale_inv) >> 23) & 0xFFu);
  else
    reinterpret_cast<float*>(out + a.hidden)[g] = scale_inv;
}

// Block (e, part) serves expert e: pass 1 counts the pairs of e's peer routed to its earlier
// experts (where e's slots start), pass 2 ranks e's pairs in token order, writes their slots
// and copies (X void) or casts (X the activation type, RouteArgs::cast) the placed rows, entry i
// of each chunk by part i % parts. Block (0, 0) also writes the slots of unrouted pairs and the
// dropped count.
template <typename V, typename X>
__global__ void __launch_bounds__(kEpThreads) routeKernel(const RouteArgs a) {
  extern __shared__ int32_t pairs_to[];  // [W] routed pairs per peer (block (0, 0) only)
  __shared__ int32_t warp_hits[kEpWarps];
  __shared__ int32_t list_token[kEpThreads];
  __shared__ int64_t list_slot[kEpThreads];
  const int e = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const int L = a.experts / a.ranks, d = e / L;
  const int64_t P = static_cast<int64_t>(a.tokens) * a.topk;
  const int64_t no_slot = static_cast<int64_t>(a.ranks) * a.slots;
  const bool first = e == 0 && part == 0;
  if (first)
    for (int i = threadIdx.x; i < a.ranks; i += blockDim.x) pairs_to[i] = 0;
  __syncthreads();

  int64_t before = 0;  // pairs of peer d for experts below e: e's first slot
  for (int64_t base = 0; base < P; base += blockDim.x) {
    const int64_t p = base + threadIdx.x;
    const int32_t v = p < P ? expertAt(a, p) : -1;
    before += __syncthreads_count(v >= 0 && v < e && v / L == d);
    if (first && v >= 0) atomicAdd(&pairs_to[v / L], 1);
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t units = static_cast<uint32_t>(a.row_bytes / sizeof(V));
  const auto* src = static_cast<const char*>(a.x);
  auto* dst = static_cast<V*>(a.send_x);
  int64_t hits = 0;  // e's pairs in the chunks done
  for (int64_t base = 0; base < P; base += blockDim.x) {
    const int64_t p = base + threadIdx.x;
    const int32_t v = p < P ? expertAt(a, p) : -1;
    const bool hit = v == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_hits[warp] = __popc(ballot);
    __syncthreads();
    int below = 0, chunk = 0;
    for (int w = 0; w < kEpWarps; ++w) {
      below += w < warp ? warp_hits[w] : 0;
      chunk += warp_hits[w];
    }
    const int index = below + __popc(ballot & ((1u << lane) - 1u));
    const int64_t pos = before + hits + index;
    const int64_t slot = pos < a.slots ? d * a.slots + pos : -1;
    if (part == 0 && p < P && (hit || (v < 0 && e == 0)))
      a.pair_slot[p] = hit && slot >= 0 ? slot : no_slot;
    if (hit) {
      list_token[index] = static_cast<int32_t>(p / a.topk);
      list_slot[index] = slot;
    }
    __syncthreads();
    const int mine = chunk > part ? (chunk - part + parts - 1) / parts : 0;
    if constexpr (std::is_void_v<X>) {
      for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(mine) * units; f += blockDim.x) {
        const uint32_t row = f / units, u = f - row * units;
        const int i = static_cast<int>(row) * parts + part;
        const int64_t s = list_slot[i];
        if (s >= 0)
          dst[s * units + u] =
              reinterpret_cast<const V*>(src + static_cast<int64_t>(list_token[i]) * a.x_stride)[u];
      }
    } else {
      const int groups = static_cast<int>(a.hidden / kFp8Group);
      for (int f = warp; f < mine * groups; f += kEpWarps) {  // warp-uniform
        const int row = f / groups, g = f - row * groups;
        const int i = row * parts + part;
        const int64_t s = list_slot[i];
        if (s >= 0)
          castGroup(
              a, reinterpret_cast<const X*>(src + static_cast<int64_t>(list_token[i]) * a.x_stride),
              static_cast<unsigned char*>(a.send_x) + s * a.row_bytes, g, lane);
      }
    }
    hits += chunk;
    __syncthreads();  // the lists are refilled by the next chunk
  }
  if (part == 0 && threadIdx.x == 0) {
    const int64_t room = nonNegative(a.slots - before);
    a.send_counts[e] = hits < room ? hits : room;
  }
  if (first && threadIdx.x == 0) {
    int64_t dropped = 0;
    for (int i = 0; i < a.ranks; ++i) dropped += nonNegative(pairs_to[i] - a.slots);
    *a.dropped = dropped;
  }
}

// Block (l, part) serves local expert l: row j of expert_x[l] is received row j of l (sources
// in rank order), part j % parts copying it; part 0 zeroes the rows the previous dispatch left.
template <typename V>
__global__ void __launch_bounds__(kEpThreads) unpackKernel(const UnpackArgs a) {
  extern __shared__ int64_t per_source[];  // [3][W]: rows, first slot, first row of expert_x
  int64_t* rows = per_source;
  int64_t* slot0 = per_source + a.ranks;
  int64_t* row0 = per_source + 2 * a.ranks;
  __shared__ int64_t total_rows;
  const int l = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const int L = a.local_experts;
  // Read before the barriers below: thread 0 of part 0 moves it on at the end, and a warp
  // still to read it then would skip its share of the zeroing.
  const int64_t zero_to = part == 0 ? a.zero_from[l] : 0;
  // slot0[s]: source s's rows for the experts below l, summed by the whole block at once
  for (int s = threadIdx.x; s < a.ranks; s += blockDim.x) slot0[s] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < a.ranks * l; i += blockDim.x) {
    const int s = i / l;
    const int64_t v = a.recv_counts[static_cast<int64_t>(s) * L + (i - s * l)];
    if (v > 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(&slot0[s]),
                static_cast<unsigned long long>(v));
  }
  __syncthreads();
  for (int s = threadIdx.x; s < a.ranks; s += blockDim.x) {
    const int64_t first = slot0[s] < a.slots ? slot0[s] : a.slots;
    const int64_t n = nonNegative(a.recv_counts[static_cast<int64_t>(s) * L + l]);
    rows[s] = n < a.slots - first ? n : a.slots - first;  // a bad count cannot leave the buffer
    slot0[s] = first;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int s = 0; s < a.ranks; ++s) {
      row0[s] = acc;
      acc += rows[s];
    }
    total_rows = acc;
  }
  __syncthreads();
  const int64_t count = total_rows < a.max_slots ? total_rows : a.max_slots;
  const uint32_t src_units = static_cast<uint32_t>(a.row_bytes / sizeof(V));
  const uint32_t units = static_cast<uint32_t>(a.head_bytes / sizeof(V));
  const uint32_t tail_words =
      a.tail_out != nullptr ? static_cast<uint32_t>((a.row_bytes - a.head_bytes) / 4) : 0u;
  const auto* src = static_cast<const V*>(a.recv_x);
  auto* dst = static_cast<V*>(a.expert_x) + static_cast<int64_t>(l) * a.max_slots * units;
  int32_t* tail = a.tail_out + static_cast<int64_t>(l) * tail_words * a.max_slots;
  for (int s = 0; s < a.ranks; ++s) {
    const int64_t n =
        nonNegative((row0[s] + rows[s] < count ? row0[s] + rows[s] : count) - row0[s]);
    const int64_t skip = ((part - row0[s]) % parts + parts) % parts;  // first r of this part
    const int64_t mine = n > skip ? (n - skip + parts - 1) / parts : 0;
    const int64_t first_slot = static_cast<int64_t>(s) * a.slots + slot0[s];
    const V* from = src + first_slot * src_units;
    V* to = dst + row0[s] * units;
    for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(mine) * units; f += blockDim.x) {
      const uint32_t k = f / units, u = f - k * units;
      const int64_t r = skip + static_cast<int64_t>(k) * parts;
      to[r * units + u] = from[r * src_units + u];
    }
    for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(mine) * tail_words; f += blockDim.x) {
      const uint32_t k = f / tail_words, w = f - k * tail_words;
      const int64_t r = skip + static_cast<int64_t>(k) * parts;
      const auto* words = reinterpret_cast<const int32_t*>(
          static_cast<const char*>(a.recv_x) + (first_slot + r) * a.row_bytes + a.head_bytes);
      tail[w * a.max_slots + row0[s] + r] = words[w];
    }
    int64_t* back = a.back_index + static_cast<int64_t>(s) * a.slots + slot0[s];
    for (int64_t r = part + static_cast<int64_t>(threadIdx.x) * parts; r < rows[s];
         r += static_cast<int64_t>(blockDim.x) * parts) {
      const int64_t j = row0[s] + r;
      back[r] = j < a.max_slots ? static_cast<int64_t>(l) * a.max_slots + j : 0;
    }
  }
  if (part != 0) return;
  const int64_t stale = zero_to > count ? zero_to - count : 0;
  for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(stale) * units; f += blockDim.x)
    dst[count * units + f] = V{};
  for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(stale) * tail_words; f += blockDim.x) {
    const uint32_t k = f / tail_words, w = f - k * tail_words;
    tail[w * a.max_slots + count + k] = 0;
  }
  if (threadIdx.x == 0) {
    a.expert_counts[l] = static_cast<int32_t>(count);
    a.zero_from[l] = static_cast<int32_t>(count);
  }
}

// Block (s, part) packs the rows going back to source s: its filled slots, r % parts == part.
template <typename V>
__global__ void __launch_bounds__(kEpThreads) combinePackKernel(const CombinePackArgs a) {
  __shared__ unsigned long long sum;
  const int s = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  if (threadIdx.x == 0) sum = 0;
  __syncthreads();
  const int64_t* counts = a.filled + static_cast<int64_t>(s) * a.per_source;
  for (int i = threadIdx.x; i < a.per_source; i += blockDim.x)
    if (counts[i] > 0) atomicAdd(&sum, static_cast<unsigned long long>(counts[i]));
  __syncthreads();
  const int64_t n = static_cast<int64_t>(sum);
  const int64_t filled = n < a.slots ? n : a.slots;
  const int64_t mine = filled > part ? (filled - part + parts - 1) / parts : 0;
  const uint32_t units = static_cast<uint32_t>(a.row_bytes / sizeof(V));
  const auto* src = static_cast<const V*>(a.expert_y);
  auto* dst = static_cast<V*>(a.comb_send);
  for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(mine) * units; f += blockDim.x) {
    const uint32_t k = f / units, u = f - k * units;
    const int64_t slot = static_cast<int64_t>(s) * a.slots + part + static_cast<int64_t>(k) * parts;
    dst[slot * units + u] = src[a.back_index[slot] * units + u];
  }
}

// Block (t, part): token t's channels part*blockDim + ..., strided by parts*blockDim.
template <typename In, typename Out>
__global__ void __launch_bounds__(kEpThreads) combineReduceKernel(const CombineReduceArgs a) {
  extern __shared__ int64_t pair_rows[];  // [K] slots, then [K] float weights
  auto* weight = reinterpret_cast<float*>(pair_rows + a.topk);
  const int t = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  for (int k = threadIdx.x; k < a.topk; k += blockDim.x) {
    const int64_t i = static_cast<int64_t>(t) * a.topk + k;
    const int64_t slot = a.pair_slot[i];
    pair_rows[k] = slot >= 0 && slot < a.no_slot ? slot : -1;
    weight[k] = a.weights[i];
  }
  __syncthreads();
  const auto* in = static_cast<const In*>(a.comb_recv);
  auto* out = static_cast<Out*>(a.out) + static_cast<int64_t>(t) * a.hidden;
  for (int64_t h = static_cast<int64_t>(part) * blockDim.x + threadIdx.x; h < a.hidden;
       h += static_cast<int64_t>(parts) * blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < a.topk; ++k)
      if (pair_rows[k] >= 0) acc += weight[k] * toFloat(in[pair_rows[k] * a.hidden + h]);
    out[h] = fromFloat<Out>(acc);
  }
}

// The widest copy unit (16, 8, 4, 2 or 1 bytes) that divides the row size and every address and
// stride of the rows moved.
int unitBytes(int64_t row_bytes, std::initializer_list<uintptr_t> addresses) {
  for (int v : {16, 8, 4, 2}) {
    bool ok = row_bytes % v == 0;
    for (uintptr_t addr : addresses) ok = ok && addr % static_cast<uintptr_t>(v) == 0;
    if (ok) return v;
  }
  return 1;
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
