// Slots of the resident kernel's descriptor table (RESIDENT_GPU_PERSISTENT): which slot an
// op's descriptor goes into, content-addressed so that a call site's arguments are written
// once, not per call. Torch-free and CUDA-free (the caller uploads); unit-tested on the CPU.
//
// Graph slots are immutable once written: a captured graph may replay at any time, so its
// descriptors stay until the group is destroyed (capturing the same call again reuses them).
// Eager slots are a small LRU cache; each use is stamped with the op's issue number, and a slot
// is rewritten only once the op that used it last has completed (the caller waits for that).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace resident {

class DescriptorSlots {
 public:
  // Slots [0, eager) are eager, [eager, eager + graph) are for captured graphs. Descriptors
  // are at most `max_bytes` long.
  DescriptorSlots(uint32_t eager, uint32_t graph, size_t max_bytes);

  // A slot's generation goes up (1..kMaxGeneration, wrapping) each time it is written, so
  // that a reader caching slots (the resident kernel) tells a rewritten slot from the copy it
  // holds: the op's tag carries it. A slot is rewritten only after its last op completed, so
  // a cached copy is never exactly kMaxGeneration writes old when it is read.
  static constexpr uint32_t kMaxGeneration = (1u << 15) - 1;

  struct Pick {
    uint32_t slot = 0;
    uint32_t generation = 0;  // of the slot's content after this pick (>= 1)
    bool upload = false;      // the caller must write the descriptor into the slot
    bool must_wait = false;   // ... after the eager op stamped `wait_stamp` has completed
    uint32_t wait_stamp = 0;
  };
  // An eager op's slot; `stamp` is its issue number (wrapping), recorded as the slot's last
  // use. A slot already holding the same bytes (eager or graph) is reused as is.
  Pick eager(const void* bytes, size_t n, uint32_t stamp);
  // A captured op's slot. Throws InvalidArgument when every graph slot is taken.
  Pick graph(const void* bytes, size_t n);

  uint32_t graphSlotsUsed() const { return graph_used_; }
  uint32_t size() const { return static_cast<uint32_t>(entries_.size()); }
  // True when stamp `done` is at or past `want` (issue numbers wrap).
  static bool reached(uint32_t done, uint32_t want) {
    return static_cast<int32_t>(done - want) >= 0;
  }

 private:
  struct Entry {
    uint64_t hash = 0;
    size_t n = 0;  // 0: empty
    uint32_t last_stamp = 0;
    uint64_t last_use = 0;    // LRU clock
    uint32_t generation = 0;  // 0: never written
  };
  int find(uint32_t first, uint32_t last, uint64_t hash, const void* bytes, size_t n) const;
  void store(uint32_t slot, uint64_t hash, const void* bytes, size_t n);

  const uint32_t eager_;
  const size_t max_bytes_;
  std::vector<Entry> entries_;
  std::vector<unsigned char> copies_;  // entries_.size() x max_bytes_, allocated once
  // hash -> slot of every filled entry: an op's lookup is one probe, not a scan of the table
  // (up to RESIDENT_GPU_PERSISTENT_SLOTS entries). Nodes are allocated only when a descriptor
  // is stored, i.e. when it is also uploaded.
  std::unordered_multimap<uint64_t, uint32_t> index_;
  uint32_t graph_used_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace resident
