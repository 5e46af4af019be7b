// The kernels find their slots and credit words with kernels/region_offsets.cuh, from the bases
// the host puts into Region (setRegionLayout); the proxy and the host find the same places with
// core/gpu_layout.hpp. A disagreement would have a kernel write where the proxy never posts
// from, or read where no peer writes. Checked for every peer and slot of groups of 1..64 ranks
// and several chunk sizes, with the offsets inside their region and outbox and apart.
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <set>
#include <utility>

#include "../kernels/region_offsets.cuh"
#include "check.hpp"

namespace g = resident::gpu;
using resident::GpuLayout;

namespace {

void checkLayout(int nranks, uint32_t chunk) {
  const GpuLayout lay(nranks, chunk);
  g::Region reg{};
  g::setRegionLayout(reg, lay);
  CHECK(reg.chunk == chunk);
  CHECK(reg.fifo_offset == lay.fifoOffset());
  CHECK(reg.fifo_mask + 1 == GpuLayout::kFifoCapacity);
  const uint64_t slot = lay.slotBytes();
  // Ranges [begin, end) that must not overlap, in the region and in the outbox.
  std::set<std::pair<uint64_t, uint64_t>> region, outbox;
  auto disjointInsert = [](std::set<std::pair<uint64_t, uint64_t>>& s, uint64_t begin, uint64_t end,
                           uint64_t limit) {
    CHECK(begin < end && end <= limit);
    const auto next = s.lower_bound({begin, 0});
    CHECK(next == s.end() || next->first >= end);
    CHECK(next == s.begin() || std::prev(next)->second <= begin);
    s.insert({begin, end});
  };
  for (int p = 0; p < nranks; ++p) {
    for (uint32_t k = 0; k < 2; ++k) {
      CHECK(g::collInOffset(reg, p, k) == lay.collIn(p) + k * slot);
      CHECK(g::p2pInOffset(reg, p, k) == lay.p2pIn(p) + k * slot);
      CHECK(g::creditInOffset(reg, p, k) == lay.creditIn(p) + 8ull * k);
      CHECK(g::outCollOffset(reg, p, k) == lay.outColl(p) + k * slot);
      CHECK(g::outP2POffset(reg, p, k) == lay.outP2P(p) + k * slot);
      CHECK(g::outCreditOffset(reg, p, k) == lay.outCredit(p) + 8ull * k);
      struct Place {
        std::set<std::pair<uint64_t, uint64_t>>* in;
        uint64_t offset, bytes, limit;
      };
      const Place places[] = {
          {&region, g::collInOffset(reg, p, k), slot, lay.totalBytes()},
          {&region, g::p2pInOffset(reg, p, k), slot, lay.totalBytes()},
          {&region, g::creditInOffset(reg, p, k), 8, lay.totalBytes()},
          {&outbox, g::outCollOffset(reg, p, k), slot, lay.outboxBytes()},
          {&outbox, g::outP2POffset(reg, p, k), slot, lay.outboxBytes()},
          {&outbox, g::outCreditOffset(reg, p, k), 8, lay.outboxBytes()},
      };
      for (const Place& at : places)
        disjointInsert(*at.in, at.offset, at.offset + at.bytes, at.limit);
    }
  }
  // Nothing of a peer's lines reaches the control words or the trigger FIFO.
  CHECK(region.begin()->first >= lay.fifoOffset() + 16ull * GpuLayout::kFifoCapacity);
}

}  // namespace

int main() {
  for (const int nranks : {1, 2, 3, 4, 8, 64})
    for (const uint32_t chunk : {2048u, 4096u, 65536u}) checkLayout(nranks, chunk);
  std::mt19937 rng(20261130);
  for (int i = 0; i < 50; ++i)
    checkLayout(1 + static_cast<int>(rng() % 64), 2048u * (1u + rng() % 64));
  std::printf("region offsets: ok\n");
  return 0;
}
