// A thread that launches a held operation nobody launched in time. The CUDA path holds a
// send/recv back (RESIDENT_GPU_P2P_STREAM=auto) in the hope that its own wait() comes next
// and it can run on the caller's stream; if the caller instead blocks the host on something
// else (another backend's barrier, a peer that waits for this very message), the op must
// still start, as an NCCL isend would. An op seen held at two ticks in a row is flushed.
// Torch-free: the owner supplies what "held" and "launch" mean.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace resident {

class PendingFlusher {
 public:
  // `pending()`: the number of the op held now (0: none). `flush(n)`: launch op n if it is
  // still the one held (numbers are never reused). Both run on the flusher's thread; `flush`
  // must not throw, nor drop the last reference to this object (it cannot join itself).
  PendingFlusher(std::chrono::microseconds tick, std::function<uint64_t()> pending,
                 std::function<void(uint64_t)> flush);
  ~PendingFlusher();  // stops the thread and joins it
  PendingFlusher(const PendingFlusher&) = delete;
  PendingFlusher& operator=(const PendingFlusher&) = delete;

  // Called after an op became pending (its number already visible to `pending()`): wakes the
  // thread if it went to sleep; otherwise one atomic load.
  void notePending();
  uint64_t flushes() const { return flushes_.load(std::memory_order_relaxed); }
  bool sleeping() const { return sleeping_.load(); }

  // Ticks without a held op after which the thread sleeps until notePending().
  static constexpr int kIdleTicks = 100;

 private:
  void run();

  const std::chrono::microseconds tick_;
  const std::function<uint64_t()> pending_;
  const std::function<void(uint64_t)> flush_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                  // under mu_
  std::atomic<bool> sleeping_{false};  // sequentially consistent with the owner's op number
  std::atomic<uint64_t> flushes_{0};
  std::thread thread_;
};

}  // namespace resident
