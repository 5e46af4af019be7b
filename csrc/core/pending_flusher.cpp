#include "core/pending_flusher.hpp"

#include <utility>

namespace resident {

PendingFlusher::PendingFlusher(std::chrono::microseconds tick, std::function<uint64_t()> pending,
                               std::function<void(uint64_t)> flush)
    : tick_(tick), pending_(std::move(pending)), flush_(std::move(flush)) {
  thread_ = std::thread([this] { run(); });
}

PendingFlusher::~PendingFlusher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void PendingFlusher::notePending() {
  // The owner published the op's number (sequentially consistent) before this load, and the
  // thread sets sleeping_ before it reads that number: one of the two sees the other.
  if (!sleeping_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  sleeping_.store(false);
  cv_.notify_one();
}

void PendingFlusher::run() {
  uint64_t seen = 0;  // the op held at the previous tick
  int idle = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    const uint64_t now = pending_();
    if (now != 0 && now == seen) {
      flush_(now);  // held for a whole tick: nobody is coming for it
      flushes_.fetch_add(1, std::memory_order_relaxed);
      seen = 0;
    } else {
      seen = now;
    }
    idle = now != 0 ? 0 : idle + 1;
    lock.lock();
    if (stop_) break;
    if (idle >= kIdleTicks) {
      sleeping_.store(true);
      lock.unlock();
      const bool held = pending_() != 0;
      lock.lock();
      if (held) sleeping_.store(false);
      cv_.wait(lock, [this] { return stop_ || !sleeping_.load(); });
      idle = 0;
      seen = 0;
      continue;
    }
    cv_.wait_for(lock, tick_, [this] { return stop_; });
  }
}

}  // namespace resident
