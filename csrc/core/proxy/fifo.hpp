// Single-producer single-consumer FIFO of 16-byte triggers, the hand-off from whoever runs an
// operation (a CPU thread: the engine's sends to proxied peers) to the resident proxy. A slot is
// valid when the top bit of its second word equals the lap parity of its position, so the consumer
// never clears slots; the consumer publishes its tail for the producer's flow control. The memory
// may be ordinary or mapped host memory: the layout has no pointers. The GPU producer (the
// device half): kernels/fifo_device.cuh.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "core/proxy/trigger_encoding.hpp"

namespace resident {

struct Trigger {
  uint64_t fst;  // payload (a sequence number or a value)
  uint64_t snd;  // top bit: lap parity; low 63 bits: type and routing
};

class TriggerFifo {
 public:
  static constexpr uint64_t kLapBit = kTriggerLapBit;

  explicit TriggerFifo(uint32_t capacity_pow2) : mask_(capacity_pow2 - 1), slots_(capacity_pow2) {
    for (auto& s : slots_) {
      s.fst.store(0, std::memory_order_relaxed);
      s.snd.store(0, std::memory_order_relaxed);
    }
  }

  uint32_t capacity() const { return mask_ + 1; }

  // Producer. Returns false when the FIFO is full (the caller retries after progress).
  bool tryPush(uint64_t fst, uint64_t snd_low) {
    if (head_ - cached_tail_ > mask_) {
      cached_tail_ = tail_.load(std::memory_order_acquire);
      if (head_ - cached_tail_ > mask_) return false;
    }
    Slot& s = slots_[head_ & mask_];
    s.fst.store(fst, std::memory_order_relaxed);
    s.snd.store((snd_low & ~kLapBit) | lapBit(head_), std::memory_order_release);
    ++head_;
    return true;
  }

  // Consumer. Returns false when no trigger is ready.
  bool tryPop(Trigger& out) {
    Slot& s = slots_[tail_local_ & mask_];
    const uint64_t snd = s.snd.load(std::memory_order_acquire);
    if ((snd & kLapBit) != lapBit(tail_local_)) return false;
    out.fst = s.fst.load(std::memory_order_relaxed);
    out.snd = snd & ~kLapBit;
    ++tail_local_;
    tail_.store(tail_local_, std::memory_order_release);
    return true;
  }

  // Any thread, the consumer's included: whether a trigger waits for the consumer, read from
  // the published tail (a hint: a concurrent pop may take it meanwhile).
  bool pending() const {
    const uint64_t tail = tail_.load(std::memory_order_acquire);
    const Slot& s = slots_[tail & mask_];
    return (s.snd.load(std::memory_order_acquire) & kLapBit) == lapBit(tail);
  }
  // Any thread: how many triggers were consumed so far (the published tail).
  uint64_t consumed() const { return tail_.load(std::memory_order_acquire); }

 private:
  uint64_t lapBit(uint64_t pos) const { return triggerLapBit(pos, mask_ + 1ull); }

  struct Slot {
    std::atomic<uint64_t> fst;
    std::atomic<uint64_t> snd;
  };
  const uint32_t mask_;
  std::vector<Slot> slots_;
  // Producer side.
  alignas(64) uint64_t head_ = 0;
  uint64_t cached_tail_ = 0;
  // Consumer side.
  alignas(64) uint64_t tail_local_ = 0;
  std::atomic<uint64_t> tail_{0};
};

// Consumer side of a trigger FIFO that lives in external memory (the mapped host memory a
// GPU producer writes): `slots` of 2 x 8 bytes, the lap-bit rule of TriggerFifo on both
// words, and the tail published to `tail_word` for the producer's flow control.
class TriggerRingView {
 public:
  TriggerRingView() = default;
  TriggerRingView(void* slots, uint64_t* tail_word, uint32_t capacity_pow2)
      : slots_(static_cast<uint64_t*>(slots)), tail_word_(tail_word), mask_(capacity_pow2 - 1) {}

  bool tryPop(Trigger& out) {
    uint64_t fst, snd;
    if (!complete(tail_, fst, snd)) return false;
    out.fst = fst & ~TriggerFifo::kLapBit;
    out.snd = snd & ~TriggerFifo::kLapBit;
    ++tail_;
    return true;
  }
  // Publishes consumption (batched: once per drained batch).
  void publishTail() { __atomic_store_n(tail_word_, tail_, __ATOMIC_RELEASE); }
  // Any thread: whether a complete trigger waits beyond the published tail, i.e. one not yet
  // consumed by a pass that has finished with what it popped (it publishes after posting).
  bool readyBeyondPublished() const {
    uint64_t fst, snd;
    return complete(__atomic_load_n(tail_word_, __ATOMIC_ACQUIRE), fst, snd);
  }

 private:
  uint64_t lapBit(uint64_t pos) const { return triggerLapBit(pos, mask_ + 1); }
  // Whether the slot of `pos` is complete: both words carry its lap parity (a producer may
  // write it as one 16-byte store without a fence, which the reader may see half done).
  bool complete(uint64_t pos, uint64_t& fst, uint64_t& snd) const {
    const uint64_t* s = slots_ + 2 * (pos & mask_);
    const uint64_t lap = lapBit(pos);
    snd = __atomic_load_n(s + 1, __ATOMIC_ACQUIRE);
    if ((snd & TriggerFifo::kLapBit) != lap) return false;
    fst = __atomic_load_n(s, __ATOMIC_ACQUIRE);
    return (fst & TriggerFifo::kLapBit) == lap;
  }
  uint64_t* slots_ = nullptr;
  uint64_t* tail_word_ = nullptr;
  uint64_t mask_ = 0;
  uint64_t tail_ = 0;
};

}  // namespace resident
