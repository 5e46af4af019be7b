// The proxy's check of LL lines that a GPU wrote into mapped host memory without a fence (an
// unfenced kLines trigger): how many of a range's leading 16-byte lines carry the flag. The
// lines were written by PCIe writes, so each cache line is a miss; one core reading them in
// order is bound by its outstanding misses (~7 GB/s on the H200 host, in the proxy's
// timeline: RESIDENT_GPU_PROXY_TRACE, `bash scripts/device_run.sh proxy-trace`), so the check asks
// for the lines `prefetch` bytes ahead of the one it compares. The fused form (copyLandedLlLines)
// also copies each line it checked.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/transport/streaming_copy.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace resident {

inline uint64_t landedLlLines(const unsigned char* lines, uint64_t bytes, uint32_t flag,
                              uint64_t prefetch) {
  prefetchStart(lines, bytes, prefetch);
  uint64_t off = 0;
  for (; off + 16 <= bytes; off += 16) {
    prefetchNext(lines, off, bytes, prefetch);
    const auto* words = reinterpret_cast<const uint32_t*>(lines + off);
    if (__atomic_load_n(words + 1, __ATOMIC_RELAXED) != flag ||
        __atomic_load_n(words + 3, __ATOMIC_RELAXED) != flag)
      break;
  }
  return off;
}

// The check and the copy in one pass: copies the leading lines of [src, src + bytes) that carry
// `flag` to `dst` and returns their bytes. Each line is loaded once (16 bytes; each 8-byte half,
// data word and flag word, is read whole, as the GPU wrote it), checked, and stored with a
// non-temporal store where the CPU has them, so the lines are read from memory once instead of
// once by the check and again by the copy. No fence: the caller fences (streamingFence) before
// anything that must be seen after these lines. `dst` and `src` 16-byte aligned.
inline uint64_t copyLandedLlLines(unsigned char* dst, const unsigned char* src, uint64_t bytes,
                                  uint32_t flag, uint64_t prefetch) {
  prefetchStart(src, bytes, prefetch);
  uint64_t off = 0;
#if defined(__SSE2__)
  const __m128i want = _mm_set1_epi32(static_cast<int>(flag));
  for (; off + 16 <= bytes; off += 16) {
    prefetchNext(src, off, bytes, prefetch);
    const __m128i line = _mm_load_si128(reinterpret_cast<const __m128i*>(src + off));
    // Words 1 and 3 (bytes 4-7 and 12-15) are the flags.
    if ((_mm_movemask_epi8(_mm_cmpeq_epi32(line, want)) & 0xf0f0) != 0xf0f0) break;
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + off), line);
  }
#else
  for (; off + 16 <= bytes; off += 16) {
    uint64_t half[2];
    half[0] = __atomic_load_n(reinterpret_cast<const uint64_t*>(src + off), __ATOMIC_RELAXED);
    half[1] = __atomic_load_n(reinterpret_cast<const uint64_t*>(src + off + 8), __ATOMIC_RELAXED);
    if (static_cast<uint32_t>(half[0] >> 32) != flag ||
        static_cast<uint32_t>(half[1] >> 32) != flag)
      break;
    std::memcpy(dst + off, half, 16);
  }
#endif
  return off;
}

}  // namespace resident
