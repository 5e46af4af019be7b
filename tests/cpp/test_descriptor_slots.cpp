// DescriptorSlots: a call site's descriptor is written once (content-addressed), eager slots
// are recycled least-recently-used only after their last op completed, graph slots are never
// rewritten and run out with a clear error. A model (map from slot to the bytes the device
// would hold) checks that no pick ever points an op at another op's bytes.
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/descriptor_slots.hpp"

using resident::DescriptorSlots;

namespace {
std::vector<unsigned char> desc(uint32_t id, size_t n) {
  std::vector<unsigned char> d(n);
  std::mt19937 g(id * 2654435761u + 7);
  for (auto& b : d) b = static_cast<unsigned char>(g());
  return d;
}
}  // namespace

int main() {
  constexpr size_t kMax = 96;
  {
    DescriptorSlots s(4, 3, kMax);
    CHECK(s.size() == 7);
    auto a = desc(1, 80), b = desc(2, 80);
    auto p = s.eager(a.data(), a.size(), 1);
    CHECK(p.upload && !p.must_wait && p.slot < 4);
    auto q = s.eager(a.data(), a.size(), 2);  // same call site: no upload
    CHECK(!q.upload && q.slot == p.slot);
    auto r = s.eager(b.data(), b.size(), 3);
    CHECK(r.upload && r.slot != p.slot);
    // Same bytes, different length: a different descriptor.
    auto r2 = s.eager(b.data(), 40, 4);
    CHECK(r2.upload && r2.slot != r.slot);
    // Graph slots: content-addressed, immutable, reused by eager ops with the same bytes.
    auto g1 = s.graph(a.data(), a.size());
    CHECK(g1.upload && g1.slot >= 4);
    CHECK(!s.graph(a.data(), a.size()).upload);
    CHECK(s.graph(a.data(), a.size()).slot == g1.slot);
    CHECK(s.eager(a.data(), a.size(), 5).slot == g1.slot);
    auto g2 = s.graph(b.data(), b.size());
    auto g3 = s.graph(desc(3, 50).data(), 50);
    CHECK(g2.slot != g1.slot && g3.slot != g2.slot && s.graphSlotsUsed() == 3);
    CHECK_THROWS(s.graph(desc(4, 50).data(), 50));  // full
    CHECK_THROWS(s.eager(a.data(), kMax + 1, 6));   // too long
    CHECK(DescriptorSlots::reached(5, 5) && DescriptorSlots::reached(6, 5));
    CHECK(!DescriptorSlots::reached(4, 5));
    CHECK(DescriptorSlots::reached(2, 0xfffffff0u));  // wrapped
  }
  {
    // Eviction order and stamps: 3 eager slots, 4 call sites used round-robin.
    DescriptorSlots s(3, 0, kMax);
    std::vector<std::vector<unsigned char>> d;
    for (uint32_t i = 0; i < 4; ++i) d.push_back(desc(10 + i, 64));
    for (uint32_t i = 0; i < 3; ++i) CHECK(!s.eager(d[i].data(), 64, i + 1).must_wait);
    // d[1] used again: d[0] is now the least recently used.
    CHECK(!s.eager(d[1].data(), 64, 4).upload);
    auto p = s.eager(d[3].data(), 64, 5);
    CHECK(p.upload && p.must_wait && p.wait_stamp == 1);
    // d[2] (stamp 3) is next.
    auto q = s.eager(d[0].data(), 64, 6);
    CHECK(q.upload && q.must_wait && q.wait_stamp == 3);
  }
  {
    // Random model check: every pick's slot holds exactly the op's bytes (as the device would
    // after the uploads), and an upload into an eager slot waits for that slot's last user.
    DescriptorSlots s(8, 16, kMax);
    std::vector<std::vector<unsigned char>> device(s.size());
    std::vector<uint32_t> last_user(s.size(), 0);
    // A reader's cache of the slots, refreshed (as the resident kernel's table) only when the
    // pick's generation differs from the one it holds: it must still see the op's bytes.
    std::vector<uint32_t> cached_generation(s.size(), 0), generation(s.size(), 0);
    std::vector<std::vector<unsigned char>> cache(s.size());
    std::mt19937 g(42);
    uint32_t stamp = 0;
    for (int i = 0; i < 20000; ++i) {
      const uint32_t site = g() % 20;
      const auto d = desc(site, 16 + site * 3);
      const bool graph = (g() % 7 == 0) && site < 14;
      DescriptorSlots::Pick p;
      if (graph) {
        p = s.graph(d.data(), d.size());
        CHECK(p.slot >= 8 && !p.must_wait);
        if (p.upload) CHECK(device[p.slot].empty());  // a graph slot is written once
      } else {
        p = s.eager(d.data(), d.size(), ++stamp);
        if (p.upload) {
          CHECK(p.slot < 8);
          CHECK(p.must_wait == !device[p.slot].empty());
          if (p.must_wait) CHECK(p.wait_stamp == last_user[p.slot]);
        }
        if (p.slot < 8) last_user[p.slot] = stamp;
      }
      if (p.upload) {
        device[p.slot] = d;
        generation[p.slot] = generation[p.slot] + 1;
      }
      CHECK(device[p.slot] == d);
      CHECK(p.generation == generation[p.slot] && p.generation >= 1);
      if (cached_generation[p.slot] != p.generation) {
        cache[p.slot] = device[p.slot];
        cached_generation[p.slot] = p.generation;
      }
      CHECK(cache[p.slot] == d);
    }
    CHECK(s.graphSlotsUsed() <= 14);
  }
  {
    // Generations wrap within 1..kMaxGeneration (the tag's bits), never 0.
    DescriptorSlots s(1, 1, kMax);
    const auto a = desc(1, 40), b = desc(2, 40);
    uint32_t stamp = 0, last = 0;
    for (uint32_t i = 0; i < DescriptorSlots::kMaxGeneration + 3; ++i) {
      const auto& d = (i % 2) ? b : a;
      const auto p = s.eager(d.data(), d.size(), ++stamp);
      CHECK(p.upload && p.slot == 0);
      CHECK(p.generation == (last == DescriptorSlots::kMaxGeneration ? 1u : last + 1));
      last = p.generation;
      CHECK(!s.eager(d.data(), d.size(), ++stamp).upload);  // same bytes: same generation
      CHECK(s.eager(d.data(), d.size(), ++stamp).generation == last);
    }
    const auto g = s.graph(a.data(), a.size());
    CHECK(g.upload && g.slot == 1 && g.generation == 1);
    CHECK(s.graph(a.data(), a.size()).generation == 1 && !s.graph(a.data(), a.size()).upload);
  }
  std::printf("ok\n");
  return 0;
}
