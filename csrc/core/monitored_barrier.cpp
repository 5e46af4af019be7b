// A barrier that names the ranks that did not arrive: every rank sends an arrival message to
// rank 0, which waits for each within the barrier's timeout and then releases them all (or, when
// some did not arrive, tells those that did that the barrier failed). Built on the p2p ring with
// tags that a c10d tag (an int) cannot reach, so it never matches user messages.
// torch.distributed.monitored_barrier's error texts are kept (tools match on them).
#include <string>
#include <vector>

#include "core/clock.hpp"
#include "core/communicator.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace resident {
namespace {

// An int tag widened to 64 bits is below 2^31 or above 2^64 - 2^31: these are neither.
constexpr uint64_t kArriveTag = 1ull << 40;
constexpr uint64_t kReleaseTag = kArriveTag + 1;
// The release message's byte: whether the barrier passed.
constexpr unsigned char kPassed = 1;
constexpr unsigned char kFailed = 0;

// Releases the handles it holds on every exit (an op still in flight returns to the pool when
// it finishes).
struct HandleSet {
  Engine& engine;
  std::vector<OpHandle> handles;
  ~HandleSet() {
    for (const OpHandle& h : handles) engine.release(h);
  }
};

}  // namespace

void Communicator::monitoredBarrier(uint64_t timeout_ms, bool wait_all_ranks) {
  if (nranks_ == 1) return;
  // One byte per rank and direction, allocated once: a receive that timed out may still write
  // into its byte later.
  if (monitored_scratch_.empty()) monitored_scratch_.resize(2 * static_cast<size_t>(nranks_));
  unsigned char* arrive = monitored_scratch_.data();
  unsigned char* release = arrive + nranks_;
  HandleSet ops{*engine_, {}};
  ops.handles.reserve(2 * static_cast<size_t>(nranks_));

  if (rank_ != 0) {
    // Only rank 0 enforces the barrier's timeout, so that it (and not a waiting rank giving
    // up first) reports who is missing; the others wait as long as the group's timeout.
    arrive[rank_] = 1;
    release[rank_] = 0xff;
    ops.handles.push_back(send(arrive + rank_, 1, 0, kArriveTag));
    ops.handles.push_back(recv(release + rank_, 1, 0, kReleaseTag));
    std::string error;
    try {
      for (const OpHandle& h : ops.handles) engine_->wait(h);
      if (release[rank_] != kPassed) error = "rank 0 reported that other ranks did not arrive";
    } catch (const CommError& e) {
      error = e.what();
    }
    if (!error.empty()) {
      throw CommError("Rank " + std::to_string(rank_) +
                      " successfully reached monitoredBarrier, but received errors while waiting "
                      "for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n"
                      " Original exception: \n" +
                      error);
    }
    return;
  }

  const uint64_t start = nowNs();
  const uint64_t timeout_ns = timeout_ms * 1000000ull;
  for (int r = 1; r < nranks_; ++r) ops.handles.push_back(recv(arrive + r, 1, r, kArriveTag));
  // Sends the verdict to every rank whose arrival is here: on success to all of them (so that
  // all pass or none does); on failure to those that arrived, which would otherwise wait for
  // the group's timeout. Ranks that have not arrived get nothing.
  auto releaseArrived = [&](unsigned char verdict) {
    const size_t first_send = ops.handles.size();
    for (int r = 1; r < nranks_; ++r) {
      if (verdict != kPassed && !engine_->test(ops.handles[static_cast<size_t>(r - 1)])) continue;
      release[r] = verdict;
      ops.handles.push_back(send(release + r, 1, r, kReleaseTag));
    }
    for (size_t i = first_send; i < ops.handles.size(); ++i) engine_->wait(ops.handles[i]);
  };
  auto fail = [&](const std::string& error, bool timeout) {
    try {
      releaseArrived(kFailed);
    } catch (const CommError& e) {
      RLOG_WARN("monitoredBarrier: telling the waiting ranks failed: %s", e.what());
    }
    if (timeout) throw TimeoutError(error);
    throw CommError(error);
  };
  std::vector<int> responded;
  std::string failed;
  for (int r = 1; r < nranks_; ++r) {
    // Without wait_all_ranks the whole barrier shares one deadline; with it every rank gets
    // the full timeout, so that a missing rank does not use up the time of the ranks after it.
    const uint64_t elapsed = nowNs() - start;
    uint64_t wait_ns = timeout_ns;
    if (!wait_all_ranks) {
      if (elapsed >= timeout_ns) {
        std::string done;
        for (int d : responded) done += (done.empty() ? "" : ", ") + std::to_string(d);
        fail("[Rank 0]: Rank 0 timed out in monitoredBarrier after " + std::to_string(timeout_ms) +
                 " ms (ranks that responded: " + (done.empty() ? std::string("none") : done) + ")",
             true);
      }
      wait_ns = timeout_ns - elapsed;
    }
    try {
      engine_->wait(ops.handles[static_cast<size_t>(r - 1)], wait_ns == 0 ? 1 : wait_ns);
      responded.push_back(r);
    } catch (const CommError& e) {
      const std::string error = "[Rank 0]: Rank " + std::to_string(r) +
                                " failed to pass monitoredBarrier in " +
                                std::to_string(timeout_ms) + " ms";
      if (!wait_all_ranks) fail(error + "\n Original exception: \n" + e.what(), false);
      RLOG_ERROR("%s", error.c_str());
      failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  if (!failed.empty()) {
    fail("[Rank 0]: Ranks " + failed + " failed to pass monitoredBarrier in " +
             std::to_string(timeout_ms) + " ms",
         false);
  }
  releaseArrived(kPassed);
}

}  // namespace resident
