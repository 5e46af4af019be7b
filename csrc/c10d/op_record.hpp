// The profiler event of one resident op, following c10d's conventions: a USER_SCOPE
// RecordFunction named like other backends' ("resident:all_reduce" as "gloo:all_reduce"),
// marked async (it may end on another call than the one that started it), carrying the op's
// input tensors so that record_shapes reports their shapes, started when the op is called and
// ended once it completed, failed or was aborted.
//
// Ending is safe wherever it happens. A RecordFunction's end callbacks write into the profiling
// session that started it; once that session has ended its events are collected and freed, so
// an end reaching them then (a Work destroyed, or waited on, during a later session) corrupts
// the heap. end() therefore checks on its own thread that the session is still the one
// profiling there; if it is not, the profiler is kept from seeing the end and the event stays
// unfinished in the session it belonged to.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <atomic>

namespace resident {

class OpRecord {
 public:
  OpRecord() = default;
  // Starts the event if anything observes RecordFunctions (a profiler); else stays empty.
  static OpRecord start(const char* name, c10::ArrayRef<at::Tensor> inputs);

  OpRecord(OpRecord&& other) noexcept : event_(other.event_.exchange(nullptr)) {}
  OpRecord& operator=(OpRecord&& other) noexcept;
  OpRecord(const OpRecord&) = delete;
  OpRecord& operator=(const OpRecord&) = delete;
  ~OpRecord() { end(); }

  bool active() const { return event_.load(std::memory_order_acquire) != nullptr; }
  // Ends the event (the first call does; later ones and an empty record do nothing).
  void end() {
    if (event_.load(std::memory_order_acquire) != nullptr) endNow();
  }

 private:
  struct Event;
  void endNow();
  std::atomic<Event*> event_{nullptr};
};

}  // namespace resident
