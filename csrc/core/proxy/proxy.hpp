// The resident proxy thread of a communicator: started once, it drains the trigger FIFO
// (posting writes through the transport), polls network transports, and drives async ops.
// It polls hot while there is work and backs off to short sleeps when idle; no condition
// variable, no wake-up system call on the op path.
#pragma once

#include <atomic>
#include <thread>

#include "core/config.hpp"

namespace resident {

class ProxyHandler {
 public:
  virtual ~ProxyHandler() = default;
  // One polling pass; returns true if it did anything.
  virtual bool proxyPoll() = 0;
  // True while another thread does the passes (a caller waiting on its op drives the transport
  // itself): the proxy thread then sleeps instead of contending for the core.
  virtual bool proxyStandby() const { return false; }
  // The proxy thread ran a pass of its own, or is about to sleep (proxyStandby() said so just
  // now): what proxyStandby() compares with at its next look.
  virtual void proxyMark() {}
  // After each standby sleep, on the proxy thread: what still falls to it while it stands by.
  virtual void standbyTick() {}
};

class Proxy {
 public:
  // While callers drive the transport themselves (or, on a small machine, no op is in flight),
  // the proxy sleeps, from the first to the last value as long as it finds it may each time: on
  // a small machine (2 cores, 2 ranks) each wake-up preempts a spinning caller, and its peer
  // waits as long (CPU tensors over tcp, 2 ranks, 2 cores: 14-25 us per 8 B all_reduce with 1
  // ms, 23-89 us with 100 us; the slowest 1% of ops 43-51 us with 1 ms, 20-25 us with 10 ms).
  // It is woken where its work is due at once: by the last waiter to leave
  // (Communicator::waitersGone), by a GPU path that starts polling through it, and to stop. The
  // timeout bounds the rest: ops left in flight where cores are scarce, triggers a finished op
  // left (Communicator::proxyStandby), the peer checks of an idle group.
  static constexpr long kStandbyFirstNs = 50 * 1000;
  static constexpr long kStandbyLastNs = 10 * 1000 * 1000;

  // standby_first_ns / standby_last_ns: the sleeps of a standby (tests lengthen them).
  Proxy(ProxyHandler& handler, const Config& cfg, long standby_first_ns = kStandbyFirstNs,
        long standby_last_ns = kStandbyLastNs)
      : handler_(handler),
        cfg_(cfg),
        standby_first_ns_(standby_first_ns),
        standby_last_ns_(standby_last_ns) {}
  ~Proxy() { stop(); }
  void start();
  void stop();  // joins the thread; idempotent
  int boundCpu() const { return bound_cpu_.load(); }
  // Pins the running proxy thread to `cpu` (must be in the allowed set). Returns success.
  bool pin(int cpu);
  // How long the proxy stays hot after work (the GPU proxy path wants longer than the CPU path).
  void setSpinUs(uint64_t us) { spin_us_.store(us, std::memory_order_relaxed); }
  // Ends a standby sleep at once (any thread; a system call only while the proxy sleeps). The
  // caller changes what proxyStandby() reads first: the proxy re-reads it after announcing its
  // sleep, so that either it sees the change or this call sees the sleep.
  void wake();

 private:
  void run();
  void standbySleep(long ns);
  ProxyHandler& handler_;
  const Config cfg_;
  const long standby_first_ns_;
  const long standby_last_ns_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> sleeping_{0};  // 1 from just before a standby sleep's last check to its end
  std::atomic<int> bound_cpu_{-1};
  std::atomic<uint64_t> spin_us_{0};
  std::thread thread_;
};

// Pins the calling thread to `cpu` if it is in the process's allowed set. Returns success.
bool pinCurrentThread(int cpu);

}  // namespace resident
