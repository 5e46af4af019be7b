// landedLlLines (the proxy's check of unfenced LL lines): for random ranges whose lines carry the
// flag up to a random point (the rest: an older flag in one or both flag words, or random
// bytes), it returns exactly the bytes of the leading lines that carry it, with and without
// prefetching, at any prefetch distance, never reading past the range (checked by a guard page
// region filled with the flag after the range: a check that ran past would count it).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/ll_line_check.hpp"

int main() {
  std::mt19937_64 rng(20261130);
  std::vector<uint32_t> buf((64 << 10) / 4 + 1024);
  for (int iter = 0; iter < 3000; ++iter) {
    const uint32_t flag = static_cast<uint32_t>(rng()) | 1u;
    const uint64_t lines = rng() % 2049;  // up to 32 KiB of lines
    const uint64_t landed = lines ? rng() % (lines + 1) : 0;
    // Every word carries the flag (past the range too); then the lines from `landed` on get
    // something else in one or both flag words.
    for (size_t w = 0; w < buf.size(); ++w) buf[w] = (w & 1) ? flag : static_cast<uint32_t>(rng());
    for (uint64_t l = landed; l < lines; ++l) {
      const int how = static_cast<int>(rng() % 3);
      if (how != 1) buf[4 * l + 1] = flag - 2;                      // an older generation
      if (how != 0) buf[4 * l + 3] = static_cast<uint32_t>(rng());  // a torn or stale half
      if (buf[4 * l + 1] == flag && buf[4 * l + 3] == flag) buf[4 * l + 3] = flag + 1;
    }
    const auto* bytes = reinterpret_cast<const unsigned char*>(buf.data());
    const uint64_t prefetch = (rng() % 2) ? 0 : 64u << (rng() % 6);
    CHECK(resident::landedLlLines(bytes, lines * 16, flag, prefetch) == landed * 16);
    // A tail shorter than a line is never counted.
    if (landed == lines)
      CHECK(resident::landedLlLines(bytes, lines * 16 + 8, flag, prefetch) == lines * 16);
  }
  std::puts("test_ll_line_check: ok");
  return 0;
}
