// Arguments and host entry points of the EP dispatch/combine kernels (ep_kernels.cu), used by
// resident_pg.moe on CUDA tensors: the routing and packing of dispatch, the receiver's unpacking
// into expert-major rows, and combine's packing and weighted reduction, each one kernel that
// touches only the rows in use. Plain C++ (no CUDA types): the bindings include it in every
// build; without nvcc, csrc/c10d/no_cuda.cpp stands in for the entry points and raises.
//
// Layout (resident_pg/moe.py): W ranks, L = E / W local experts per rank, C slots per peer.
// A send buffer is W*C rows (peer d's slots d*C .. d*C+C-1), filled expert-major from slot 0;
// expert_x is [L, max_slots] rows. Rows are opaque bytes (row_bytes each), so the same kernels
// move activations of any dtype and FP8 rows with their scales.
#pragma once

#include <cstdint>
#include <string>

namespace resident {
namespace ep {

enum class Dtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// How dispatch's route kernel writes a placed row: its bytes as they are, or the FP8 row of an
// activation row (resident_pg/ep_fp8.py's format: `hidden` float8_e4m3fn values, then one
// scale per 128 channels, float32 or a UE8M0 byte), cast as DeepEP's low-latency dispatch does.
enum class RowCast : int32_t { kCopy = 0, kFp8 = 1, kFp8Ue8m0 = 2 };

// Dispatch, sender: where each (token, k) pair goes and the rows copied there.
struct RouteArgs {
  const void* topk_idx;  // [tokens, topk], int32 or int64; -1 or out of range: not routed
  int32_t index_bytes;   // 4 or 8
  int32_t tokens, topk, experts, ranks;
  int64_t slots;  // C
  const void* x;  // token rows, x_stride bytes apart
  int64_t x_stride;
  void* send_x;  // [W*C] rows
  int64_t row_bytes;
  int64_t* send_counts;  // [W, L] out: pairs placed per (peer, local expert)
  int64_t* pair_slot;    // [tokens*topk] out: d*C + slot, or W*C for a pair not placed
  int64_t* dropped;      // [1] out: routed pairs that did not fit in C slots
  // kCopy: rows of row_bytes copied. FP8: x holds `hidden` values of x_dtype per row (hidden a
  // multiple of 128; row_bytes the FP8 row's), each placed row cast; round_scale: power-of-two
  // scales (always with kFp8Ue8m0).
  RowCast cast;
  Dtype x_dtype;
  int32_t round_scale;
  int64_t hidden;
};

// Dispatch, receiver: expert_x[l, j] <- the j-th received row for local expert l (source rank
// order, then the sender's slot order), rows past the count zero again. With tail_out, a row is
// split: its first head_bytes go to expert_x, the rest (4-byte words) to tail_out, column-major
// per expert (DeepEP's layout of FP8 scales).
struct UnpackArgs {
  const int64_t* recv_counts;  // [W, L] rows per (source, local expert)
  int32_t ranks, local_experts;
  int64_t slots, max_slots;
  const void* recv_x;  // [W*C] rows of row_bytes
  void* expert_x;      // [L, max_slots] rows of head_bytes
  int64_t row_bytes, head_bytes;
  int32_t* tail_out;       // null (head_bytes == row_bytes), or [L, tail words, max_slots]
  int32_t* expert_counts;  // [L] out
  // [L] rows of expert_x known zero from this row on (the kernel's own state: it zeroes only
  // the rows the previous dispatch filled and this one does not)
  int32_t* zero_from;
  int64_t* back_index;  // [W*C] out for the filled slots: the expert_x row each came from
};

// Combine, expert side: comb_send[slot] <- expert_y[back_index[slot]] for the filled slots.
struct CombinePackArgs {
  // [W][per_source] the dispatch's counts per source: a source's filled slots are the sum of
  // its entries (negative ones count as 0), clamped to C
  const int64_t* filled;
  int32_t ranks;
  int32_t per_source;
  int64_t slots;
  const int64_t* back_index;
  const void* expert_y;  // [L * max_slots] rows
  void* comb_send;       // [W*C] rows
  int64_t row_bytes;
};

// Combine, token side: out[t] = sum_k weights[t, k] * comb_recv[pair_slot[t*K + k]] in float32,
// rounded once; pairs whose slot is W*C (not placed) add nothing.
struct CombineReduceArgs {
  const void* comb_recv;  // [W*C + 1] rows of `hidden` values of in_dtype
  const int64_t* pair_slot;
  const float* weights;  // [tokens, topk], contiguous
  void* out;             // [tokens, hidden] of out_dtype, contiguous
  int32_t tokens, topk;
  int64_t hidden;
  int64_t no_slot;  // W*C
  Dtype in_dtype, out_dtype;
};

// True in a build with these kernels (false: built without nvcc; the launchers then fail).
bool kernelsBuilt();

// Loads every instantiation of the kernels now, "" or the CUDA error: before a group's first
// op (kernels/collective_launch.hpp says why a first launch must not load one).
std::string loadKernels();

// Each launches one kernel on `stream` (a cudaStream_t) and returns "" or the CUDA error.
std::string launchRoute(const RouteArgs& args, void* stream);
std::string launchUnpack(const UnpackArgs& args, void* stream);
std::string launchCombinePack(const CombinePackArgs& args, void* stream);
std::string launchCombineReduce(const CombineReduceArgs& args, void* stream);

}  // namespace ep
}  // namespace resident
