// Monotonic clock and the bounded spin/yield/sleep policy every wait in the core uses.
#pragma once

#include <sched.h>
#include <time.h>

#include <cstdint>

namespace resident {

// clock_gettime(CLOCK_MONOTONIC) is served by the vDSO: no system call.
inline uint64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Poll hot for `spin_ns`, then yield the core for `yield_ns` (other ranks may share it),
// then sleep with exponential back-off capped at `max_sleep_ns`. reset() after progress.
class Backoff {
 public:
  Backoff(uint64_t spin_ns, uint64_t yield_ns, uint64_t max_sleep_ns)
      : spin_ns_(spin_ns), yield_ns_(yield_ns), max_sleep_ns_(max_sleep_ns) {}

  void setSpinNs(uint64_t ns) { spin_ns_ = ns; }

  void reset() {
    idle_since_ = 0;
    sleep_ns_ = kFirstSleepNs;
  }

  // One idle step. Returns the time read, if any was read (0 otherwise).
  void pause() {
    if (++calls_ & 63) {  // read the clock once every 64 idle calls
      cpuRelax();
      return;
    }
    const uint64_t now = nowNs();
    if (idle_since_ == 0) idle_since_ = now;
    const uint64_t idle = now - idle_since_;
    if (idle < spin_ns_) {
      cpuRelax();
    } else if (idle < spin_ns_ + yield_ns_) {
      sched_yield();
    } else {
      timespec ts{0, static_cast<long>(sleep_ns_)};
      nanosleep(&ts, nullptr);
      sleep_ns_ = sleep_ns_ * 2 > max_sleep_ns_ ? max_sleep_ns_ : sleep_ns_ * 2;
    }
  }

 private:
  static constexpr uint64_t kFirstSleepNs = 2000;
  uint64_t spin_ns_, yield_ns_, max_sleep_ns_;
  uint64_t idle_since_ = 0;
  uint64_t sleep_ns_ = kFirstSleepNs;
  uint32_t calls_ = 0;
};

}  // namespace resident
