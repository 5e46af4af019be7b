// The collective kernels' slot-reuse rules (kernels/rounds_device.cuh) against a model of two
// ranks exchanging a sequence of ops. Each (rank, op, part) is an independent agent — finer
// than the kernels' blocks, so every interleaving of blocks is among the model's — that, round
// by round, writes its part into the peer's slot (parity of the round's generation) and then
// waits for and consumes the peer's part; a rank starts an op only once all its agents of the
// previous op are done (stream order). Checked on random schedules:
//  - no write overlaps bytes of the receiver's slot that hold a different generation not yet
//    consumed (a reader would see the wrong data, or wait forever for a line overwritten);
//  - the exchange never deadlocks.
// The bytes of a slot: part j as LL lines at [4096 j, 4096 j + 16 lines); with the simple
// protocol its payload at [chunk + 2048 j, ...) and its flag line at [64 j, 64 j + 16)
// (kSimpleFlagStride).
// As a check that the model can fail, the unsafe rules (parts per round, protocol per round)
// must show a violation: they lost data on the H200 (a 1 MiB all_reduce read wrong data).
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
  bool current;    // false: the unsafe rules (parts and protocol per round)
  uint32_t above;  // simple above this many first-round bytes (Region::simple_above)
  uint32_t chunk;
};

struct Op {
  uint64_t bytes[2];  // bytes[r]: what rank r sends to the other rank
};

uint64_t larger(const Op& op) {
  return op.bytes[0] > op.bytes[1] ? op.bytes[0] : op.bytes[1];
}

uint32_t roundsOf(const Rules& R, const Op& op) {
  const uint64_t b = larger(op);
  const uint64_t r = (b + R.chunk - 1) / R.chunk;
  return r == 0 ? 1u : static_cast<uint32_t>(r);
}

uint32_t partsIn(const Rules& R, const Op& op, uint32_t r) {
  return R.current ? g::exchangedParts(larger(op), r, R.chunk)
                   : g::partsOf(g::roundBytes(larger(op), r, R.chunk));
}

bool simpleIn(const Rules& R, const Op& op, uint32_t r) {
  // Peer 1 under the proxied rule, peer 0 under the direct one (never simple): the model's
  // pair must follow the rule of its own bit.
  const g::Region reg = slot_model::pairRegion(R.above, R.chunk);
  const uint32_t first = g::roundBytes(larger(op), R.current ? 0 : r, R.chunk);
  CHECK(!g::simplePair(reg, 0, first));
  return g::simplePair(reg, 1, first);
}

using slot_model::Item;

struct Model {
  Rules R;
  std::vector<Op> ops;
  std::vector<uint32_t> base;    // generation base of each op (both directions)
  std::vector<Item> slot[2][2];  // slot[receiver rank][parity]
  struct Agent {
    int rank;
    uint32_t op, part, round = 0;
    bool sent = false, done = false;
  };
  std::vector<Agent> agents;
  uint32_t next_op[2] = {0, 0};  // the op each rank runs (its agents exist) or starts next
  std::string violation;

  Model(const Rules& rules, std::vector<Op> o) : R(rules), ops(std::move(o)) {
    uint32_t b = 0;
    for (const Op& op : ops) {
      base.push_back(b);
      b += roundsOf(R, op);
    }
    for (int rank = 0; rank < 2; ++rank) start(rank);
  }

  uint32_t agentParts(const Op& op) const {
    uint32_t n = 0;
    for (uint32_t r = 0; r < roundsOf(R, op); ++r)
      n = partsIn(R, op, r) > n ? partsIn(R, op, r) : n;
    return n;
  }

  void start(int rank) {
    const uint32_t o = next_op[rank];
    if (o >= ops.size()) return;
    for (uint32_t j = 0; j < agentParts(ops[o]); ++j) agents.push_back({rank, o, j});
  }

  bool rankIdle(int rank, uint32_t o) const {
    for (const Agent& a : agents)
      if (a.rank == rank && a.op == o && !a.done) return false;
    return true;
  }

  // The ranges part j of round r of `op` writes into the receiver's slot, sent by `from`.
  std::vector<std::pair<uint64_t, uint64_t>> ranges(const Op& op, uint32_t r, uint32_t j,
                                                    int from) const {
    const uint32_t sb = g::roundBytes(op.bytes[from], r, R.chunk);
    std::vector<std::pair<uint64_t, uint64_t>> out;
    if (simpleIn(R, op, r)) {
      const uint64_t flag = resident::kSimpleFlagStride * j;
      out.push_back({flag, flag + 16});
      const int64_t len = g::partLen(sb, j);
      if (len > 0) {
        const uint64_t lo = R.chunk + static_cast<uint64_t>(j) * g::kPartPayload;
        out.push_back({lo, lo + (len < g::kPartPayload ? len : g::kPartPayload)});
      }
    } else {
      const uint32_t lines = g::payloadLines(sb, j) ? g::payloadLines(sb, j) : 1u;
      const uint64_t lo = static_cast<uint64_t>(j) * g::kThreads * 16;
      out.push_back({lo, lo + 16ull * lines});
    }
    return out;
  }

  // Advances agent a by one step if it can; false if it waits.
  bool step(Agent& a) {
    const Op& op = ops[a.op];
    const uint32_t rounds = roundsOf(R, op);
    while (a.round < rounds && a.part >= partsIn(R, op, a.round)) {
      ++a.round;  // this part takes no part in the round
      a.sent = false;
    }
    if (a.round >= rounds) {
      finish(a);
      return true;
    }
    const uint32_t gen = base[a.op] + a.round + 1;
    const int peer = 1 - a.rank;
    if (!a.sent) {
      auto& s = slot[peer][(gen - 1) & 1];
      for (const auto& rg : ranges(op, a.round, a.part, a.rank)) {
        for (const Item& it : s) {
          if (it.gen != gen && it.lo < rg.second && rg.first < it.hi && violation.empty()) {
            violation = "rank " + std::to_string(a.rank) + " op " + std::to_string(a.op) +
                        " round " + std::to_string(a.round) + " part " + std::to_string(a.part) +
                        " (gen " + std::to_string(gen) + ") overwrote gen " +
                        std::to_string(it.gen) + " part " + std::to_string(it.part) +
                        " before rank " + std::to_string(peer) + " read it";
          }
        }
        s.push_back({gen, a.part, rg.first, rg.second});
      }
      a.sent = true;
      return true;
    }
    auto& mine = slot[a.rank][(gen - 1) & 1];
    bool arrived = false;
    for (const Item& it : mine) arrived |= it.gen == gen && it.part == a.part;
    if (!arrived) return false;
    std::vector<Item> left;
    for (const Item& it : mine)
      if (!(it.gen == gen && it.part == a.part)) left.push_back(it);
    mine.swap(left);
    ++a.round;
    a.sent = false;
    return true;
  }

  void finish(Agent& a) {
    a.done = true;
    if (rankIdle(a.rank, a.op) && next_op[a.rank] == a.op) {
      ++next_op[a.rank];
      start(a.rank);
    }
  }
};

// Random op sequences over sizes around the chunk and part boundaries, with uneven directions.
slot_model::Outcome explore(const Rules& R, int trials, uint32_t seed) {
  const uint32_t c = R.chunk;
  const std::vector<uint64_t> sizes = {
      0,         8, 24,     2048,     2056,      c / 4, c / 4 + 8,  c / 2 - 8, c / 2,    c / 2 + 8,
      3 * c / 4, c, c + 24, c + 2048, 3 * c / 2, 2 * c, 2 * c + 24, 5 * c / 2, 4 * c + 8};
  return slot_model::exploreSchedules(trials, seed, [&](std::mt19937& rng) {
    std::vector<Op> ops;
    const int n = 2 + static_cast<int>(rng() % 5);
    for (int i = 0; i < n; ++i) {
      const uint64_t a = sizes[rng() % sizes.size()];
      const uint64_t b = (rng() % 3 == 0) ? sizes[rng() % sizes.size()] : a;  // mostly even
      ops.push_back({{a, b}});
    }
    return Model(R, ops);
  });
}

// simplePair picks each pair's threshold by its rule: direct, proxied over shm, over a network.
void checkPairRules() {
  g::Region reg{};
  reg.simple_above[0] = g::kSimpleNever;
  reg.simple_above[1] = 32768;
  reg.simple_above[2] = 8192;
  reg.proxy_rule = (1ull << 1) | (1ull << 2);
  reg.network_rule = 1ull << 2;
  CHECK(g::pairRule(reg, 0) == 0 && g::pairRule(reg, 1) == 1 && g::pairRule(reg, 2) == 2);
  CHECK(!g::simplePair(reg, 0, 65536));
  CHECK(!g::simplePair(reg, 1, 32768) && g::simplePair(reg, 1, 32769));
  CHECK(!g::simplePair(reg, 2, 8192) && g::simplePair(reg, 2, 8193));
}

}  // namespace

int main() {
  checkPairRules();
  for (uint32_t chunk : {65536u, 16384u}) {
    for (uint32_t above : slot_model::thresholdsFor(chunk, g::kSimpleNever)) {
      const slot_model::Outcome now = explore({true, above, chunk}, 3000, 7 + chunk + above);
      CHECK(now.clean(chunk, above));
      if (above != g::kSimpleNever && above != chunk / 2) continue;
      // The model must be able to fail: the earlier rules lost data on the H200.
      const slot_model::Outcome before =
          explore({false, above, chunk}, 3000, 11 + chunk + (above == chunk / 2));
      std::printf("chunk %u simple above %u: earlier rules: %d violations in 3000 schedules (%s)\n",
                  chunk, above, before.violations, before.first.c_str());
      CHECK(before.violations > 0);
    }
  }
  std::printf("ok\n");
  return 0;
}
