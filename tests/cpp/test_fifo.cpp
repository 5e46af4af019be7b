// TriggerFifo: order, wrap-around over many laps, full detection, consumed(), pending() as a
// third thread reads it, and a two-thread stress.
#include <atomic>
#include <cstdio>
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
    CHECK(!fifo.pending());
    for (uint64_t lap = 0; lap < 5; ++lap) {
      for (uint64_t i = 0; i < 8; ++i) {
        CHECK(fifo.tryPush(lap * 100 + i, i + 1));
        CHECK(fifo.pending());
      }
      CHECK(!fifo.tryPush(999, 1));  // full
      for (uint64_t i = 0; i < 8; ++i) {
        CHECK(fifo.pending());
        CHECK(fifo.consumed() == lap * 8 + i);  // pushes do not move it, pops do
        CHECK(fifo.tryPop(t));
        CHECK(t.fst == lap * 100 + i);
        CHECK(t.snd == i + 1);
      }
      CHECK(!fifo.tryPop(t));
      CHECK(!fifo.pending());  // every lap: the lap bit of the slot after the last pop
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
    CHECK(!fifo.pending());
  }
  {
    // pending() read by a third thread while a producer pushes and a consumer pops: no race
    // on the consumer's state (run under the sanitizers), and false once everything is taken.
    TriggerFifo fifo(16);
    constexpr uint64_t kCount = 50000;
    std::atomic<bool> done{false};
    std::thread producer([&] {
      for (uint64_t i = 0; i < kCount;) {
        if (fifo.tryPush(i, 1)) ++i;
      }
    });
    std::thread consumer([&] {
      Trigger t;
      for (uint64_t expect = 0; expect < kCount;) {
        if (fifo.tryPop(t)) {
          CHECK(t.fst == expect);
          ++expect;
        }
      }
      done.store(true);
    });
    uint64_t seen = 0;
    while (!done.load()) seen += fifo.pending() ? 1 : 0;
    producer.join();
    consumer.join();
    CHECK(!fifo.pending());
    std::printf("test_fifo: pending() seen true %llu times while the threads ran\n",
                static_cast<unsigned long long>(seen));
  }
  std::puts("test_fifo: ok");
  return 0;
}
