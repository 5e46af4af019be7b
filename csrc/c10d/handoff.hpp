// The large-message hand-off (docs/handoff.md): a group may own an inner c10d backend (NCCL for
// CUDA groups) that serves its ops on tensors of one device type whose message reaches a
// crossover size per op kind. The adapter asks takes() at the top of each covered op and, when
// it answers yes, returns forward()'s Work: the inner backend's own, with its stream semantics.
// Every rank decides from sizes all ranks share (see HandoffOp), so ranks never split one op
// between the two paths. Header-only: the adapter is the one translation unit that uses it.
#pragma once

#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "c10d/op_record.hpp"

namespace resident {

// The op kinds the hand-off covers and the bytes each is measured by (equal on every rank):
// all_reduce, broadcast, send/recv: the tensor; all_gather_into_tensor: the input (one rank's
// part); reduce_scatter_tensor: the output (one rank's part); all_to_all_single with equal
// splits: the input divided by the group size (one peer's part).
enum class HandoffOp : int {
  kAllReduce,
  kBroadcast,
  kAllGatherIntoTensor,
  kReduceScatterTensor,
  kAllToAllSingle,
  kSendRecv,
  kCount,
};
constexpr int kHandoffOps = static_cast<int>(HandoffOp::kCount);
inline constexpr std::array<const char*, kHandoffOps> kHandoffOpNames = {
    "all_reduce",        "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "send_recv"};

class Handoff {
 public:
  // `crossover[i]`: the bytes from which op kind i goes to `inner` (0: never).
  void install(c10::intrusive_ptr<c10d::Backend> inner, c10::DeviceType device,
               const std::array<uint64_t, kHandoffOps>& crossover) {
    inner_ = std::move(inner);
    device_ = device;
    crossover_ = crossover;
    inner_name_ = inner_->getBackendName();
    reason_.clear();
  }
  // No inner backend; `reason` says why (describe() shows it).
  void disable(std::string reason) {
    inner_.reset();
    reason_ = std::move(reason);
  }

  bool on() const { return inner_.defined(); }
  bool takes(HandoffOp op, const at::Tensor& t, size_t bytes) const {
    if (!inner_ || !t.defined() || t.device().type() != device_) return false;
    const uint64_t from = crossover_[static_cast<size_t>(op)];
    return from != 0 && bytes >= from;
  }

  // Runs `call(inner)` under the profiler event "<title>-><inner backend>" (e.g.
  // "resident:all_reduce->nccl"), spanning the call as ProcessGroupNCCL's events span a launch;
  // the inner backend's own events follow its conventions.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> forward(HandoffOp op, const char* title,
                                         c10::ArrayRef<at::Tensor> inputs, F&& call) {
    OpRecord record;
    if (at::hasCallbacks()) record = OpRecord::start(eventName(title), inputs);
    auto work = call(*inner_);
    record.end();
    forwarded_[static_cast<size_t>(op)].fetch_add(1, std::memory_order_relaxed);
    return work;
  }

  c10d::Backend* inner() const { return inner_.get(); }
  const std::string& innerName() const { return inner_name_; }
  c10::DeviceType device() const { return device_; }
  const std::string& reason() const { return reason_; }
  uint64_t crossover(int op) const { return crossover_[static_cast<size_t>(op)]; }
  uint64_t forwarded(int op) const {
    return forwarded_[static_cast<size_t>(op)].load(std::memory_order_relaxed);
  }

 private:
  // The event's name for `title`, kept for the life of the process: a RecordFunction holds a
  // view of its name, and an event may end after this group is gone.
  const char* eventName(const char* title) const {
    static std::mutex mu;
    static std::deque<std::string> names;
    const std::string name = std::string(title) + "->" + inner_name_;
    std::lock_guard<std::mutex> lock(mu);
    for (const std::string& n : names)
      if (n == name) return n.c_str();
    names.push_back(name);
    return names.back().c_str();
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  c10::DeviceType device_ = c10::DeviceType::CUDA;
  std::array<uint64_t, kHandoffOps> crossover_{};
  std::array<std::atomic<uint64_t>, kHandoffOps> forwarded_{};
  std::string inner_name_;
  std::string reason_ = "not set up";
};

}  // namespace resident
