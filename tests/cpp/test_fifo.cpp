// TriggerFifo: order, wrap-around over many laps, full detection, and a two-thread stress.
#include <thread>

#include "check.hpp"
#include "core/proxy/fifo.hpp"

using resident::Trigger;
using resident::TriggerFifo;

int main() {
  {
    TriggerFifo fifo(8);
    Trigger t;
    CHECK(!fifo.tryPop(t));
    CHECK(fifo.empty());
    for (uint64_t lap = 0; lap < 5; ++lap) {
      for (uint64_t i = 0; i < 8; ++i) CHECK(fifo.tryPush(lap * 100 + i, i + 1));
      CHECK(!fifo.tryPush(999, 1));  // full
      for (uint64_t i = 0; i < 8; ++i) {
        CHECK(fifo.tryPop(t));
        CHECK(t.fst == lap * 100 + i);
        CHECK(t.snd == i + 1);
      }
      CHECK(!fifo.tryPop(t));
    }
  }
  {
    // Producer and consumer on two threads: every value arrives once, in order.
    TriggerFifo fifo(64);
    constexpr uint64_t kCount = 200000;
    std::thread producer([&] {
      for (uint64_t i = 0; i < kCount;) {
        if (fifo.tryPush(i, (i * 7) & 0xffff)) ++i;
      }
    });
    Trigger t;
    for (uint64_t expect = 0; expect < kCount;) {
      if (fifo.tryPop(t)) {
        CHECK(t.fst == expect);
        CHECK(t.snd == ((expect * 7) & 0xffff));
        ++expect;
      }
    }
    producer.join();
  }
  std::puts("test_fifo: ok");
  return 0;
}
