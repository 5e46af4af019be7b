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
};

class Proxy {
 public:
  Proxy(ProxyHandler& handler, const Config& cfg) : handler_(handler), cfg_(cfg) {}
  ~Proxy() { stop(); }
  void start();
  void stop();  // joins the thread; idempotent
  int boundCpu() const { return bound_cpu_.load(); }
  // Pins the running proxy thread to `cpu` (must be in the allowed set). Returns success.
  bool pin(int cpu);
  // How long the proxy stays hot after work (the GPU proxy path wants longer than the CPU path).
  void setSpinUs(uint64_t us) { spin_us_.store(us, std::memory_order_relaxed); }

 private:
  void run();
  ProxyHandler& handler_;
  const Config cfg_;
  std::atomic<bool> stop_{false};
  std::atomic<int> bound_cpu_{-1};
  std::atomic<uint64_t> spin_us_{0};
  std::thread thread_;
};

// Pins the calling thread to `cpu` if it is in the process's allowed set. Returns success.
bool pinCurrentThread(int cpu);

}  // namespace resident
