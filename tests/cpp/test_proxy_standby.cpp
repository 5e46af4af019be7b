// Proxy standby: wake() ends a standby sleep at once, whenever it comes (before the proxy
// announces its sleep, between the announcement and the futex, or during the futex), and stop()
// does too. The sleeps are a minute long here, so a lost wake-up shows as the proxy still asleep
// seconds later, not as a slow run.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "check.hpp"
#include "core/config.hpp"
#include "core/proxy/proxy.hpp"

using resident::Config;
using resident::Proxy;
using resident::ProxyHandler;

namespace {

constexpr long kMinuteNs = 60L * 1000 * 1000 * 1000;
constexpr auto kPatience = std::chrono::seconds(5);

struct Handler : ProxyHandler {
  std::atomic<bool> standby{true};
  std::atomic<uint64_t> polls{0};
  std::atomic<uint64_t> sleeps{0};
  bool proxyPoll() override {
    polls.fetch_add(1);
    return false;
  }
  bool proxyStandby() const override { return standby.load(); }
  void proxyMark() override {
    if (standby.load()) sleeps.fetch_add(1);
  }
};

// Waits until `counter` exceeds `than`; false after kPatience.
bool waitAbove(const std::atomic<uint64_t>& counter, uint64_t than) {
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (counter.load() <= than)
    if (std::chrono::steady_clock::now() > deadline) return false;
  return true;
}

}  // namespace

int main() {
  Config cfg;
  {
    // Asleep for a minute: wake() brings it back to its passes.
    Handler h;
    Proxy proxy(h, cfg, kMinuteNs, kMinuteNs);
    proxy.start();
    CHECK(waitAbove(h.sleeps, 0));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // inside the futex by now
    const uint64_t polls = h.polls.load();
    h.standby.store(false);
    proxy.wake();
    CHECK(waitAbove(h.polls, polls));
    // Asleep again: stop() ends the sleep and joins.
    h.standby.store(true);
    const uint64_t sleeps = h.sleeps.load();
    CHECK(waitAbove(h.sleeps, sleeps));
    const auto t0 = std::chrono::steady_clock::now();
    proxy.stop();
    CHECK(std::chrono::steady_clock::now() - t0 < kPatience);
  }
  {
    // The wake-up at every moment of the proxy's way into its sleep: a random delay after the
    // standby flag turns on, then off and wake(). Each round must bring a pass.
    Handler h;
    Proxy proxy(h, cfg, kMinuteNs, kMinuteNs);
    proxy.start();
    std::mt19937 rng(7);
    for (int round = 0; round < 3000; ++round) {
      const uint64_t polls = h.polls.load();
      h.standby.store(true);
      const int spins = static_cast<int>(rng() % 4000);
      for (volatile int i = 0; i < spins; ++i) {
      }
      h.standby.store(false);
      proxy.wake();
      if (!waitAbove(h.polls, polls)) {
        std::fprintf(stderr, "round %d: the proxy slept through wake()\n", round);
        return 1;
      }
    }
    proxy.stop();
  }
  std::printf("ok\n");
  return 0;
}
