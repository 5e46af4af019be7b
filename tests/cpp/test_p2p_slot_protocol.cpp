// Send/recv's slot rules (kernels/p2p_kernel.cu) against a model of one channel, one direction
// of a pair: a sequence of messages, each in rounds of at most a chunk. Each (message, part) of
// either end is an independent agent — finer than the kernels' blocks, so every interleaving of
// blocks is among the model's — and an end starts a message only once all its agents of the
// previous one are done (stream order). A sender agent writes its part of round g into slot
// (g - 1) & 1 of the receiver once the slot's credit has reached g - 2; a receiver agent waits for
// its part of round g and consumes it, and the last of the round's parts with lines returns
// credit g. The protocol is chosen per message from its first round (simplePair: LL lines, or
// payload + flags), so LL and simple rounds of different sizes alternate in a
// slot. Checked on random schedules:
//  - no write overlaps bytes of the receiver's slot that hold another generation not yet
//    consumed;
//  - the channel never deadlocks.
// The slot's bytes as test_slot_protocol.cpp lays them out. As a check that the model can fail,
// a credit returned by the first part of a round to be consumed instead of the last must show a
// violation.
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../csrc/core/proxy/trigger_encoding.hpp"
#include "../kernels/rounds_device.cuh"
#include "check.hpp"
#include "random_schedule.hpp"

namespace g = resident::gpu;

namespace {

struct Rules {
  bool credit_by_last;  // false: the broken rule (credit after the first part read)
  uint32_t above;       // simple above this many first-round bytes (Region::simple_above)
  uint32_t chunk;
};

uint32_t roundsOf(const Rules& R, uint64_t bytes) {
  return bytes == 0 ? 1u : static_cast<uint32_t>((bytes + R.chunk - 1) / R.chunk);
}

// Lines of part j of a round (p2p_kernel.cu's linesOf): payload lines, or one credit line for
// an empty message (part 0 only).
uint32_t linesOf(uint32_t round_bytes, uint32_t part) {
  if (round_bytes == 0) return part == 0 ? 1u : 0u;
  return g::payloadLines(round_bytes, part);
}

bool simpleOf(const Rules& R, uint64_t bytes) {
  const uint32_t first = bytes < R.chunk ? static_cast<uint32_t>(bytes) : R.chunk;
  return g::simplePair(slot_model::pairRegion(R.above, R.chunk), 1, first);  // the peer, rank 1
}

using slot_model::Item;

struct Model {
  Rules R;
  std::vector<uint64_t> msgs;
  std::vector<uint32_t> base;  // generation base of each message
  std::vector<Item> slot[2];
  int64_t credit[2] = {0, 0};
  std::vector<uint32_t> consumed;  // per generation: parts consumed
  struct Agent {
    bool sender;
    uint32_t msg, part, round = 0;
    bool done = false;
  };
  std::vector<Agent> agents;
  uint32_t next_msg[2] = {0, 0};  // [sender?]: the message each end runs or starts next
  std::string violation;

  Model(const Rules& rules, std::vector<uint64_t> m) : R(rules), msgs(std::move(m)) {
    uint32_t b = 0;
    for (uint64_t bytes : msgs) {
      base.push_back(b);
      b += roundsOf(R, bytes);
    }
    consumed.assign(b + 1, 0);
    start(true);
    start(false);
  }

  uint32_t roundBytes(uint32_t msg, uint32_t r) const {
    return g::roundBytes(msgs[msg], r, R.chunk);
  }

  void start(bool sender) {
    const uint32_t m = next_msg[sender];
    if (m >= msgs.size()) return;
    const uint32_t parts = g::partsOf(roundBytes(m, 0)) ? g::partsOf(roundBytes(m, 0)) : 1u;
    for (uint32_t j = 0; j < parts; ++j) agents.push_back({sender, m, j});
  }

  // The ranges part j of round r of message m writes into the receiver's slot.
  std::vector<std::pair<uint64_t, uint64_t>> ranges(uint32_t m, uint32_t r, uint32_t j) const {
    const uint32_t bytes = roundBytes(m, r);
    std::vector<std::pair<uint64_t, uint64_t>> out;
    if (simpleOf(R, msgs[m])) {
      const uint64_t flag = resident::kSimpleFlagStride * j;
      out.push_back({flag, flag + 16});
      const int64_t len = g::partLen(bytes, j);
      const uint64_t lo = R.chunk + static_cast<uint64_t>(j) * g::kPartPayload;
      out.push_back({lo, lo + (len < g::kPartPayload ? len : g::kPartPayload)});
    } else {
      const uint64_t lo = static_cast<uint64_t>(j) * g::kThreads * 16;
      out.push_back({lo, lo + 16ull * linesOf(bytes, j)});
    }
    return out;
  }

  uint32_t activeParts(uint32_t m, uint32_t r) const {
    uint32_t n = 0;
    while (linesOf(roundBytes(m, r), n) > 0) ++n;
    return n;
  }

  // Advances agent a by one step if it can; false if it waits.
  bool step(Agent& a) {
    const uint32_t rounds = roundsOf(R, msgs[a.msg]);
    if (a.round >= rounds) {
      finish(a);
      return true;
    }
    const uint32_t gen = base[a.msg] + a.round + 1;
    const int s = static_cast<int>((gen - 1) & 1);
    const bool has_lines = linesOf(roundBytes(a.msg, a.round), a.part) > 0;
    if (a.sender) {
      if (credit[s] < static_cast<int64_t>(gen) - 2) return false;
      if (has_lines) {
        for (const auto& rg : ranges(a.msg, a.round, a.part)) {
          for (const Item& it : slot[s])
            if (it.gen != gen && it.lo < rg.second && rg.first < it.hi && violation.empty())
              violation = "message " + std::to_string(a.msg) + " round " + std::to_string(a.round) +
                          " part " + std::to_string(a.part) + " (gen " + std::to_string(gen) +
                          ") overwrote gen " + std::to_string(it.gen) + " part " +
                          std::to_string(it.part) + " before it was read";
          slot[s].push_back({gen, a.part, rg.first, rg.second});
        }
      }
      ++a.round;
      return true;
    }
    if (has_lines) {
      bool arrived = false;
      for (const Item& it : slot[s]) arrived |= it.gen == gen && it.part == a.part;
      if (!arrived) return false;
      std::vector<Item> left;
      for (const Item& it : slot[s])
        if (!(it.gen == gen && it.part == a.part)) left.push_back(it);
      slot[s].swap(left);
      const uint32_t n = ++consumed[gen];
      if (R.credit_by_last ? n == activeParts(a.msg, a.round) : n == 1) credit[s] = gen;
    }
    ++a.round;
    return true;
  }

  void finish(Agent& a) {
    a.done = true;
    for (const Agent& b : agents)
      if (b.sender == a.sender && b.msg == a.msg && !b.done) return;
    if (next_msg[a.sender] == a.msg) {
      ++next_msg[a.sender];
      start(a.sender);
    }
  }
};

// Random message sequences over sizes around the part, half-chunk and chunk boundaries.
slot_model::Outcome explore(const Rules& R, int trials, uint32_t seed) {
  const uint64_t c = R.chunk;
  const std::vector<uint64_t> sizes = {0,         8,         24, 2048,   2056,         c / 4, c / 2,
                                       c / 2 + 8, 3 * c / 4, c,  c + 24, 2 * c + 2048, 3 * c};
  return slot_model::exploreSchedules(trials, seed, [&](std::mt19937& rng) {
    std::vector<uint64_t> msgs;
    const int n = 2 + static_cast<int>(rng() % 6);
    msgs.reserve(n);
    for (int i = 0; i < n; ++i) msgs.push_back(sizes[rng() % sizes.size()]);
    return Model(R, msgs);
  });
}

}  // namespace

int main() {
  for (uint32_t chunk : {65536u, 16384u}) {
    for (uint32_t above : slot_model::thresholdsFor(chunk, g::kSimpleNever)) {
      const slot_model::Outcome now = explore({true, above, chunk}, 2000, 5 + chunk + above);
      CHECK(now.clean(chunk, above));
    }
    // The model must be able to fail: a credit returned before the round's last part was read.
    const slot_model::Outcome broken = explore({false, chunk / 2, chunk}, 2000, 13 + chunk);
    std::printf("chunk %u: credit by the first part: %d violations in 2000 schedules (%s)\n", chunk,
                broken.violations, broken.first.c_str());
    CHECK(broken.violations > 0);
  }
  std::printf("ok\n");
  return 0;
}
