#include "c10d/work_resident.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include "core/error.hpp"

namespace resident {

WorkResident::WorkResident(std::shared_ptr<Communicator> comm, int rank, c10d::OpType type,
                           const char* profiling_title, std::vector<at::Tensor> outputs,
                           std::vector<at::Tensor> keep_alive)
    // No title for c10d::Work: its RecordFunction would end only when the Work is destroyed,
    // possibly during a later profiling session (record_ ends it properly).
    : c10d::Work(rank, type),
      comm_(std::move(comm)),
      outputs_(std::move(outputs)),
      keep_alive_(std::move(keep_alive)),
      record_(OpRecord::start(profiling_title, recordedInputs(type, outputs_, keep_alive_))) {}

WorkResident::~WorkResident() {
  if (!released_.exchange(true))
    for (const OpHandle& h : ops_) comm_->engine().release(h);
}

void WorkResident::releaseOps() {
  if (!finished_.load(std::memory_order_acquire) || released_.exchange(true)) return;
  for (const OpHandle& h : ops_) comm_->engine().release(h);
}

bool WorkResident::collect() {
  if (finished_.load(std::memory_order_acquire)) return true;
  Engine& engine = comm_->engine();
  for (const OpHandle& h : ops_) {
    if (!engine.test(h)) return false;
  }
  for (const OpHandle& h : ops_) {
    const Op& op = *h.op;
    if (op.state.load(std::memory_order_acquire) == OpState::kFailed && !failed_) {
      failed_ = true;
      error_ = op.error;
    }
  }
  const c10d::OpType type = retrieveOpType();
  if ((type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE) && ops_.size() == 1)
    source_ = Communicator::sourceOf(ops_[0]);
  finished_.store(true, std::memory_order_release);
  return true;
}

bool WorkResident::isCompleted() {
  if (!collect()) return false;
  record_.end();
  return true;
}

bool WorkResident::completedNow() {
  if (!finished_.load(std::memory_order_acquire))
    for (const OpHandle& h : ops_)
      if (!Engine::finished(h)) return false;
  return isCompleted();  // every op finished: collects without a pass
}

bool WorkResident::isSuccess() const {
  return finished_.load() && !failed_;
}

void WorkResident::rethrow() const {
  C10_THROW_ERROR(DistBackendError, error_);
}

std::exception_ptr WorkResident::exception() const {
  if (!finished_.load() || !failed_) return nullptr;
  try {
    rethrow();
  } catch (...) {
    return std::current_exception();
  }
}

int WorkResident::sourceRank() const {
  const c10d::OpType type = retrieveOpType();
  if ((type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE) || ops_.size() != 1)
    return c10d::Work::sourceRank();  // torch's error: not a recv
  if (!finished_.load(std::memory_order_acquire) || failed_) {
    C10_THROW_ERROR(ValueError,
                    "resident: the sender of a recv is known once the recv completed "
                    "successfully; call wait() first");
  }
  return source_;
}

void WorkResident::waitOps(Engine& engine, c10::ArrayRef<OpHandle> ops, uint64_t timeout_ns) {
  for (const OpHandle& h : ops) {
    try {
      engine.wait(h, timeout_ns);
    } catch (const CommError& e) {
      if (!engine.test(h)) {  // the wait's timeout passed; the op is still in flight
        C10_THROW_ERROR(DistBackendError, e.what());
      }
    }
  }
}

bool WorkResident::wait(std::chrono::milliseconds timeout) {
  if (finished_.load(std::memory_order_acquire)) {  // its ops may be back in the pool
    record_.end();
    if (failed_) rethrow();
    return true;
  }
  waitOps(comm_->engine(), ops_,
          timeout == kNoTimeout ? 0 : static_cast<uint64_t>(timeout.count()) * 1000000ull);
  collect();
  record_.end();
  if (failed_) rethrow();
  return true;
}

void WorkResident::onOpDone(void* self) {
  auto* work = static_cast<WorkResident*>(self);
  if (work->future_pending_.fetch_sub(1) == 1) {
    work->collect();
    if (work->failed_) {
      work->future_->setError(work->exception());
    } else {
      work->future_->markCompleted(c10::IValue(work->outputs_));
    }
  }
  // Drop the reference taken when the callback was registered.
  c10::raw::intrusive_ptr::decref(work);
}

c10::intrusive_ptr<c10::ivalue::Future> WorkResident::getFuture() {
  if (future_) return future_;
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  if (ops_.empty() || finished_.load(std::memory_order_acquire)) {  // ops maybe back in the pool
    if (failed_)
      future_->setError(exception());
    else
      future_->markCompleted(c10::IValue(outputs_));
    return future_;
  }
  // One pending count per op, plus one held while registering so that a callback firing
  // during registration cannot complete the future early.
  future_pending_.store(static_cast<int>(ops_.size()) + 1);
  for (const OpHandle& h : ops_) {
    c10::raw::intrusive_ptr::incref(this);
    comm_->engine().setCompletionCallback(h, &WorkResident::onOpDone, this);
  }
  c10::raw::intrusive_ptr::incref(this);
  onOpDone(this);
  return future_;
}

}  // namespace resident
