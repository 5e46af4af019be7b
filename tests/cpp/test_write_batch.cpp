// The proxy's batch of writes (csrc/core/proxy/write_batch.hpp): after sortAndMergeWrites every
// byte (16-byte unit) still goes from the same outbox offset to the same remote offset of the same
// peer, the writes are in (peer, outbox offset) order, and no two neighbours could have been
// merged. Random batches shaped like the CUDA path's: per peer, a kernel's parts (2 KiB payloads or
// 4 KiB of lines, some short) pushed in a shuffled order, some to another slot (not
// contiguous), plus ranges contiguous in the outbox but not remotely, which must stay apart.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "check.hpp"
#include "core/proxy/write_batch.hpp"

namespace {

using resident::BatchWrite;

// Where each 16-byte unit the writes carry goes: per (peer, outbox unit), the remote unit + 1
// (0: carried by no write); each unit at most once. All offsets and lengths of the batches
// below are multiples of 16 bytes. A flat table: the check runs on every trial.
constexpr uint64_t kUnit = 16;
constexpr int kPeers = 4;
constexpr uint64_t kPeerSpan = 1ull << 20;  // outbox bytes per peer (randomBatch stays inside)

struct UnitMap {
  std::vector<uint64_t> remote = std::vector<uint64_t>(kPeers * kPeerSpan / kUnit, 0);
  std::vector<uint64_t> touched;  // the units set, so that clearing costs what filling did

  void fill(const std::vector<BatchWrite>& ws) {
    for (const uint64_t u : touched) remote[u] = 0;
    touched.clear();
    for (const BatchWrite& w : ws) {
      CHECK(w.local % kUnit == 0 && w.remote % kUnit == 0 && w.bytes % kUnit == 0);
      CHECK(w.peer >= 0 && w.peer < kPeers && w.local - w.peer * kPeerSpan + w.bytes <= kPeerSpan);
      for (uint64_t u = w.local / kUnit; u < (w.local + w.bytes) / kUnit; ++u) {
        CHECK(remote[u] == 0);
        remote[u] = w.remote / kUnit + (u - w.local / kUnit) + 1;
        touched.push_back(u);
      }
    }
  }
};

// The same units, each to the same remote unit.
bool sameUnits(const UnitMap& a, const UnitMap& b) {
  if (a.touched.size() != b.touched.size()) return false;
  for (const uint64_t u : a.touched)
    if (a.remote[u] != b.remote[u]) return false;
  return true;
}

std::vector<BatchWrite> randomBatch(std::mt19937& rng) {
  std::vector<BatchWrite> ws;
  const int peers = 1 + static_cast<int>(rng() % kPeers);
  for (int p = 0; p < peers; ++p) {
    const uint64_t part = rng() % 2 ? 2048 : 4096;
    const uint64_t local0 = static_cast<uint64_t>(p) * kPeerSpan + (rng() % 4) * (1 << 17);
    const uint64_t remote0 = (rng() % 8) * (1 << 17);
    const int parts = 1 + static_cast<int>(rng() % 20);
    for (int j = 0; j < parts; ++j) {
      // The last part of a message may be short; an occasional gap splits the run.
      uint64_t bytes = part;
      if (j == parts - 1 && rng() % 2) bytes = 16 * (1 + rng() % (part / 16));
      if (rng() % 7 == 0) continue;
      ws.push_back({p, local0 + j * part, remote0 + j * part, bytes});
    }
    // Contiguous in the outbox, not remotely: another slot's range right after this run.
    if (rng() % 3 == 0)
      ws.push_back({p, local0 + parts * part, remote0 + (1 << 16) + parts * part + 16, part});
  }
  std::shuffle(ws.begin(), ws.end(), rng);
  if (ws.size() > 64) ws.resize(64);
  return ws;
}

}  // namespace

int main() {
  std::mt19937 rng(2511);
  UnitMap before, after;
  int merged_total = 0, kept_apart = 0;
  for (int trial = 0; trial < 5000; ++trial) {
    std::vector<BatchWrite> in = randomBatch(rng);
    std::vector<BatchWrite> out = in;
    const int n = resident::sortAndMergeWrites(out.data(), static_cast<int>(out.size()));
    CHECK(n >= (in.empty() ? 0 : 1) && n <= static_cast<int>(in.size()));
    out.resize(static_cast<size_t>(n));
    before.fill(in);
    after.fill(out);
    CHECK(sameUnits(before, after));
    for (int i = 1; i < n; ++i) {
      const BatchWrite& a = out[static_cast<size_t>(i - 1)];
      const BatchWrite& b = out[static_cast<size_t>(i)];
      CHECK(std::make_tuple(a.peer, a.local) < std::make_tuple(b.peer, b.local));
      const bool continues_locally = a.peer == b.peer && a.local + a.bytes == b.local;
      CHECK(!(continues_locally && a.remote + a.bytes == b.remote));  // merged at most
      kept_apart += continues_locally ? 1 : 0;
    }
    merged_total += static_cast<int>(in.size()) - n;
  }
  // The batches did exercise both: runs merged, and outbox-contiguous ranges kept apart.
  CHECK(merged_total > 1000 && kept_apart > 100);
  BatchWrite none[1] = {{0, 0, 0, 8}};
  CHECK(resident::sortAndMergeWrites(none, 0) == 0);
  CHECK(resident::sortAndMergeWrites(none, 1) == 1 && none[0].bytes == 8);
  std::printf("ok: %d writes merged away, %d outbox-contiguous pairs kept apart\n", merged_total,
              kept_apart);
  return 0;
}
