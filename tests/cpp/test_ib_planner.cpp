// The ib posting policy (PostPlanner), without hardware: per-peer chained batches in issue order,
// merging of contiguous writes, inline thresholds, selective signalling, send-queue bounds with
// deferral, the three completion modes, and a randomized simulation that "executes" the planned
// work requests against simulated remote memory and checks it ends up exactly as if every write
// had been applied in order, while the send queue never overflows and never stalls.
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <vector>

#include "check.hpp"
#include "core/error.hpp"
#include "core/transport/ib/post_planner.hpp"

using namespace resident::ib;

namespace {

WriteReq data(int peer, uint64_t offset, uint32_t bytes, uint64_t local, uint64_t tag = 0) {
  WriteReq r;
  r.peer = peer;
  r.offset = offset;
  r.bytes = bytes;
  r.local_addr = local;
  r.lkey = 7;
  r.tag = tag;
  return r;
}

WriteReq flag(int peer, uint64_t offset, uint64_t local, uint32_t bytes = kFlagBytes,
              uint64_t tag = 0) {
  WriteReq r = data(peer, offset, bytes, local, tag);
  r.is_signal = true;
  return r;
}

PlannerConfig config(CompletionMode mode, uint32_t sq, uint32_t every, uint32_t inl, uint32_t sge) {
  PlannerConfig c;
  c.mode = mode;
  c.sq_depth = sq;
  c.signal_every = every;
  c.max_inline = inl;
  c.max_sge = sge;
  c.imm_slots = mode == CompletionMode::kWriteWithImm ? 4 : 0;
  return c;
}

void testSlotMessage() {
  // The engine's slot write: payload at +64, 32-byte meta at +0, flag at +56 (flag-write mode).
  PostPlanner pl(2, config(CompletionMode::kFlagWrite, 16, 4, 64, 4));
  std::vector<WriteReq> deferred;
  const WriteReq reqs[] = {data(1, 1064, 100, 5000, 1), data(1, 1000, 32, 5104, 2),
                           flag(1, 1056, 5136, kFlagBytes, 3)};
  CHECK(pl.plan(reqs, 3, &deferred) == 3 && deferred.empty());
  CHECK(pl.plannedPeers().size() == 1 && pl.plannedPeers()[0] == 1);
  const PeerBatch& b = pl.batch(1);
  CHECK(b.peer == 1 && b.wrs.size() == 3);
  CHECK(b.wrs[0].remote_offset == 1064 && b.wrs[0].bytes == 100 && !b.wrs[0].inline_data);
  CHECK(b.wrs[1].remote_offset == 1000 && b.wrs[1].bytes == 32 && b.wrs[1].inline_data);
  CHECK(b.wrs[2].remote_offset == 1056 && b.wrs[2].carries_signal && b.wrs[2].fence);
  CHECK(b.wrs[2].inline_data && !b.wrs[2].with_imm && b.wrs[2].target == WrTarget::kInbox);
  for (int i = 0; i < 3; ++i) {
    CHECK(!b.wrs[i].signaled);  // 3 < signal_every
    CHECK(PostPlanner::wrPeer(b.wrs[i].wr_id) == 1);
    CHECK(PostPlanner::wrSeq(b.wrs[i].wr_id) == static_cast<uint64_t>(i));
    CHECK(b.wrs[i].num_sge == 1 && b.sges[b.wrs[i].first_sge].lkey == 7);
  }
  CHECK(pl.outstanding(1) == 3 && pl.outstanding(0) == 0);
  // The 4th request is the signalled one; its completion retires all four.
  const WriteReq more = data(1, 0, 8, 6000, 9);
  CHECK(pl.plan(&more, 1, &deferred) == 1);
  CHECK(pl.batch(1).wrs.size() == 1 && pl.batch(1).wrs[0].signaled);
  int peer = -1;
  CHECK(pl.complete(pl.batch(1).wrs[0].wr_id, &peer) == 9 && peer == 1);
  CHECK(pl.outstanding(1) == 0 && pl.idle(1));
  CHECK_THROWS(pl.complete(PostPlanner::makeWrId(1, 3), &peer));  // not outstanding any more
  CHECK_THROWS(pl.complete(PostPlanner::makeWrId(1, 0, true), &peer));
}

void testMerging() {
  PostPlanner pl(1, config(CompletionMode::kFlagWrite, 64, 64, 0, 2));
  std::vector<WriteReq> deferred;
  // Remote- and local-contiguous: one request, one longer SGE.
  const WriteReq a[] = {data(0, 0, 16, 100), data(0, 16, 16, 116), data(0, 32, 8, 132)};
  pl.plan(a, 3, &deferred);
  CHECK(pl.batch(0).wrs.size() == 1 && pl.batch(0).wrs[0].bytes == 40);
  CHECK(pl.batch(0).wrs[0].num_sge == 1 && pl.batch(0).sges[0].length == 40);
  // Remote-contiguous, local scattered: SGEs up to max_sge (2), then a new request.
  const WriteReq b[] = {data(0, 100, 8, 1000), data(0, 108, 8, 2000), data(0, 116, 8, 3000)};
  pl.plan(b, 3, &deferred);
  const PeerBatch& pb = pl.batch(0);
  CHECK(pb.wrs.size() == 2);
  CHECK(pb.wrs[0].num_sge == 2 && pb.wrs[0].bytes == 16 && pb.wrs[1].remote_offset == 116);
  CHECK(pb.sges[pb.wrs[1].first_sge].addr == 3000);
  // Not remote-contiguous: separate requests; a different lkey cannot extend an SGE.
  WriteReq c[] = {data(0, 0, 8, 10), data(0, 16, 8, 18), data(0, 24, 8, 26)};
  c[2].lkey = 8;
  pl.plan(c, 3, &deferred);
  CHECK(pl.batch(0).wrs.size() == 2 && pl.batch(0).wrs[1].num_sge == 2);
  // Zero-byte data moves nothing and plans nothing.
  const WriteReq z = data(0, 0, 0, 0);
  CHECK(pl.plan(&z, 1, &deferred) == 1 && pl.plannedPeers().empty());
}

void testFlagInLine() {
  PostPlanner pl(1, config(CompletionMode::kFlagInLine, 64, 64, 64, 4));
  std::vector<WriteReq> deferred;
  // LL-style: the flag continues the data in remote memory: one write, the flag its last bytes.
  const WriteReq a[] = {data(0, 0, 56, 100), flag(0, 56, 156), data(0, 64, 8, 164)};
  pl.plan(a, 3, &deferred);
  const PeerBatch& b = pl.batch(0);
  CHECK(b.wrs.size() == 2);  // data after a flag never joins the flag's write
  CHECK(b.wrs[0].bytes == 64 && b.wrs[0].carries_signal && !b.wrs[0].fence);
  CHECK(b.wrs[0].num_sge == 1 && b.wrs[0].inline_data);
  CHECK(!b.wrs[1].carries_signal && b.wrs[1].remote_offset == 64);
  // A flag elsewhere falls back to a separate (fenced) flag write.
  const WriteReq c[] = {data(0, 64, 100, 200), flag(0, 8, 300)};
  pl.plan(c, 2, &deferred);
  CHECK(pl.batch(0).wrs.size() == 2 && pl.batch(0).wrs[1].fence);
  CHECK(pl.batch(0).wrs[1].carries_signal && pl.batch(0).wrs[1].bytes == 8);
  // Flag-write mode never merges, even when contiguous.
  PostPlanner fw(1, config(CompletionMode::kFlagWrite, 64, 64, 64, 4));
  fw.plan(a, 2, &deferred);
  CHECK(fw.batch(0).wrs.size() == 2 && fw.batch(0).wrs[1].fence);
  // Without fencing asked for, the separate flag write is not fenced.
  PlannerConfig nf = config(CompletionMode::kFlagWrite, 64, 64, 64, 4);
  nf.fence_flag_writes = false;
  PostPlanner nfp(1, nf);
  nfp.plan(a, 2, &deferred);
  CHECK(!nfp.batch(0).wrs[1].fence);
  // A signal must stage exactly 8 bytes here.
  const WriteReq bad = flag(0, 0, 0, 16);
  CHECK_THROWS(pl.plan(&bad, 1, &deferred));
}

void testWriteWithImm() {
  PostPlanner pl(2, config(CompletionMode::kWriteWithImm, 64, 64, 32, 4));
  std::vector<WriteReq> deferred;
  std::vector<WriteReq> reqs;
  for (int i = 0; i < 6; ++i) {
    reqs.push_back(data(1, 64 * i, 8, 1000 + 100 * i));
    reqs.push_back(flag(1, 64 * i + 56, 1008 + 100 * i, kLandingRecordBytes));
  }
  pl.plan(reqs.data(), reqs.size(), &deferred);
  const PeerBatch& b = pl.batch(1);
  CHECK(b.wrs.size() == 12);
  for (int i = 0; i < 6; ++i) {
    const PlannedWr& s = b.wrs[2 * i + 1];
    CHECK(s.with_imm && s.carries_signal && s.target == WrTarget::kLanding);
    CHECK(s.imm == static_cast<uint32_t>(i % 4));  // 4 landing slots, reused in turn
    CHECK(s.remote_offset == (i % 4) * kLandingRecordBytes && s.bytes == 16 && s.inline_data);
    CHECK(!s.fence && !b.wrs[2 * i].with_imm && b.wrs[2 * i].target == WrTarget::kInbox);
  }
  const WriteReq bad = flag(1, 0, 0, kFlagBytes);
  CHECK_THROWS(pl.plan(&bad, 1, &deferred));
  CHECK_THROWS(PostPlanner(2, [] {
    PlannerConfig c = config(CompletionMode::kWriteWithImm, 8, 8, 0, 1);
    c.imm_slots = 0;
    return c;
  }()));
}

void testQueueBounds() {
  PostPlanner pl(3, config(CompletionMode::kFlagWrite, 4, 100, 0, 1));
  std::vector<WriteReq> deferred;
  std::vector<WriteReq> reqs;
  for (int i = 0; i < 6; ++i) {
    reqs.push_back(data(2, 128 * i, 8, 1000 * i, i + 1));  // never contiguous
    reqs.push_back(data(0, 128 * i, 8, 50000 + 1000 * i, i + 1));
  }
  CHECK(pl.plan(reqs.data(), reqs.size(), &deferred) == 8);
  // Batches in order of first appearance; 4 each; the 4th fills the queue, so it is signalled.
  CHECK(pl.plannedPeers().size() == 2 && pl.plannedPeers()[0] == 2 && pl.plannedPeers()[1] == 0);
  for (int p : {0, 2}) {
    const PeerBatch& b = pl.batch(p);
    CHECK(b.wrs.size() == 4 && pl.outstanding(p) == 4);
    for (int i = 0; i < 4; ++i) CHECK(b.wrs[i].signaled == (i == 3));
  }
  // The rest comes back deferred, in order, per peer.
  CHECK(deferred.size() == 4);
  CHECK(deferred[0].peer == 2 && deferred[0].tag == 5 && deferred[2].peer == 2 &&
        deferred[2].tag == 6);
  // Nothing more fits until a completion.
  std::vector<WriteReq> again;
  CHECK(pl.plan(deferred.data(), deferred.size(), &again) == 0 && again.size() == 4);
  CHECK(pl.plannedPeers().empty());
  int peer = -1;
  CHECK(pl.complete(PostPlanner::makeWrId(2, 3), &peer) == 4 && peer == 2);
  CHECK(pl.outstanding(2) == 0 && pl.outstanding(0) == 4);
  std::vector<WriteReq> rest;
  CHECK(pl.plan(again.data(), again.size(), &rest) == 2 && rest.size() == 2);
  CHECK(rest[0].peer == 0 && rest[1].peer == 0);
  // signal_last asks for a completion of each batch's last request.
  CHECK(!pl.batch(2).wrs.back().signaled);
  pl.complete(PostPlanner::makeWrId(0, 3), &peer);
  std::vector<WriteReq> none;
  const WriteReq one = data(0, 0, 8, 1, 99);
  CHECK(pl.plan(&one, 1, &none, /*signal_last=*/true) == 1 && pl.batch(0).wrs[0].signaled);
  CHECK(pl.complete(pl.batch(0).wrs[0].wr_id, &peer) == 99 && pl.outstanding(0) == 0);

  // A peer's order holds: once one of its requests is deferred, later ones are too, even if a
  // later one could have merged into the batch.
  PostPlanner one_deep(1, config(CompletionMode::kFlagWrite, 1, 1, 0, 4));
  const WriteReq seq[] = {data(0, 0, 8, 0), data(0, 100, 8, 100), data(0, 8, 8, 8)};
  std::vector<WriteReq> d2;
  CHECK(one_deep.plan(seq, 3, &d2) == 1 && d2.size() == 2);
  CHECK(d2[0].offset == 100 && d2[1].offset == 8);  // offset 8 could have merged: it waits
  CHECK(one_deep.batch(0).wrs.size() == 1 && one_deep.batch(0).wrs[0].bytes == 8);
  CHECK(one_deep.batch(0).wrs[0].signaled);  // queue of one: every request fills it
}

void testTagSpan() {
  // Tags are the caller's staging positions: a request is signalled once the tags ran
  // signal_tag_span past the last signalled one, merged requests included.
  PlannerConfig c = config(CompletionMode::kFlagWrite, 64, 1000, 0, 4);
  c.signal_tag_span = 100;
  PostPlanner pl(1, c);
  std::vector<WriteReq> d;
  const WriteReq reqs[] = {data(0, 0, 40, 0, 40),      data(0, 1000, 40, 40, 80),
                           data(0, 1040, 40, 80, 120), data(0, 2000, 8, 120, 128),
                           data(0, 3000, 8, 128, 136), data(0, 4000, 90, 136, 226),
                           data(0, 5000, 8, 226, 234)};
  pl.plan(reqs, 7, &d);
  const PeerBatch& b = pl.batch(0);
  CHECK(b.wrs.size() == 6);
  CHECK(!b.wrs[0].signaled);
  CHECK(b.wrs[1].bytes == 80 && b.wrs[1].signaled);  // tag 120 after the merge: 120 >= 0 + 100
  CHECK(!b.wrs[2].signaled && !b.wrs[3].signaled);   // 128, 136 < 120 + 100
  CHECK(b.wrs[4].signaled);                          // 226 >= 220
  CHECK(!b.wrs[5].signaled);
  int peer = -1;
  CHECK(pl.complete(b.wrs[1].wr_id, &peer) == 120 && pl.complete(b.wrs[4].wr_id, &peer) == 226);
}

void testWrIds() {
  const uint64_t id = PostPlanner::makeWrId(12345, (1ull << 48) + 77);
  CHECK(PostPlanner::wrPeer(id) == 12345 && PostPlanner::wrSeq(id) == 77);
  CHECK(!PostPlanner::wrIsRecv(id));
  const uint64_t rid = PostPlanner::makeWrId(0x7fff, 5, true);
  CHECK(PostPlanner::wrIsRecv(rid) && PostPlanner::wrPeer(rid) == 0x7fff);
  CHECK_THROWS(PostPlanner(0, PlannerConfig{}));
  CHECK_THROWS(PostPlanner(1 << 15, PlannerConfig{}));
  PlannerConfig zero;
  zero.sq_depth = 0;
  CHECK_THROWS(PostPlanner(1, zero));
  PostPlanner pl(2, PlannerConfig{});
  std::vector<WriteReq> d;
  const WriteReq stray = data(2, 0, 8, 0);
  CHECK_THROWS(pl.plan(&stray, 1, &d));
}

// What the randomized runs exercised, so that a change that stops them reaching a case shows.
struct Coverage {
  size_t merged_flags = 0, multi_sge = 0, deferred = 0, full_queue = 0, imm = 0, inline_wrs = 0;
} coverage;

// Randomized: plan, "post" (apply to simulated remote memory), complete in per-peer order at
// random times, until everything went out; the remote memory must equal in-order application.
void simulate(CompletionMode mode, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](uint32_t lo, uint32_t hi) {
    return static_cast<uint32_t>(std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
  };
  const int npeers = static_cast<int>(pick(1, 4));
  PlannerConfig cfg = config(mode, pick(1, 12), pick(1, 8), pick(0, 48), pick(1, 4));
  cfg.imm_slots = mode == CompletionMode::kWriteWithImm ? pick(1, 6) : 0;
  cfg.signal_tag_span = pick(0, 1) ? 0 : pick(16, 200);
  PostPlanner pl(npeers, cfg);
  constexpr size_t kInbox = 512;
  std::vector<uint8_t> local(1 << 16);
  for (auto& b : local) b = static_cast<uint8_t>(rng());
  std::vector<std::vector<uint8_t>> remote(npeers, std::vector<uint8_t>(kInbox, 0));
  std::vector<std::vector<uint8_t>> expect = remote;
  std::vector<std::vector<uint8_t>> landing(npeers, std::vector<uint8_t>(cfg.imm_slots * 16 + 16));
  std::vector<std::deque<uint64_t>> inflight(npeers);  // signalled wr_ids, in post order
  std::vector<uint64_t> last_tag(npeers, 0), tags(npeers, 0);
  std::vector<uint64_t> planned_tag(npeers, 0), covered_tag(npeers, 0);  // for signal_tag_span
  uint64_t local_pos = 0;
  std::set<uint64_t> flag_values;  // a flag-carrying write must end with one of these
  std::vector<WriteReq> pending, deferred;
  size_t issued = 0;
  const size_t total = 400;
  while (issued < total || !pending.empty()) {
    // Issue a few writes (runs of contiguous data, and signals).
    for (uint32_t k = pick(0, 6); k > 0 && issued < total; --k, ++issued) {
      const int p = static_cast<int>(pick(0, static_cast<uint32_t>(npeers - 1)));
      const bool sig = pick(0, 3) == 0;
      WriteReq r;
      r.peer = p;
      r.is_signal = sig;
      r.lkey = pick(0, 5) == 0 ? 2 : 1;
      if (sig) {
        r.offset = 8 * pick(0, kInbox / 8 - 1);
        if (!pending.empty() && pending.back().peer == p && !pending.back().is_signal) {
          const uint64_t end = pending.back().offset + pending.back().bytes;
          if (end % 8 == 0 && end + 8 <= kInbox && pick(0, 1)) r.offset = end;  // LL-style
        }
        const uint64_t value = rng();
        r.bytes = mode == CompletionMode::kWriteWithImm ? 16 : 8;
        if (local_pos + 16 > local.size()) local_pos = 0;
        const LandingRecord rec{r.offset, value};
        std::memcpy(&local[local_pos],
                    mode == CompletionMode::kWriteWithImm ? static_cast<const void*>(&rec)
                                                          : static_cast<const void*>(&value),
                    r.bytes);
        std::memcpy(&expect[p][r.offset], &value, 8);
        flag_values.insert(value);
      } else {
        r.bytes = pick(0, 1) ? 8 * pick(1, 8) : pick(1, 64);
        r.offset =
            pick(0, 1)
                ? (pending.empty() ? 0
                                   : (pending.back().offset + pending.back().bytes) % (kInbox - 64))
                : pick(0, kInbox - 65);
        if (local_pos + r.bytes > local.size()) local_pos = 0;
        std::memcpy(&expect[p][r.offset], &local[local_pos], r.bytes);
      }
      r.local_addr = local_pos;
      local_pos += pick(0, 1) ? r.bytes : r.bytes + pick(1, 8);  // contiguous or not locally
      r.tag = tags[p] += r.bytes;                                // like staging positions
      pending.push_back(r);
    }
    // Plan and "post".
    deferred.clear();
    pl.plan(pending.data(), pending.size(), &deferred, pick(0, 9) == 0);
    coverage.deferred += deferred.size();
    for (int p : pl.plannedPeers()) {
      const PeerBatch& b = pl.batch(p);
      CHECK(b.peer == p && !b.wrs.empty());
      CHECK(pl.outstanding(p) <= cfg.sq_depth);  // never overflows
      for (const PlannedWr& w : b.wrs) {
        planned_tag[p] = std::max(planned_tag[p], w.tag);
        if (w.signaled) covered_tag[p] = planned_tag[p];
        CHECK(w.num_sge >= 1 && w.num_sge <= cfg.max_sge);
        CHECK(w.inline_data == (cfg.max_inline > 0 && w.bytes <= cfg.max_inline));
        std::vector<uint8_t> bytes;
        for (uint32_t s = 0; s < w.num_sge; ++s) {
          const abi::Sge& g = b.sges[w.first_sge + s];
          bytes.insert(bytes.end(), &local[g.addr], &local[g.addr] + g.length);
        }
        CHECK(bytes.size() == w.bytes);
        if (w.carries_signal && !w.with_imm) {
          uint64_t tail;
          std::memcpy(&tail, bytes.data() + bytes.size() - 8, 8);
          CHECK(flag_values.count(tail) == 1);  // the flag is the last bytes of its write
        }
        if (w.target == WrTarget::kLanding) {
          CHECK(w.with_imm && w.remote_offset == w.imm * 16ull && w.imm < cfg.imm_slots);
          std::memcpy(&landing[p][w.remote_offset], bytes.data(), 16);
          LandingRecord rec;  // the receiver's proxy: read the record, store the flag
          std::memcpy(&rec, &landing[p][w.imm * 16ull], 16);
          std::memcpy(&remote[p][rec.offset], &rec.value, 8);
        } else {
          CHECK(w.remote_offset + w.bytes <= kInbox);
          std::memcpy(&remote[p][w.remote_offset], bytes.data(), bytes.size());
        }
        if (w.signaled) inflight[p].push_back(w.wr_id);
        coverage.merged_flags += w.carries_signal && !w.with_imm && w.bytes > 8 ? 1 : 0;
        coverage.multi_sge += w.num_sge > 1 ? 1 : 0;
        coverage.imm += w.with_imm ? 1 : 0;
        coverage.inline_wrs += w.inline_data ? 1 : 0;
      }
    }
    // Unsignalled requests never hold signal_tag_span or more of the tags (the caller's staging).
    for (int p = 0; p < npeers; ++p)
      if (cfg.signal_tag_span > 0) CHECK(planned_tag[p] - covered_tag[p] < cfg.signal_tag_span);
    pending.swap(deferred);
    // Liveness: a full queue always has a signalled request in flight to free it.
    for (int p = 0; p < npeers; ++p)
      if (pl.outstanding(p) >= cfg.sq_depth) {
        CHECK(!inflight[p].empty());
        ++coverage.full_queue;
      }
    // Complete some signalled requests, in per-peer post order.
    for (int p = 0; p < npeers; ++p) {
      while (!inflight[p].empty() && pick(0, 2) != 0) {
        int got = -1;
        const uint64_t tag = pl.complete(inflight[p].front(), &got);
        CHECK(got == p && tag >= last_tag[p] && tag <= tags[p]);
        last_tag[p] = tag;
        inflight[p].pop_front();
      }
    }
  }
  // Drain: ask for a completion of the tail and retire everything.
  std::vector<WriteReq> none;
  for (int p = 0; p < npeers; ++p) {
    while (!inflight[p].empty()) {
      int got = -1;
      pl.complete(inflight[p].front(), &got);
      inflight[p].pop_front();
    }
  }
  for (int p = 0; p < npeers; ++p) {
    if (remote[p] != expect[p]) {
      std::fprintf(stderr, "simulate(mode %d, seed %llu): peer %d memory differs\n",
                   static_cast<int>(mode), static_cast<unsigned long long>(seed), p);
      std::exit(1);
    }
  }
}

}  // namespace

int main() {
  testSlotMessage();
  testMerging();
  testFlagInLine();
  testWriteWithImm();
  testQueueBounds();
  testTagSpan();
  testWrIds();
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    simulate(CompletionMode::kFlagInLine, seed);
    simulate(CompletionMode::kFlagWrite, seed);
    simulate(CompletionMode::kWriteWithImm, seed);
  }
  CHECK(coverage.merged_flags > 0 && coverage.multi_sge > 0 && coverage.deferred > 0);
  CHECK(coverage.full_queue > 0 && coverage.imm > 0 && coverage.inline_wrs > 0);
  std::printf(
      "randomized: %zu in-line flags, %zu multi-SGE, %zu deferred, %zu full queues, "
      "%zu immediates, %zu inline\n",
      coverage.merged_flags, coverage.multi_sge, coverage.deferred, coverage.full_queue,
      coverage.imm, coverage.inline_wrs);
  std::puts("test_ib_planner: ok");
  return 0;
}
