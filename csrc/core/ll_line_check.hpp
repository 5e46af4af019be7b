// The proxy's check of LL lines that a GPU wrote into mapped host memory without a fence (an
// unfenced kLines trigger): how many of a range's leading 16-byte lines carry the flag. The
// lines were written by PCIe writes, so each cache line is a miss; one core reading them in
// order is bound by its outstanding misses (~7 GB/s on the H200 host, session 26's proxy
// trace), so the check asks for the lines `prefetch` bytes ahead of the one it compares.
#pragma once

#include <cstdint>

namespace resident {

inline uint64_t landedLlLines(const unsigned char* lines, uint64_t bytes, uint32_t flag,
                              uint64_t prefetch) {
  constexpr uint64_t kCacheLine = 64;
  for (uint64_t ahead = 0; ahead < prefetch && ahead < bytes; ahead += kCacheLine)
    __builtin_prefetch(lines + ahead);
  uint64_t off = 0;
  for (; off + 16 <= bytes; off += 16) {
    if ((off & (kCacheLine - 1)) == 0 && prefetch != 0 && off + prefetch < bytes)
      __builtin_prefetch(lines + off + prefetch);
    const auto* words = reinterpret_cast<const uint32_t*>(lines + off);
    if (__atomic_load_n(words + 1, __ATOMIC_RELAXED) != flag ||
        __atomic_load_n(words + 3, __ATOMIC_RELAXED) != flag)
      break;
  }
  return off;
}

}  // namespace resident
