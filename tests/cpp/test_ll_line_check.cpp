// landedLlLines (the proxy's check of unfenced LL lines): for random ranges whose lines carry the
// flag up to a random point (the rest: an older flag in one or both flag words, or random
// bytes), it returns exactly the bytes of the leading lines that carry it, with and without
// prefetching, at any prefetch distance, never reading past the range (the words after it
// carry the flag: a check that ran past would count them). copyLandedLlLines, and
// ShmTransport::writeLandedLines (aligned and not) through it, the base Transport's check then
// write, and RoutedTransport to either, return the same count and copy exactly those lines,
// leaving every other destination byte as it was; only shm (and routes to it) fuse.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/transport/ll_line_check.hpp"
#include "core/transport/routed_transport.hpp"
#include "core/transport/shm_transport.hpp"
#include "core/transport/streaming_copy.hpp"

namespace {
// A transport with only the required methods: its writeLandedLines is the base one (the check,
// then writeForDevice, here a memcpy), and it does not fuse.
class PlainTransport : public resident::Transport {
 public:
  explicit PlainTransport(unsigned char* inbox) : inbox_(inbox) {}
  const char* name() const override { return "plain"; }
  void write(int, size_t offset, const void* src, size_t bytes) override {
    std::memcpy(inbox_ + offset, src, bytes);
  }
  void signal(int, size_t, uint64_t) override {}
  bool directCapable(int) const override { return false; }

 private:
  unsigned char* inbox_;
};
}  // namespace

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
    // The fused check and copy: the same count, exactly those bytes copied.
    std::vector<unsigned char> dst(buf.size() * 4 + 64);
    const unsigned char canary = static_cast<unsigned char>(rng());
    std::memset(dst.data(), canary, dst.size());
    auto* d = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(dst.data()) + 15) &
                                               ~uintptr_t(15));
    resident::ShmTransport shm({d, d});
    PlainTransport plain(d);
    resident::RoutedTransport routed({&plain, &shm, nullptr}, {});
    CHECK(shm.fusesLineCheck(1) && routed.fusesLineCheck(1));
    CHECK(!plain.fusesLineCheck(0) && !routed.fusesLineCheck(0) && !routed.fusesLineCheck(2));
    uint64_t copied = 0;
    switch (rng() % 4) {
      case 0:
        copied = resident::copyLandedLlLines(d, bytes, lines * 16, flag, prefetch);
        break;
      case 1:
        copied = shm.writeLandedLines(1, 0, bytes, lines * 16, flag, prefetch);
        break;
      case 2:
        copied = routed.writeLandedLines(1, 0, bytes, lines * 16, flag, prefetch);
        break;
      default:
        copied = routed.writeLandedLines(0, 0, bytes, lines * 16, flag, prefetch);
        break;
    }
    routed.flushDeviceWrites();
    CHECK(copied == landed * 16);
    CHECK(std::memcmp(d, bytes, copied) == 0);
    for (size_t i = 0; i < dst.size(); ++i) {
      const size_t at = static_cast<size_t>(dst.data() + i - d);
      if (dst.data() + i < d || at >= copied) CHECK(dst[i] == canary);
    }
    // A destination off the 16-byte grid takes the transport's check-then-write path.
    if (landed > 0) {
      std::memset(dst.data(), canary, dst.size());
      CHECK(resident::ShmTransport({d + 4, d + 4})
                .writeLandedLines(0, 0, bytes, lines * 16, flag, prefetch) == landed * 16);
      CHECK(std::memcmp(d + 4, bytes, landed * 16) == 0);
      CHECK(d[3] == canary && d[4 + landed * 16] == canary);
    }
    // A tail shorter than a line is never counted.
    if (landed == lines)
      CHECK(resident::landedLlLines(bytes, lines * 16 + 8, flag, prefetch) == lines * 16);
  }
  std::puts("test_ll_line_check: ok");
  return 0;
}
