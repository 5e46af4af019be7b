// The host halves of the CUDA path's channels: the GPU region layout (disjoint, aligned,
// addressable by the 32-bit offsets of a trigger) and the trigger ring the proxy drains,
// fed by a producer thread that encodes triggers exactly as the kernels do.
#include <cstring>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/gpu_layout.hpp"
#include "core/proxy/fifo.hpp"
#include "core/proxy/trigger_encoding.hpp"

using resident::GpuLayout;

static void checkLayout(int nranks, uint32_t chunk) {
  const GpuLayout lay(nranks, chunk);
  CHECK(lay.slotBytes() == static_cast<size_t>(chunk) * 2);  // 8 payload bytes per 16-byte line
  CHECK(lay.fifoOffset() >= GpuLayout::kFifoTailWord + 8);
  CHECK(lay.collIn(0) >= lay.fifoOffset() + GpuLayout::kFifoCapacity * 16);
  // Regions in order, each peer's slots back to back, nothing overlapping.
  for (int p = 0; p < nranks; ++p) {
    CHECK(lay.collIn(p + 1) - lay.collIn(p) == GpuLayout::kCollSlots * lay.slotBytes());
    CHECK(lay.p2pIn(p + 1) - lay.p2pIn(p) == GpuLayout::kP2PSlots * lay.slotBytes());
    CHECK(lay.creditIn(p + 1) - lay.creditIn(p) == 64);
    CHECK(lay.collIn(p) % 16 == 0 && lay.p2pIn(p) % 16 == 0 && lay.creditIn(p) % 64 == 0);
  }
  CHECK(lay.p2pIn(0) == lay.collIn(nranks));
  CHECK(lay.creditIn(0) == lay.p2pIn(nranks));
  CHECK(lay.totalBytes() == lay.creditIn(nranks));
  // Outbox: per destination coll slots, p2p slots and a credit line, disjoint.
  for (int p = 0; p < nranks; ++p) {
    CHECK(lay.outP2P(p) == lay.outColl(p) + GpuLayout::kCollSlots * lay.slotBytes());
    CHECK(lay.outCredit(p) == lay.outP2P(p) + GpuLayout::kP2PSlots * lay.slotBytes());
    CHECK(lay.outCredit(p) + 64 <= lay.outColl(p + 1));
  }
  CHECK(lay.outboxBytes() == lay.outColl(nranks));
  // Trigger fields: remote offsets 32 bits, local (outbox) offsets 31, a slot's lines fit.
  CHECK(lay.totalBytes() < resident::kTriggerMaxRemote);
  CHECK(lay.outboxBytes() < resident::kTriggerMaxLocal);
  CHECK(lay.slotBytes() < resident::kTriggerMaxBytes);
}

int main() {
  for (int n : {1, 2, 3, 8, 64}) {
    checkLayout(n, 2048);
    checkLayout(n, 64 * 1024);
  }
  checkLayout(64, 1u << 20);
  // The automatic chunk: 256 KiB only for a group with a network pair and at most 16 ranks, and
  // every chunk it picks lays out within the trigger fields at the largest such group.
  CHECK(GpuLayout::automaticChunk(false, 2) == 64 * 1024);
  CHECK(GpuLayout::automaticChunk(false, 8) == 64 * 1024);
  CHECK(GpuLayout::automaticChunk(true, 2) == 256 * 1024);
  CHECK(GpuLayout::automaticChunk(true, GpuLayout::kNetworkChunkMaxRanks) == 256 * 1024);
  CHECK(GpuLayout::automaticChunk(true, GpuLayout::kNetworkChunkMaxRanks + 1) == 64 * 1024);
  checkLayout(GpuLayout::kNetworkChunkMaxRanks, GpuLayout::kNetworkChunk);
  checkLayout(64, GpuLayout::kHostChunk);

  // Encoding round trip, every kind, fields at their limits.
  {
    using resident::TriggerKind;
    const uint64_t fst = resident::encodeWriteFst(0x72345670, 0xfabcdef0);
    const uint64_t snd = resident::encodeWriteSnd(63, 131072, TriggerKind::kCopy, 0);
    const auto r = resident::decodeWrite(fst, snd);
    CHECK(r.peer == 63 && r.local_offset == 0x72345670 && r.remote_offset == 0xfabcdef0 &&
          r.bytes == 131072 && r.kind == TriggerKind::kCopy && r.value == 0);
    CHECK((snd & resident::kTriggerLapBit) == 0 && (fst & resident::kTriggerLapBit) == 0);
    const uint64_t snd2 =
        resident::encodeWriteSnd(resident::kTriggerMaxPeers - 1, resident::kTriggerMaxBytes - 16,
                                 TriggerKind::kLines, 0xfffffffe);
    const auto r2 = resident::decodeWrite(fst, snd2);
    CHECK(r2.peer == resident::kTriggerMaxPeers - 1 &&
          r2.bytes == resident::kTriggerMaxBytes - 16 && r2.kind == TriggerKind::kLines &&
          r2.value == 0xfffffffe);
    CHECK((snd2 & resident::kTriggerLapBit) == 0);
    const auto r3 = resident::decodeWrite(resident::encodeWriteFst(0, 0x123440),
                                          resident::encodeWriteSnd(5, 32, TriggerKind::kFlag, 9));
    CHECK(r3.peer == 5 && r3.remote_offset == 0x123440 && r3.bytes == 32 &&
          r3.kind == TriggerKind::kFlag && r3.value == 9);
    CHECK(resident::kTriggerMaxPeers >= 64);  // kernels/exchange_args.hpp: kMaxRanks
  }

  // A slot whose second word is there but whose first is not yet (an unfenced trigger is one
  // 16-byte store, which the reader may see half done) is not taken.
  {
    std::vector<uint64_t> slots(2 * 4, 0);
    uint64_t tail_word = 0;
    resident::TriggerRingView ring(slots.data(), &tail_word, 4);
    resident::Trigger t;
    const uint64_t lap = resident::triggerLapBit(0, 4);
    slots[1] = resident::encodeWriteSnd(3, 16, resident::TriggerKind::kLines, 7) | lap;
    CHECK(!ring.tryPop(t));
    slots[0] = resident::encodeWriteFst(32, 64) | lap;
    CHECK(ring.tryPop(t));
    const auto r = resident::decodeWrite(t.fst, t.snd);
    CHECK(r.peer == 3 && r.local_offset == 32 && r.remote_offset == 64 &&
          r.kind == resident::TriggerKind::kLines && r.value == 7);
    CHECK(!ring.tryPop(t));
  }

  // readyBeyondPublished (a shutdown's drain): a complete trigger counts as waiting until the
  // pass that popped it has published the tail; a half-written one does not; nor do the
  // previous lap's slots.
  {
    std::vector<uint64_t> slots(2 * 4, 0);
    uint64_t tail_word = 0;
    resident::TriggerRingView ring(slots.data(), &tail_word, 4);
    resident::Trigger t;
    CHECK(!ring.readyBeyondPublished());
    for (uint64_t pos = 0; pos < 6; ++pos) {  // over a lap: slots 0 and 1 hold lap 0's words
      const uint64_t lap = resident::triggerLapBit(pos, 4);
      uint64_t* slot = slots.data() + 2 * (pos % 4);
      slot[1] = resident::encodeWriteSnd(1, 16, resident::TriggerKind::kFlag, 1) | lap;
      CHECK(!ring.readyBeyondPublished());  // the first word still of the previous lap
      slot[0] = resident::encodeWriteFst(0, 0) | lap;
      CHECK(ring.readyBeyondPublished());
      CHECK(ring.tryPop(t));
      CHECK(ring.readyBeyondPublished());  // popped, not yet published
      ring.publishTail();
      CHECK(!ring.readyBeyondPublished());
    }
  }

  // A producer thread writes triggers as a kernel does (fst, then snd with the lap bit by
  // release; the kinds in turn), over many laps of a small ring; the consumer view
  // sees each once, in order, and the producer respects the published tail.
  {
    constexpr uint32_t kCap = 16;
    constexpr uint64_t kCount = 100000;
    std::vector<uint64_t> slots(2 * kCap, 0);
    uint64_t tail_word = 0;
    resident::TriggerRingView ring(slots.data(), &tail_word, kCap);
    resident::Trigger t;
    CHECK(!ring.tryPop(t));
    std::thread producer([&] {
      for (uint64_t pos = 0; pos < kCount; ++pos) {
        while (pos - __atomic_load_n(&tail_word, __ATOMIC_ACQUIRE) >= kCap) {
        }
        uint64_t* s = slots.data() + 2 * (pos % kCap);
        const uint64_t lap = resident::triggerLapBit(pos, kCap);
        __atomic_store_n(s, resident::encodeWriteFst(pos, pos ^ 0x5a5a) | lap, __ATOMIC_RELAXED);
        __atomic_store_n(s + 1,
                         resident::encodeWriteSnd(static_cast<uint32_t>(pos % 7), pos % 4096,
                                                  static_cast<resident::TriggerKind>(pos % 3),
                                                  static_cast<uint32_t>(pos)) |
                             lap,
                         __ATOMIC_RELEASE);
      }
    });
    for (uint64_t expect = 0; expect < kCount;) {
      int popped = 0;
      while (ring.tryPop(t)) {
        const auto r = resident::decodeWrite(t.fst, t.snd);
        CHECK(r.local_offset == (expect & 0x7fffffffull));
        CHECK(r.remote_offset == ((expect ^ 0x5a5a) & 0xffffffffull));
        CHECK(r.peer == expect % 7 && r.bytes == expect % 4096);
        CHECK(static_cast<uint64_t>(r.kind) == expect % 3);
        CHECK(r.value == static_cast<uint32_t>(expect));
        ++expect;
        ++popped;
      }
      if (popped) ring.publishTail();
    }
    producer.join();
    CHECK(!ring.tryPop(t));
  }
  std::printf("ok\n");
  return 0;
}
