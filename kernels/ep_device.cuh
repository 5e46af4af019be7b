// The device work of EP dispatch/combine (ep_args.hpp), one item of each step at a time: the
// routing and packing of dispatch, the receiver's unpacking into expert-major rows, combine's
// packing and its weighted reduction. ep_kernels.cu runs each step as a kernel of its own (a
// block per item and part); splits_kernel.cu runs them before and after the exchange in one
// kernel (ep::Phase), each block taking items in turn.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "ep_args.hpp"

namespace resident {
namespace ep {

constexpr int kEpThreads = 256;
constexpr int kEpWarps = kEpThreads / 32;

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

// Shared memory of routeItem; pairs_to: [W] (item (0, 0) only).
struct RouteScratch {
  int32_t* pairs_to;
  int32_t warp_hits[kEpWarps];
  int32_t list_token[kEpThreads];
  int64_t list_slot[kEpThreads];
};

// Item (e, part) of `parts` serves expert e: pass 1 counts the pairs of e's peer routed to its
// earlier experts (where e's slots start), pass 2 ranks e's pairs in token order, writes their
// slots and copies (X void) or casts (X the activation type, RouteArgs::cast) the placed rows,
// entry i of each chunk by part i % parts. Item (0, 0) also writes the slots of unrouted pairs
// and the dropped count. Block-uniform; blockDim.x == kEpThreads.
template <typename V, typename X>
__device__ __forceinline__ void routeItem(const RouteArgs& a, int e, int part, int parts,
                                          RouteScratch& sh) {
  const int L = a.experts / a.ranks, d = e / L;
  const int64_t P = static_cast<int64_t>(a.tokens) * a.topk;
  const int64_t no_slot = static_cast<int64_t>(a.ranks) * a.slots;
  const bool first = e == 0 && part == 0;
  if (first)
    for (int i = threadIdx.x; i < a.ranks; i += blockDim.x) sh.pairs_to[i] = 0;
  __syncthreads();

  int64_t before = 0;  // pairs of peer d for experts below e: e's first slot
  for (int64_t base = 0; base < P; base += blockDim.x) {
    const int64_t p = base + threadIdx.x;
    const int32_t v = p < P ? expertAt(a, p) : -1;
    before += __syncthreads_count(v >= 0 && v < e && v / L == d);
    if (first && v >= 0) atomicAdd(&sh.pairs_to[v / L], 1);
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
    if (lane == 0) sh.warp_hits[warp] = __popc(ballot);
    __syncthreads();
    int below = 0, chunk = 0;
    for (int w = 0; w < kEpWarps; ++w) {
      below += w < warp ? sh.warp_hits[w] : 0;
      chunk += sh.warp_hits[w];
    }
    const int index = below + __popc(ballot & ((1u << lane) - 1u));
    const int64_t pos = before + hits + index;
    const int64_t slot = pos < a.slots ? d * a.slots + pos : -1;
    if (part == 0 && p < P && (hit || (v < 0 && e == 0)))
      a.pair_slot[p] = hit && slot >= 0 ? slot : no_slot;
    if (hit) {
      sh.list_token[index] = static_cast<int32_t>(p / a.topk);
      sh.list_slot[index] = slot;
    }
    __syncthreads();
    const int mine = chunk > part ? (chunk - part + parts - 1) / parts : 0;
    if constexpr (std::is_void_v<X>) {
      for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(mine) * units; f += blockDim.x) {
        const uint32_t row = f / units, u = f - row * units;
        const int i = static_cast<int>(row) * parts + part;
        const int64_t s = sh.list_slot[i];
        if (s >= 0)
          dst[s * units + u] = reinterpret_cast<const V*>(
              src + static_cast<int64_t>(sh.list_token[i]) * a.x_stride)[u];
      }
    } else {
      const int groups = static_cast<int>(a.hidden / kFp8Group);
      for (int f = warp; f < mine * groups; f += kEpWarps) {  // warp-uniform
        const int row = f / groups, g = f - row * groups;
        const int i = row * parts + part;
        const int64_t s = sh.list_slot[i];
        if (s >= 0)
          castGroup(
              a,
              reinterpret_cast<const X*>(src + static_cast<int64_t>(sh.list_token[i]) * a.x_stride),
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
    for (int i = 0; i < a.ranks; ++i) dropped += nonNegative(sh.pairs_to[i] - a.slots);
    *a.dropped = dropped;
  }
}

// Shared memory of routeBlock.
struct RouteBlockScratch {
  int32_t next[kPhaseMaxExperts];  // pairs per expert, then the next free position in its slots
  int32_t list_token[kEpThreads];  // rows this block copies from a chunk of pairs
  int64_t list_slot[kEpThreads];
  int32_t listed;
  unsigned long long dropped;
};

// Dispatch's routing and packing by every block of a grid at once (the step inside the
// exchange's kernel): each block routes all pairs itself, with the result of routeItem (a
// pair's slot: the pairs of its peer's earlier experts, then its rank among its expert's pairs
// in pair order), and copies or casts the rows of the pairs p with p % gridDim.x == blockIdx.x;
// block 0 writes the counts and the dropped count. A block per expert, as routeItem's grid,
// would leave a grid of a few blocks dozens of experts each, every one a pass over all pairs.
// Needs a.experts <= kPhaseMaxExperts. Block-uniform; blockDim.x == kEpThreads.
template <typename V, typename X>
__device__ __forceinline__ void routeBlock(const RouteArgs& a, RouteBlockScratch& sh) {
  constexpr int kPerThread = kPhaseMaxExperts / kEpThreads;
  const int E = a.experts, L = E / a.ranks;
  const int64_t P = static_cast<int64_t>(a.tokens) * a.topk;
  const int64_t no_slot = static_cast<int64_t>(a.ranks) * a.slots;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) sh.next[e] = 0;
  if (threadIdx.x == 0) {
    sh.dropped = 0;
    sh.listed = 0;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < P; p += blockDim.x) {
    const int32_t v = expertAt(a, p);
    if (v >= 0) atomicAdd(&sh.next[v], 1);
  }
  __syncthreads();
  // Each expert's first position: the pairs of its peer's earlier experts.
  int32_t first[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kEpThreads;
    first[i] = 0;
    if (e < E)
      for (int f = e / L * L; f < e; ++f) first[i] += sh.next[f];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kEpThreads;
    if (e >= E) continue;
    const int32_t pairs = sh.next[e];
    if (blockIdx.x == 0) {
      const int64_t room = nonNegative(a.slots - first[i]);
      a.send_counts[e] = pairs < room ? pairs : room;
    }
    if (e % L == L - 1)  // the peer's last expert: its pairs past the slots are dropped
      atomicAdd(&sh.dropped, static_cast<unsigned long long>(
                                 nonNegative(static_cast<int64_t>(first[i]) + pairs - a.slots)));
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = threadIdx.x + i * kEpThreads;
    if (e < E) sh.next[e] = first[i];
  }
  __syncthreads();

  const uint32_t units = static_cast<uint32_t>(a.row_bytes / sizeof(V));
  const auto* src = static_cast<const char*>(a.x);
  for (int64_t base = 0; base < P; base += blockDim.x) {
    const int64_t p = base + threadIdx.x;
    const int32_t v = p < P ? expertAt(a, p) : -1;
    // The pair's position: its rank among the chunk's pairs of its expert (the warps in turn,
    // each taking its lanes' share of the expert's positions), after the earlier chunks'.
    const unsigned same = __match_any_sync(0xffffffffu, v);
    const int leader = __ffs(same) - 1;
    int32_t taken = 0;
    for (int w = 0; w < kEpWarps; ++w) {
      if (warp == w && v >= 0 && lane == leader) {
        taken = sh.next[v];
        sh.next[v] = taken + __popc(same);
      }
      __syncthreads();
    }
    const int64_t pos =
        __shfl_sync(0xffffffffu, taken, leader) + __popc(same & ((1u << lane) - 1u));
    const int64_t slot = v >= 0 && pos < a.slots ? static_cast<int64_t>(v / L) * a.slots + pos : -1;
    if (p < P && p % gridDim.x == blockIdx.x) {
      a.pair_slot[p] = slot >= 0 ? slot : no_slot;
      if (slot >= 0) {
        const int i = atomicAdd(&sh.listed, 1);
        sh.list_token[i] = static_cast<int32_t>(p / a.topk);
        sh.list_slot[i] = slot;
      }
    }
    __syncthreads();
    const int listed = sh.listed;
    if constexpr (std::is_void_v<X>) {
      auto* dst = static_cast<V*>(a.send_x);
      for (uint32_t f = threadIdx.x; f < static_cast<uint32_t>(listed) * units; f += blockDim.x) {
        const uint32_t row = f / units, u = f - row * units;
        dst[sh.list_slot[row] * units + u] = reinterpret_cast<const V*>(
            src + static_cast<int64_t>(sh.list_token[row]) * a.x_stride)[u];
      }
    } else {
      const int groups = static_cast<int>(a.hidden / kFp8Group);
      for (int f = warp; f < listed * groups; f += kEpWarps) {  // warp-uniform
        const int row = f / groups, g = f - row * groups;
        castGroup(
            a,
            reinterpret_cast<const X*>(src + static_cast<int64_t>(sh.list_token[row]) * a.x_stride),
            static_cast<unsigned char*>(a.send_x) + sh.list_slot[row] * a.row_bytes, g, lane);
      }
    }
    __syncthreads();  // the list is refilled by the next chunk
    if (threadIdx.x == 0) sh.listed = 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.dropped = static_cast<int64_t>(sh.dropped);
  __syncthreads();
}

// Shared memory of unpackItem; per_source: [3][W] (rows, first slot, first row of expert_x).
struct UnpackScratch {
  int64_t* per_source;
  int64_t total_rows;
};

// Item (l, part) of `parts` serves local expert l: row j of expert_x[l] is received row j of l
// (sources in rank order), part j % parts copying it; part 0 zeroes the rows the previous
// dispatch left. Block-uniform.
template <typename V>
__device__ __forceinline__ void unpackItem(const UnpackArgs& a, int l, int part, int parts,
                                           UnpackScratch& sh) {
  int64_t* rows = sh.per_source;
  int64_t* slot0 = sh.per_source + a.ranks;
  int64_t* row0 = sh.per_source + 2 * a.ranks;
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
    sh.total_rows = acc;
  }
  __syncthreads();
  const int64_t count = sh.total_rows < a.max_slots ? sh.total_rows : a.max_slots;
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

// Item (s, part) of `parts` packs the rows going back to source s: its filled slots,
// r % parts == part. `sum`: a shared word. Block-uniform.
template <typename V>
__device__ __forceinline__ void combinePackItem(const CombinePackArgs& a, int s, int part,
                                                int parts, unsigned long long& sum) {
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

// Item (t, part) of `parts`: token t's channels part*blockDim + ..., strided by parts*blockDim.
// pair_rows: [K] shared slots; weight: [K] shared weights. Block-uniform.
template <typename In, typename Out>
__device__ __forceinline__ void combineReduceItem(const CombineReduceArgs& a, int t, int part,
                                                  int parts, int64_t* pair_rows, float* weight) {
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

}  // namespace ep
}  // namespace resident
