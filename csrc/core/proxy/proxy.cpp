#include "core/proxy/proxy.hpp"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>

#include "core/clock.hpp"
#include "core/log.hpp"

namespace resident {

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
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
}

void Proxy::wake() {
  if (sleeping_.load() != 0 && sleeping_.exchange(0) != 0)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&sleeping_), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
}

void Proxy::standbySleep(long ns) {
  // Announced before the last check (seq_cst, as the wakers' change and read): a waker either
  // finds the announcement, or its change is seen by that check.
  sleeping_.store(1);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the check's loads after the store
  if (!stop_.load() && handler_.proxyStandby()) {
    handler_.proxyMark();
    const timespec ts{ns / 1000000000, ns % 1000000000};
    // Returns at once if a waker already cleared the word.
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&sleeping_), FUTEX_WAIT_PRIVATE, 1, &ts, nullptr,
            0);
  }
  sleeping_.store(0, std::memory_order_relaxed);
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
  long standby_ns = standby_first_ns_;
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t want = spin_us_.load(std::memory_order_relaxed);
    if (want != spin_us) backoff.setSpinNs((spin_us = want) * 1000);
    if (handler_.proxyStandby()) {
      standbySleep(standby_ns);
      handler_.standbyTick();
      standby_ns = standby_ns > standby_last_ns_ / 2 ? standby_last_ns_ : standby_ns * 2;
      backoff.reset();  // hot again as soon as the waiter is gone
      continue;
    }
    standby_ns = standby_first_ns_;
    const bool moved = handler_.proxyPoll();
    handler_.proxyMark();
    if (moved)
      backoff.reset();
    else
      backoff.pause();
  }
}

}  // namespace resident
