#include "c10d/op_record.hpp"

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <memory>
#include <string_view>
#include <vector>

#include "core/log.hpp"

namespace resident {

using torch::profiler::impl::ProfilerStateBase;

struct OpRecord::Event {
  at::RecordFunction fn{at::RecordScope::USER_SCOPE};
  std::vector<c10::IValue> inputs;  // the RecordFunction refers to them until it ends
  // The sessions that saw the start: the starting thread's (held, with that thread's debug
  // info, so that no later session can take its address) and the process-wide one.
  ProfilerStateBase* thread_session = nullptr;
  std::shared_ptr<c10::ThreadLocalDebugInfo> thread_debug_info;
  std::shared_ptr<ProfilerStateBase> global_session;
};

namespace {

// Hides this thread's debug info (its profiling session among it) for a scope.
class HiddenDebugInfo {
 public:
  HiddenDebugInfo() : saved_(c10::ThreadLocalDebugInfo::current()) {
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(nullptr);
  }
  ~HiddenDebugInfo() { c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(saved_); }
  HiddenDebugInfo(const HiddenDebugInfo&) = delete;
  HiddenDebugInfo& operator=(const HiddenDebugInfo&) = delete;

 private:
  std::shared_ptr<c10::ThreadLocalDebugInfo> saved_;
};

// The profiler's sessions: torch 2.14 names them getTLS() and getGlobal(); earlier releases
// (2.11) have get(global), whose process-wide session is a plain pointer (held here without
// ownership, compared by address).
template <typename S>
auto threadSession(int) -> decltype(S::getTLS()) {
  return S::getTLS();
}
template <typename S>
ProfilerStateBase* threadSession(long) {
  return S::get(/*global=*/false);
}
template <typename S>
auto globalSession(int) -> decltype(S::getGlobal()) {
  return S::getGlobal();
}
template <typename S>
std::shared_ptr<ProfilerStateBase> globalSession(long) {
  return std::shared_ptr<ProfilerStateBase>(std::shared_ptr<void>(), S::get(/*global=*/true));
}

}  // namespace

OpRecord OpRecord::start(const char* name, c10::ArrayRef<at::Tensor> inputs) {
  OpRecord record;
  if (!at::hasCallbacks()) return record;
  auto event = std::make_unique<Event>();
  if (!event->fn.isActive()) return record;
  event->fn._setAsync();
  if (event->fn.needsInputs()) {
    event->inputs.reserve(inputs.size());
    for (const at::Tensor& t : inputs) event->inputs.emplace_back(t);
  }
  event->thread_session = threadSession<ProfilerStateBase>(0);
  if (event->thread_session != nullptr)
    event->thread_debug_info = c10::ThreadLocalDebugInfo::current();
  event->global_session = globalSession<ProfilerStateBase>(0);
  // `name` is a string literal: the RecordFunction keeps the view.
  event->fn.before(std::string_view(name),
                   c10::ArrayRef<const c10::IValue>(event->inputs.data(), event->inputs.size()));
  record.event_.store(event.release(), std::memory_order_release);
  return record;
}

OpRecord& OpRecord::operator=(OpRecord&& other) noexcept {
  if (this != &other) {
    end();
    event_.store(other.event_.exchange(nullptr), std::memory_order_release);
  }
  return *this;
}

void OpRecord::endNow() {
  std::unique_ptr<Event> event(event_.exchange(nullptr, std::memory_order_acq_rel));
  if (!event) return;  // another thread ended it
  const bool thread_session_over = event->thread_session != nullptr &&
                                   threadSession<ProfilerStateBase>(0) != event->thread_session;
  const std::shared_ptr<ProfilerStateBase> global_now = globalSession<ProfilerStateBase>(0);
  const bool global_session_over = event->global_session && global_now != event->global_session;
  if (!thread_session_over && !global_session_over) {
    event->fn.end();
    return;
  }
  if (global_session_over && global_now) {
    // A later process-wide session would take this end as its own, and nothing can hide that
    // session from the end callbacks: the RecordFunction is left unended (a small leak, only
    // for an op that outlived one process-wide profiling session into the next).
    RLOG_DEBUG("an op's profiler event outlived its process-wide session; left unended");
    (void)event.release();
    return;
  }
  // Its session is over: the profiler's end callback, finding no session, returns before
  // touching the event; other observers still see the end.
  HiddenDebugInfo hidden;
  event->fn.end();
}

}  // namespace resident
