// PendingFlusher: an op held past a tick is launched by the flusher, exactly once; an op its
// owner launches first is never launched again; the thread sleeps when nothing is held and
// wakes on notePending(); destruction joins it, asleep or not. The owner is a model: a held
// op number under a mutex, and a count of launches per op. Bounds are generous (seconds) so
// that a slow, loaded machine passes; nothing here measures speed.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/pending_flusher.hpp"

using resident::PendingFlusher;
using Clock = std::chrono::steady_clock;

namespace {

struct Owner {
  std::mutex mu;
  std::atomic<uint64_t> held{0};
  std::vector<int> launches;  // per op number (under mu)
  std::vector<int> by_flusher;
  explicit Owner(size_t n) : launches(n + 1, 0), by_flusher(n + 1, 0) {}
  void hold(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu);
    held.store(n);
  }
  int launched(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu);
    return launches[n];
  }
  int flushed(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu);
    return by_flusher[n];
  }
  bool launchIfHeld(uint64_t n, bool flusher) {
    std::lock_guard<std::mutex> lock(mu);
    if (held.load() != n) return false;
    held.store(0);
    ++launches[n];
    if (flusher) ++by_flusher[n];
    return true;
  }
};

bool waitFor(const std::function<bool()>& cond, double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (!cond()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::unique_ptr<PendingFlusher> flusherFor(Owner& o, std::chrono::microseconds tick) {
  return std::make_unique<PendingFlusher>(
      tick, [&o] { return o.held.load(); }, [&o](uint64_t n) { o.launchIfHeld(n, true); });
}

}  // namespace

int main() {
  using std::chrono::microseconds;
  {  // an op nobody launches is launched by the flusher, once
    Owner o(1);
    auto f = flusherFor(o, microseconds(200));
    o.hold(1);
    f->notePending();
    CHECK(waitFor([&] { return o.held.load() == 0; }, 10.0));
    CHECK(o.launched(1) == 1 && o.flushed(1) == 1);
    CHECK(f->flushes() >= 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(o.launched(1) == 1);  // a stale number is never launched again
  }
  {  // ops held for random times, launched by their owner unless the flusher came first:
     // every op exactly once; ops held for a long time were the flusher's
    constexpr uint64_t kOps = 400;
    Owner o(kOps);
    auto f = flusherFor(o, microseconds(500));
    std::mt19937 rng(12345);
    std::vector<bool> long_hold(kOps + 1, false);
    for (uint64_t n = 1; n <= kOps; ++n) {
      o.hold(n);
      f->notePending();
      const int kind = static_cast<int>(rng() % 10);
      if (kind == 0) {  // held until the flusher takes it (bounded)
        long_hold[n] = true;
        CHECK(waitFor([&] { return o.held.load() != n; }, 10.0));
      } else if (kind < 4) {
        std::this_thread::sleep_for(microseconds(rng() % 1500));
      }
      o.launchIfHeld(n, false);  // the owner's own launch, if still held
    }
    for (uint64_t n = 1; n <= kOps; ++n) {
      CHECK(o.launched(n) == 1);
      if (long_hold[n]) CHECK(o.flushed(n) == 1);
    }
  }
  {  // idle: the thread sleeps; notePending wakes it and the held op is launched
    Owner o(3);
    auto f = flusherFor(o, microseconds(100));
    CHECK(waitFor([&] { return f->sleeping(); }, 10.0));
    o.hold(1);
    f->notePending();
    CHECK(waitFor([&] { return o.launched(1) == 1; }, 10.0));
    CHECK(waitFor([&] { return f->sleeping(); }, 10.0));  // asleep again
    o.hold(2);
    f->notePending();
    CHECK(waitFor([&] { return o.launched(2) == 1; }, 10.0));
  }
  {  // destruction joins promptly, asleep and awake
    Owner o(1);
    auto t0 = Clock::now();
    {
      auto f = flusherFor(o, microseconds(100));
      CHECK(waitFor([&] { return f->sleeping(); }, 10.0));
    }
    {
      auto f = flusherFor(o, std::chrono::seconds(30));  // mid-tick: the wait ends on stop
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    CHECK(Clock::now() - t0 < std::chrono::seconds(20));
  }
  std::puts("ok");
  return 0;
}
