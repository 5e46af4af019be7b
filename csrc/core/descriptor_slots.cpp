#include "core/descriptor_slots.hpp"

#include <cstring>
#include <string>

#include "core/error.hpp"

namespace resident {
namespace {

uint64_t fnv1a(const void* bytes, size_t n) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

DescriptorSlots::DescriptorSlots(uint32_t eager, uint32_t graph, size_t max_bytes)
    : eager_(eager),
      max_bytes_(max_bytes),
      entries_(static_cast<size_t>(eager) + graph),
      copies_(entries_.size() * max_bytes) {
  if (eager == 0) throw InvalidArgument("resident: the descriptor table needs an eager slot");
  index_.reserve(entries_.size());
}

int DescriptorSlots::find(uint32_t first, uint32_t last, uint64_t hash, const void* bytes,
                          size_t n) const {
  const auto range = index_.equal_range(hash);
  for (auto it = range.first; it != range.second; ++it) {
    const uint32_t s = it->second;
    if (s < first || s >= last) continue;
    const Entry& e = entries_[s];
    if (e.n == n && std::memcmp(&copies_[s * max_bytes_], bytes, n) == 0)
      return static_cast<int>(s);
  }
  return -1;
}

void DescriptorSlots::store(uint32_t slot, uint64_t hash, const void* bytes, size_t n) {
  Entry& e = entries_[slot];
  if (e.n != 0) {  // an evicted eager descriptor leaves the index
    const auto range = index_.equal_range(e.hash);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == slot) {
        index_.erase(it);
        break;
      }
    }
  }
  index_.emplace(hash, slot);
  e.hash = hash;
  e.n = n;
  e.generation = e.generation >= kMaxGeneration ? 1u : e.generation + 1;
  std::memcpy(&copies_[slot * max_bytes_], bytes, n);
}

DescriptorSlots::Pick DescriptorSlots::eager(const void* bytes, size_t n, uint32_t stamp) {
  if (n == 0 || n > max_bytes_) throw InvalidArgument("resident: bad descriptor size");
  const uint64_t hash = fnv1a(bytes, n);
  Pick pick;
  int s = find(eager_, eager_ + graph_used_, hash, bytes, n);  // immutable: no stamp needed
  if (s >= 0) {
    pick.slot = static_cast<uint32_t>(s);
    pick.generation = entries_[pick.slot].generation;
    return pick;
  }
  s = find(0, eager_, hash, bytes, n);
  if (s < 0) {
    // Least recently used eager slot (an empty one first).
    uint32_t victim = 0;
    for (uint32_t i = 0; i < eager_; ++i) {
      if (entries_[i].n == 0) {
        victim = i;
        break;
      }
      if (entries_[i].last_use < entries_[victim].last_use) victim = i;
    }
    const Entry& old = entries_[victim];
    if (old.n != 0) {
      pick.must_wait = true;
      pick.wait_stamp = old.last_stamp;
    }
    store(victim, hash, bytes, n);
    pick.upload = true;
    s = static_cast<int>(victim);
  }
  Entry& e = entries_[static_cast<uint32_t>(s)];
  e.last_stamp = stamp;
  e.last_use = ++clock_;
  pick.slot = static_cast<uint32_t>(s);
  pick.generation = e.generation;
  return pick;
}

DescriptorSlots::Pick DescriptorSlots::graph(const void* bytes, size_t n) {
  if (n == 0 || n > max_bytes_) throw InvalidArgument("resident: bad descriptor size");
  const uint64_t hash = fnv1a(bytes, n);
  Pick pick;
  const int s = find(eager_, eager_ + graph_used_, hash, bytes, n);
  if (s >= 0) {
    pick.slot = static_cast<uint32_t>(s);
    pick.generation = entries_[pick.slot].generation;
    return pick;
  }
  if (eager_ + graph_used_ >= size()) {
    throw InvalidArgument(
        "resident: the resident kernel's descriptor table is full: " + std::to_string(graph_used_) +
        " distinct collectives were captured into CUDA graphs on this group; raise "
        "RESIDENT_GPU_PERSISTENT_SLOTS or capture fewer distinct calls");
  }
  pick.slot = eager_ + graph_used_++;
  store(pick.slot, hash, bytes, n);
  pick.generation = entries_[pick.slot].generation;
  pick.upload = true;
  return pick;
}

}  // namespace resident
