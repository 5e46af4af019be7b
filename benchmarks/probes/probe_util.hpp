// Host helpers shared by the standalone CUDA probes in benchmarks/probes/ (each prints JSON lines).
#pragma once

#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace probe {

// Any failed CUDA call ends the probe with one JSON error line and exit status 2.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("{\"error\": \"%s: %s\"}\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

inline double nowUs() {
  using Us = std::chrono::duration<double, std::micro>;
  return Us(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Quantile q of samples sorted ascending (0 for none).
inline double quantile(const std::vector<double>& sorted, double q) {
  return sorted.empty() ? 0.0 : sorted[static_cast<size_t>(q * (sorted.size() - 1))];
}

// The upper median (0 for no samples).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

constexpr int kUntimedReplays = 3;  // timeReplays' warm-up replays

// Replays graph `ge` on `s` `replays` times after kUntimedReplays untimed ones, timed with
// events; returns microseconds per node of each timed replay. before(r) runs before replay r;
// false stops (the replays so far are returned).
template <class Before>
std::vector<double> timeReplays(cudaGraphExec_t ge, cudaStream_t s, int nodes, int replays,
                                Before before) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<double> per_node;
  for (int r = 0; r < replays + kUntimedReplays && before(r); ++r) {
    check(cudaEventRecord(e0, s), "record");
    check(cudaGraphLaunch(ge, s), "graph launch");
    check(cudaEventRecord(e1, s), "record");
    check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (r >= kUntimedReplays) per_node.push_back(1000.0 * ms / nodes);
  }
  check(cudaEventDestroy(e0), "event");
  check(cudaEventDestroy(e1), "event");
  return per_node;
}

// The word an in-place 2-rank SUM all_reduce leaves after a graph of `nodes` such ops went
// through timeReplays(..., replays): the ranks' first words summed, then doubled by every later
// op (uint64 arithmetic, as the kernels add).
inline uint64_t allReducedWord(uint64_t sum, int nodes, int replays) {
  const uint64_t ops =
      static_cast<uint64_t>(nodes) * static_cast<uint64_t>(replays + kUntimedReplays);
  for (uint64_t i = 1; i < ops; ++i) sum *= 2;
  return sum;
}

// Two-process probes (the ranks of a group on one GPU, under MPS as the library's): the first
// page of the memory they share.
struct TwoRankControl {
  volatile uint64_t arrive[2];
  volatile int failed;
};

// A variant's verdict, once its results are read back: a wrong one fails the probe (status 1)
// and tells the peer, whose barriers then give up instead of waiting 30 s.
inline void recordVerdict(bool correct, int& status, TwoRankControl* ctl) {
  if (correct) return;
  status = 1;
  ctl->failed = 1;
}

// Frees a variant's device buffers.
inline void freeDevice(std::initializer_list<void*> buffers) {
  for (void* b : buffers) check(cudaFree(b), "free");
}

// Both ranks reach step k; false when the peer does not come within 30 s or failed.
inline bool barrier(TwoRankControl* c, int rank, uint64_t k) {
  c->arrive[rank] = k;
  const double deadline = nowUs() + 30e6;
  while (c->arrive[1 - rank] < k) {
    if (c->failed || nowUs() > deadline) return false;
  }
  return true;
}

// Registers the shared memory as mapped pinned memory of the current device; its device pointer.
inline unsigned char* registerShared(unsigned char* shared, size_t bytes) {
  check(cudaHostRegister(shared, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
        "register");
  unsigned char* shared_d = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&shared_d), shared, 0), "pointer");
  return shared_d;
}

// Runs run(rank, shared) in two processes (rank 1 the child) that share `bytes` of zeroed
// memory, mapped before the fork, and the fork comes before any CUDA call (a child must not
// inherit a context). main's exit status: 0 when both ranks returned 0.
template <class Run>
int runTwoRanks(size_t bytes, Run run) {
  void* shared = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) {
    std::printf("{\"error\": \"mmap\"}\n");
    return 2;
  }
  std::memset(shared, 0, bytes);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const pid_t child = fork();
  if (child == 0) std::_Exit(run(1, static_cast<unsigned char*>(shared)));
  const int status = run(0, static_cast<unsigned char*>(shared));
  int child_status = 0;
  waitpid(child, &child_status, 0);
  return status != 0 || !WIFEXITED(child_status) || WEXITSTATUS(child_status) != 0 ? 1 : 0;
}

// Captures `nodes` kernel launches (launch() issues one on s) into a graph and replays it as
// timeReplays does, both ranks starting each replay together (step: the barrier's counter);
// returns µs per node of each timed replay, sorted, and ok = false when the peer did not come.
template <class Launch>
std::vector<double> timeTwoRankGraph(cudaStream_t s, int nodes, int replays, TwoRankControl* ctl,
                                     int rank, uint64_t& step, bool& ok, Launch launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < nodes; ++i) launch();
  check(cudaStreamEndCapture(s, &g), "end capture");
  check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  ok = true;
  std::vector<double> per_node = timeReplays(ge, s, nodes, replays, [&](int) {
    ok = barrier(ctl, rank, step++);
    return ok;
  });
  check(cudaGraphExecDestroy(ge), "destroy");
  check(cudaGraphDestroy(g), "destroy");
  std::sort(per_node.begin(), per_node.end());
  return per_node;
}

// main() of a two-rank graph probe: run(rank, shared, NODES, REPLAYS) in both processes, with
// NODES = argv[1] (default 200) and REPLAYS = argv[2] (default 31).
template <class Run>
int twoRankGraphMain(int argc, char** argv, size_t bytes, Run run) {
  const int nodes = argc > 1 ? std::atoi(argv[1]) : 200;
  const int replays = argc > 2 ? std::atoi(argv[2]) : 31;
  return runTwoRanks(
      bytes, [&](int rank, unsigned char* shared) { return run(rank, shared, nodes, replays); });
}

}  // namespace probe
