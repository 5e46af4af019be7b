#include "core/proxy/proxy.hpp"

#include <pthread.h>
#include <sched.h>

#include "core/clock.hpp"
#include "core/log.hpp"

namespace resident {
namespace {

// While waiting callers drive the transport, the proxy checks back after a sleep that grows
// from the first to the last value as long as it finds one each time: on a small machine
// (2 cores, 2 ranks) each wake-up preempts a spinning caller (CPU tensors over tcp, 2 ranks, 2
// cores: 14-25 us per 8 B all_reduce with 1 ms, 23-89 us with 100 us), and a proxy that finds
// nobody waiting is back within 1 ms to drive the ops nobody waits on and GPU triggers.
constexpr long kStandbyFirstNs = 50 * 1000;
constexpr long kStandbyLastNs = 1000 * 1000;

}  // namespace

bool pinCurrentThread(int cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof(allowed), &allowed) != 0 ||
      !CPU_ISSET(cpu, &allowed)) {
    return false;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0;
}

bool Proxy::pin(int cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (!thread_.joinable() || cpu < 0 || cpu >= CPU_SETSIZE ||
      sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || !CPU_ISSET(cpu, &allowed)) {
    return false;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (pthread_setaffinity_np(thread_.native_handle(), sizeof(one), &one) != 0) return false;
  bound_cpu_.store(cpu);
  return true;
}

void Proxy::start() {
  stop_.store(false);
  thread_ = std::thread([this] { run(); });
}

void Proxy::stop() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

void Proxy::run() {
  pthread_setname_np(pthread_self(), "resident-proxy");
  if (cfg_.proxy_cpu >= 0) {
    if (pinCurrentThread(cfg_.proxy_cpu)) {
      bound_cpu_.store(cfg_.proxy_cpu);
      RLOG_INFO("proxy bound to cpu %d", cfg_.proxy_cpu);
    } else {
      RLOG_WARN("RESIDENT_PROXY_CPU=%d is not in this process's allowed CPU set; not pinned",
                cfg_.proxy_cpu);
    }
  }
  // Hot for proxy_spin_us after the last work, then yield/sleep with back-off.
  spin_us_.store(cfg_.proxy_spin_us);
  uint64_t spin_us = cfg_.proxy_spin_us;
  Backoff backoff(spin_us * 1000, cfg_.yield_us * 1000, cfg_.max_sleep_us * 1000);
  long standby_ns = kStandbyFirstNs;
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t want = spin_us_.load(std::memory_order_relaxed);
    if (want != spin_us) backoff.setSpinNs((spin_us = want) * 1000);
    if (handler_.proxyStandby()) {
      timespec ts{0, standby_ns};
      nanosleep(&ts, nullptr);
      standby_ns = standby_ns * 2 > kStandbyLastNs ? kStandbyLastNs : standby_ns * 2;
      backoff.reset();  // hot again as soon as the waiter is gone
      continue;
    }
    standby_ns = kStandbyFirstNs;
    if (handler_.proxyPoll())
      backoff.reset();
    else
      backoff.pause();
  }
}

}  // namespace resident
