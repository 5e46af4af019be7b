// The one-round kernel cuts a message into parts and lines with its own 32-bit arithmetic
// (partBytes, bytesOfLine, linesOfPart in kernels/rounds_device.cuh); its lines must be the
// general kernel's round 0 (lineBytes, payloadLines, exchangedParts), or an op of one kernel
// after an op of the other on the same channel would read lines the other never wrote. Checked
// for every message size up to two chunks of a small chunk and for random sizes up to the
// default chunk, every part a round has and every thread of a block.
#include <cstdint>
#include <cstdio>
#include <random>

#include "../kernels/rounds_device.cuh"
#include "check.hpp"

namespace g = resident::gpu;

namespace {

// One message of `total` bytes: every part and line of round 0 both ways.
void checkMessage(uint64_t total, uint32_t chunk) {
  const uint32_t round0 = g::roundBytes(total, 0, chunk);
  const uint32_t parts = g::exchangedParts(total, 0, chunk);
  CHECK(parts == g::partsOf(round0));
  for (uint32_t j = 0; j < parts + 1; ++j) {  // and one part past the round
    const uint32_t part = g::partBytes(total, chunk, j);
    CHECK(part <= g::kPartPayload);
    const uint32_t payload_lines = g::payloadLines(round0, j);
    CHECK(g::linesOfPart(part) == (payload_lines ? payload_lines : 1u));
    for (uint32_t t = 0; t < static_cast<uint32_t>(g::kThreads); ++t)
      CHECK(g::bytesOfLine(part, t) == g::lineBytes(round0, j, t));
  }
}

}  // namespace

int main() {
  // Every size up to two chunks of a 4 KiB chunk: empty, tails of every length, whole parts,
  // and messages longer than one round (only round 0 is the one-round kernel's).
  for (uint64_t total = 0; total <= 2 * 4096 + 8; ++total) checkMessage(total, 4096);
  // Random sizes up to the default chunk (64 KiB) and past it.
  std::mt19937_64 rng(20261130);
  for (int i = 0; i < 2000; ++i) checkMessage(rng() % (3 * 65536 + 1), 65536);
  for (const uint64_t total : {0ull, 1ull, 7ull, 8ull, 9ull, 2047ull, 2048ull, 2049ull, 65535ull,
                               65536ull, 65537ull, 1ull << 20})
    checkMessage(total, 65536);
  std::printf("one-round parts: ok\n");
  return 0;
}
