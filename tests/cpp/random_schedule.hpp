// What the slot-protocol models (test_slot_protocol.cpp, test_p2p_slot_protocol.cpp) share: the
// slot's written ranges, the pair's protocol rule, a random schedule of their agents, and the
// tally of the schedules that broke a rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../kernels/rounds_device.cuh"

namespace slot_model {

struct Item {  // bytes of a receiver's slot written by one part of one round
  uint32_t gen, part;
  uint64_t lo, hi;
};

// The Region simplePair reads for the models' pair: peer 0 under the direct rule (never simple),
// peer 1, the model's other rank, under the proxied rule with threshold `above`.
inline resident::gpu::Region pairRegion(uint32_t above, uint32_t chunk) {
  resident::gpu::Region reg{};
  reg.simple_above[0] = resident::gpu::kSimpleNever;
  reg.simple_above[1] = above;
  reg.proxy_rule = 1ull << 1;
  reg.chunk = chunk;
  return reg;
}

// Steps `m`'s agents (m.agents, each with a `done` flag; m.step(agent) says whether the agent
// moved) in a random order until all are done (true) or none can move (false: a deadlock). A
// waiting agent may be skipped for one that can move.
template <typename Model>
bool runRandomSchedule(Model& m, std::mt19937& rng) {
  for (;;) {
    std::vector<size_t> live;
    for (size_t i = 0; i < m.agents.size(); ++i)
      if (!m.agents[i].done) live.push_back(i);
    if (live.empty()) return true;
    bool moved = false;
    for (size_t k = live.size(); k > 0 && !moved; --k) {
      const size_t pick = rng() % k;
      const size_t i = live[pick];
      live[pick] = live[k - 1];
      moved = m.step(m.agents[i]);
    }
    if (!moved) return false;
  }
}

// Schedules that overwrote unread data or deadlocked, and the first one's description.
struct Outcome {
  int violations = 0, deadlocks = 0;
  std::string first;

  void add(const std::string& violation, bool finished) {
    if (!violation.empty()) {
      if (first.empty()) first = violation;
      ++violations;
    } else if (!finished) {
      if (first.empty()) first = "deadlock";
      ++deadlocks;
    }
  }

  // True when no schedule failed; otherwise says so on stderr.
  bool clean(uint32_t chunk, uint32_t above) const {
    if (violations || deadlocks)
      std::fprintf(stderr, "chunk %u simple above %u: %d violations, %d deadlocks; first: %s\n",
                   chunk, above, violations, deadlocks, first.c_str());
    return violations == 0 && deadlocks == 0;
  }
};

// Runs `trials` random schedules, each of a model that make(rng) builds (its `violation` empty
// while no rule broke), and tallies them.
template <typename MakeModel>
Outcome exploreSchedules(int trials, uint32_t seed, MakeModel make) {
  std::mt19937 rng(seed);
  Outcome out;
  for (int t = 0; t < trials; ++t) {
    auto m = make(rng);
    const bool finished = runRandomSchedule(m, rng);
    out.add(m.violation, finished);
  }
  return out;
}

// The simple protocol's thresholds a model runs under for a chunk: `never`; the half chunk of
// RESIDENT_GPU_PROTOCOL=simple (and the proxied threshold, 32 KiB, at 64 KiB chunks);
// and proxied thresholds below it (the host caps larger ones at half a chunk).
inline std::vector<uint32_t> thresholdsFor(uint32_t chunk, uint32_t never) {
  return {never, chunk / 2, 0u, 2048u, chunk / 4, chunk / 8};
}

}  // namespace slot_model
