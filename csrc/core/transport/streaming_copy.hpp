// A copy whose stores bypass this CPU's caches (non-temporal), for bytes that a device reads
// next over PCIe: a GPU read of a line still dirty in a CPU cache is served by a snoop, slower
// than one from memory (benchmarks/probes/proxy_copy_probe.cu). Where the CPU has no such stores
// (not x86-64), a plain memcpy.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace resident {

// Software prefetch for one core reading, in order, memory a device wrote over PCIe (every
// cache line a miss; the core is bound by its misses in flight): prefetchStart before the loop
// asks for the first `distance` bytes, prefetchNext at each offset asks, once per cache line,
// for the line `distance` bytes ahead. distance 0: nothing.
inline void prefetchStart(const unsigned char* p, uint64_t bytes, uint64_t distance) {
  for (uint64_t ahead = 0; ahead < distance && ahead < bytes; ahead += 64)
    __builtin_prefetch(p + ahead);
}
inline void prefetchNext(const unsigned char* p, uint64_t off, uint64_t bytes, uint64_t distance) {
  if ((off & 63) == 0 && distance != 0 && off + distance < bytes)
    __builtin_prefetch(p + off + distance);
}

// Every store is visible to other agents when it returns (sfence), so a release store after
// it is ordered after the whole copy, as after memcpy. `prefetch`: how far ahead (bytes) the
// source is asked for, for a source that is not in this CPU's caches (a GPU wrote it over
// PCIe); 0: not at all.
inline void streamingCopy(void* dst, const void* src, size_t bytes, size_t prefetch = 0) {
#if defined(__SSE2__)
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (((d | s) & 15u) == 0 && bytes >= 16) {
    const size_t vectors = bytes / 16;
    auto* out = reinterpret_cast<__m128i*>(dst);
    const auto* in = reinterpret_cast<const __m128i*>(src);
    const auto* from = static_cast<const unsigned char*>(src);
    prefetchStart(from, bytes, prefetch);
    for (size_t i = 0; i < vectors; ++i) {
      prefetchNext(from, i * 16, bytes, prefetch);
      _mm_stream_si128(out + i, _mm_load_si128(in + i));
    }
    std::memcpy(out + vectors, in + vectors, bytes - vectors * 16);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Orders the non-temporal stores issued before it (streamingCopy's own, and those of a caller
// that stores without a fence, copyLandedLlLines) before every later store.
inline void streamingFence() {
#if defined(__SSE2__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_release);
#endif
}

}  // namespace resident
