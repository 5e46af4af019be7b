// What the slot-protocol models (test_slot_protocol.cpp, test_p2p_slot_protocol.cpp) share: a
// random schedule of their agents, and the tally of the schedules that broke a rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace slot_model {

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

// The simple protocol's thresholds a model runs under for a chunk: `never`; the half chunk of
// RESIDENT_GPU_PROTOCOL=simple (and RESIDENT_GPU_PROXY_SIMPLE_ABOVE's default at 64 KiB chunks);
// and proxied thresholds below it (the host caps larger ones at half a chunk).
inline std::vector<uint32_t> thresholdsFor(uint32_t chunk, uint32_t never) {
  return {never, chunk / 2, 0u, 2048u, chunk / 4};
}

}  // namespace slot_model
