// streamingCopy (non-temporal stores where the CPU has them, with and without a source
// prefetch): byte-exact against memcpy for random bytes over sizes around the 16-byte vector and at
// aligned and unaligned addresses, never touching a byte outside the destination range; and
// ShmTransport::writeForDevice lands the same bytes as write, before a signal that follows it.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/transport/shm_transport.hpp"
#include "core/transport/streaming_copy.hpp"

int main() {
  std::mt19937_64 rng(20261130);
  std::vector<unsigned char> src(1 << 20), dst(1 << 20), want(1 << 20);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  const size_t sizes[] = {
      0, 1, 7, 15, 16, 17, 31, 32, 48, 63, 64, 100, 4096, 4099, 65536, 131072, (1 << 20) - 64};
  for (size_t bytes : sizes) {
    for (size_t src_off : {0, 16, 8, 3}) {
      for (size_t dst_off : {0, 32, 8, 5}) {
        if (src_off + bytes > src.size() || dst_off + bytes + 64 > dst.size()) continue;
        const unsigned char canary = static_cast<unsigned char>(rng());
        std::memset(dst.data(), canary, dst.size());
        // Offsets from 16-aligned bases, so that 0/16/32 are aligned and 3/5/8 are not.
        auto* d = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(dst.data()) + 15) &
                                                   ~uintptr_t(15));
        auto* s = reinterpret_cast<const unsigned char*>(
            (reinterpret_cast<uintptr_t>(src.data()) + 15) & ~uintptr_t(15));
        const size_t d_shift = static_cast<size_t>(d - dst.data());
        const size_t s_shift = static_cast<size_t>(s - src.data());
        if (d_shift + dst_off + bytes + 64 > dst.size() || s_shift + src_off + bytes > src.size())
          continue;
        std::memcpy(want.data(), dst.data(), want.size());
        std::memcpy(want.data() + d_shift + dst_off, s + src_off, bytes);
        resident::streamingCopy(d + dst_off, s + src_off, bytes,
                                static_cast<size_t>(rng() % 4) * 1024);
        CHECK(std::memcmp(dst.data(), want.data(), dst.size()) == 0);
      }
    }
  }
  {
    // Through the shm transport: two "peer" inboxes in this process.
    std::vector<unsigned char> inbox0(8192, 0), inbox1(8192, 0);
    resident::ShmTransport t({inbox0.data(), inbox1.data()});
    alignas(16) unsigned char lines[4096];
    for (auto& b : lines) b = static_cast<unsigned char>(rng());
    t.writeForDevice(1, 64, lines, sizeof lines, /*prefetch=*/1024);
    t.signal(1, 0, 0x1234);
    CHECK(std::memcmp(inbox1.data() + 64, lines, sizeof lines) == 0);
    uint64_t flag;
    std::memcpy(&flag, inbox1.data(), 8);
    CHECK(flag == 0x1234);
    // A short write (below the streaming threshold: a plain copy) to the other inbox.
    t.writeForDevice(0, 4000, lines + 16, 16, /*prefetch=*/0);
    CHECK(std::memcmp(inbox0.data() + 4000, lines + 16, 16) == 0);
    for (size_t i = 0; i < inbox0.size(); ++i)
      if (i < 4000 || i >= 4016) CHECK(inbox0[i] == 0);
  }
  std::puts("ok");
  return 0;
}
