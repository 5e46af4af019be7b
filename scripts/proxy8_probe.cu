// How close can the proxy path's 8-byte all_reduce come to the floor, and where does the
// library spend the rest? Two ranks as two processes on one GPU (under MPS, as the benchmark),
// sharing mapped host memory; each has a proxy thread of its own, pinned as the library pins it
// (the top allowed CPUs). Each rank captures a graph of NODES back-to-back all_reduces (in place,
// int64 SUM, PDL as the library) and replays it; per-op time = replay time / NODES, median over
// replays, per rank. Variants, side by side in one run:
//   direct:        the least kernel, storing its LL line straight into the peer's slot (the
//                  direct path; the reference)
//   line:          the least kernel stores its line to its own outbox; the proxy polls that
//                  line and copies it (one 16-byte store) into the peer's slot: the least
//                  proxy path (no trigger at all)
//   line-nt:       the same with a non-temporal store and an sfence
//   trigger:       the least kernel stores its line to the outbox, then an unfenced 16-byte
//                  trigger to the FIFO (the library's encoding); the proxy pops it, checks the
//                  line's flags and copies it (the library's protocol, least code)
//   lib:           the library's collective kernel with the peer proxied (the arguments
//                  GpuCommunicator builds for this op), served by the same least proxy as
//                  `trigger`: the kernel's share of the library's proxy-path time
// Every variant checks the result after the last replay (2^(ops-1) * (a + b) mod 2^64).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ikernels -Icsrc scripts/proxy8_probe.cu \
//        kernels/collective_kernel.cu -o proxy8_probe && ./proxy8_probe [NODES [REPLAYS]]
#include <cuda_runtime.h>
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "collective_launch.hpp"
#include "core/fifo.hpp"
#include "core/trigger_encoding.hpp"
#include "launch_device.cuh"
#include "ll_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using resident::gpu::CollectiveArgs;
using resident::gpu::DeviceState;

constexpr int kVariants = 7;
constexpr uint64_t kSlotBytes = 4096;  // one part of LL lines
constexpr uint64_t kFifoOffset = 256;  // after the error / abort / FIFO-tail words
constexpr uint32_t kFifoSlots = 256;
constexpr uint64_t kCollIn0 = kFifoOffset + 16ull * kFifoSlots;
constexpr uint64_t kRegionBytes = kCollIn0 + 2 * 2 * kSlotBytes;  // 2 ranks x 2 slots
constexpr uint64_t kOutStride = 2 * kSlotBytes;                    // outbox per destination
constexpr uint64_t kOutboxBytes = 2 * kOutStride;
constexpr uint64_t kRankBytes = kRegionBytes + kOutboxBytes;
constexpr uint64_t kTimeoutNs = 2000000000ull;

struct Control {  // first page of the shared mapping
  volatile uint64_t arrive[2];
  volatile int failed;
};

enum Kind { kDirect, kLine, kLineNt, kTrigger, kLib };

struct Variant {
  const char* name;
  Kind kind;
};

struct MinArgs {
  uint32_t* seq;          // device: ops done
  uint64_t* data;         // device: in and out (in place)
  unsigned char* mine;    // this rank's slot lines from the peer (mapped host memory)
  unsigned char* theirs;  // direct: the peer's slot lines from this rank
  unsigned char* outbox;  // proxied: this rank's outbox lines to the peer
  unsigned char* fifo;    // trigger: this rank's FIFO slots
  int peer;
  int* error;  // device: a wait timed out
};

template <Kind K>
__global__ void __launch_bounds__(32) minAllReduce(const __grid_constant__ MinArgs a) {
  __shared__ uint32_t base;
  if (threadIdx.x == 0) {
    base = *reinterpret_cast<volatile uint32_t*>(a.seq);
    *reinterpret_cast<volatile uint32_t*>(a.seq) = base + 1;
    __threadfence();
  }
  __syncthreads();
  resident::gpu::pdlEnter();
  if (threadIdx.x != 0) return;
  const uint32_t g = base + 1;
  const uint64_t line = (g & 1) * 16;
  const uint64_t v = __ldcg(reinterpret_cast<const unsigned long long*>(a.data));
  if (K == kDirect) {
    resident::gpu::storeLine(a.theirs + line, v, g);
  } else {
    resident::gpu::storeLine(a.outbox + line, v, g);
    if (K == kTrigger) {  // position g - 1: one trigger per op
      const uint64_t pos = g - 1;
      const uint64_t lap = resident::triggerLapBit(pos, kFifoSlots);
      const uint64_t fst = resident::encodeWriteFst(line, line) | lap;
      const uint64_t snd =
          resident::encodeWriteSnd(static_cast<uint32_t>(a.peer), 16,
                                   resident::TriggerKind::kLines, g) |
          lap;
      unsigned char* slot = a.fifo + 16 * (pos % kFifoSlots);
      asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(fst), "l"(snd)
                   : "memory");
    }
  }
  uint64_t peer = 0;
  const uint64_t deadline = resident::gpu::globalTimerNs() + kTimeoutNs;
  for (uint32_t spins = 0; !resident::gpu::loadLine(a.mine + line, g, peer);) {
    if (++spins == 128) {
      spins = 0;
      if (resident::gpu::globalTimerNs() > deadline) {
        *a.error = 1;
        return;
      }
    }
  }
  *a.data = v + peer;
}

double nowUs() {
  using Us = std::chrono::duration<double, std::micro>;
  return Us(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Both ranks reach step k; false when the peer does not come within 30 s or failed.
bool barrier(Control* c, int rank, uint64_t k) {
  c->arrive[rank] = k;
  const double deadline = nowUs() + 30e6;
  while (c->arrive[1 - rank] < k) {
    if (c->failed || nowUs() > deadline) return false;
  }
  return true;
}

bool flagsAre(const unsigned char* p, uint32_t flag) {
  const auto* w = reinterpret_cast<const uint32_t*>(p);
  return __atomic_load_n(w + 1, __ATOMIC_RELAXED) == flag &&
         __atomic_load_n(w + 3, __ATOMIC_RELAXED) == flag;
}

void copyLine(unsigned char* dst, const unsigned char* src, bool nt) {
  const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(src));
  if (nt) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
    _mm_sfence();
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(dst), v);
  }
}

// The proxy of one variant: `line`/`line-nt` poll the outbox line of the next op (flag g, in
// slot g & 1); `trigger`/`lib` pop the FIFO as the library's proxy does (TriggerRingView),
// wait for the announced lines' flags and copy them. Runs until `stop`.
void proxyLoop(Kind kind, unsigned char* region, unsigned char* outbox, unsigned char* peer_region,
               std::atomic<bool>* stop) {
  if (kind == kLine || kind == kLineNt) {
    for (uint32_t g = 1;; ++g) {
      const unsigned char* src = outbox + (g & 1) * 16;
      while (!flagsAre(src, g))
        if (stop->load(std::memory_order_relaxed)) return;
      copyLine(peer_region + kCollIn0 + (g & 1) * 16 + 0, src, kind == kLineNt);
    }
  }
  resident::TriggerRingView ring(region + kFifoOffset, reinterpret_cast<uint64_t*>(region + 128),
                                 kFifoSlots);
  while (!stop->load(std::memory_order_relaxed)) {
    resident::Trigger t;
    if (!ring.tryPop(t)) continue;
    const resident::GpuWriteRequest r = resident::decodeWrite(t.fst, t.snd);
    const unsigned char* src = outbox + r.local_offset;
    for (uint64_t off = 0; off + 16 <= r.bytes; off += 16)
      while (!flagsAre(src + off, r.value))
        if (stop->load(std::memory_order_relaxed)) return;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    unsigned char* dst = peer_region + r.remote_offset;
    if (r.bytes == 16)
      copyLine(dst, src, false);
    else
      std::memcpy(dst, src, r.bytes);
    ring.publishTail();
  }
}

// The CPU the library pins a rank's proxy to (GpuCommunicator::pinProxyNearDevice without the
// device's NUMA list): counted from the top of the allowed set.
int proxyCpu(int rank) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return -1;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  return cpus.size() < 4 ? -1 : cpus[cpus.size() - 1 - static_cast<size_t>(rank)];
}

int runRank(int rank, unsigned char* shared, int nodes, int replays) {
  check(cudaSetDevice(0), "device");
  auto* ctl = reinterpret_cast<Control*>(shared);
  const size_t bytes = 4096 + kVariants * 2 * kRankBytes;
  check(cudaHostRegister(shared, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
        "register");
  unsigned char* shared_d = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&shared_d), shared, 0), "pointer");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const Variant variants[kVariants] = {{"direct", kDirect}, {"line", kLine},
                                       {"line-nt", kLineNt}, {"trigger", kTrigger},
                                       {"lib", kLib},        {"line", kLine},
                                       {"trigger", kTrigger}};
  const int cpu = proxyCpu(rank);
  const uint64_t mine_init[2] = {0x1234567890abcdefull, 0x0fedcba987654321ull};
  const int peer = 1 - rank;
  uint64_t step = 1;
  int status = 0;
  for (int vi = 0; vi < kVariants; ++vi) {
    const Variant& v = variants[vi];
    const uint64_t at_rank = 4096 + (vi * 2 + rank) * kRankBytes;
    const uint64_t at_peer = 4096 + (vi * 2 + peer) * kRankBytes;
    uint64_t* data = nullptr;
    check(cudaMalloc(&data, 64), "malloc");
    check(cudaMemcpy(data, &mine_init[rank], 8, cudaMemcpyHostToDevice), "copy");
    DeviceState* state = nullptr;
    check(cudaMalloc(&state, sizeof(DeviceState)), "malloc");
    check(cudaMemset(state, 0, sizeof(DeviceState)), "memset");
    int* error = nullptr;
    check(cudaMalloc(&error, 64), "malloc");
    check(cudaMemset(error, 0, 64), "memset");
    unsigned char* region_d = shared_d + at_rank;
    unsigned char* outbox_d = region_d + kRegionBytes;
    // The library's arguments for this op with the peer proxied (GpuCommunicator::allReduce).
    CollectiveArgs a{};
    a.reg.state = state;
    a.reg.local = region_d;
    a.reg.outbox = outbox_d;
    a.reg.slot_bytes = kSlotBytes;
    a.reg.coll_in0 = kCollIn0;
    a.reg.out_stride = kOutStride;
    a.reg.chunk = 2048;
    a.reg.fifo_mask = kFifoSlots - 1;
    a.reg.fifo_offset = kFifoOffset;
    a.reg.timeout_ns = kTimeoutNs;
    a.reg.proxied = 1ull << peer;
    a.local_in = data;
    a.out = data;
    a.rank = rank;
    a.nranks = 2;
    a.mode = static_cast<uint8_t>(resident::gpu::Mode::kReduce);
    a.dtype = 5;  // int64 (kernels/reduce_device.cuh kI64)
    a.redop = 0;  // sum
    a.rounds_max = 1;
    a.parts_per_block = 1;
    a.common_send = data;  // RESIDENT_GPU_PREFETCH=1, the default
    a.common_send_bytes = 8;
    for (int p = 0; p < 2; ++p) a.peers[p] = {data, p == rank ? data : nullptr, 8, 8, 1, 0};
    MinArgs m{reinterpret_cast<uint32_t*>(state),
              data,
              region_d + kCollIn0 + peer * 2 * kSlotBytes,
              shared_d + at_peer + kCollIn0 + rank * 2 * kSlotBytes,
              outbox_d + peer * kOutStride,
              region_d + kFifoOffset,
              peer,
              error};
    // The proxy: the least one, or the library-protocol one (the kernel's outbox offsets are
    // relative to the outbox, its remote offsets to the peer's region).
    std::atomic<bool> stop{false};
    std::thread proxy;
    if (v.kind != kDirect) {
      unsigned char* region_h = shared + at_rank;
      unsigned char* outbox_h = region_h + kRegionBytes;
      unsigned char* peer_h = shared + at_peer;
      if (v.kind == kLine || v.kind == kLineNt) {
        outbox_h += peer * kOutStride;
        peer_h += rank * 2 * kSlotBytes;  // the line's slot in the peer's region (+ kCollIn0)
      } else if (v.kind == kTrigger) {
        outbox_h += peer * kOutStride;
        peer_h += kCollIn0 + rank * 2 * kSlotBytes;
      }
      proxy = std::thread(proxyLoop, v.kind, region_h, outbox_h, peer_h, &stop);
      if (cpu >= 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        pthread_setaffinity_np(proxy.native_handle(), sizeof(one), &one);
      }
    }
    cudaGraph_t g;
    cudaGraphExec_t ge;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    for (int i = 0; i < nodes; ++i) {
      if (v.kind == kLib) {
        check(resident::gpu::launchCollective(a, 1, s, true), "launch");
        continue;
      }
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(1);
      cfg.blockDim = dim3(32);
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      void (*kernel)(MinArgs) = v.kind == kDirect    ? minAllReduce<kDirect>
                                : v.kind == kTrigger ? minAllReduce<kTrigger>
                                                     : minAllReduce<kLine>;
      check(cudaLaunchKernelEx(&cfg, kernel, m), "launch");
    }
    check(cudaStreamEndCapture(s, &g), "end capture");
    check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    // Both ranks start each replay together; a peer that does not come ends the variant.
    bool ok = true;
    std::vector<double> per_op = probe::timeReplays(ge, s, nodes, replays, [&](int) {
      ok = barrier(ctl, rank, step++);
      return ok;
    });
    uint64_t got = 0, want = mine_init[0] + mine_init[1];
    int err = 0;
    check(cudaMemcpy(&got, data, 8, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(&err, error, 4, cudaMemcpyDeviceToHost), "copy");
    stop.store(true);
    if (proxy.joinable()) proxy.join();
    const uint64_t ops = static_cast<uint64_t>(nodes) * static_cast<uint64_t>(replays + 3);
    for (uint64_t i = 1; i < ops; ++i) want *= 2;
    const bool correct = ok && err == 0 && got == want;
    if (!correct) {
      status = 1;
      ctl->failed = 1;
    }
    std::sort(per_op.begin(), per_op.end());
    const auto at = [&](double q) {
      return per_op.empty() ? 0.0 : per_op[size_t(q * (per_op.size() - 1))];
    };
    std::printf(
        "{\"rank\": %d, \"variant\": \"%s\", \"proxy_cpu\": %d, \"nodes\": %d, \"correct\": %s, "
        "\"us_per_op\": %.3f, \"p10\": %.3f, \"p90\": %.3f}\n",
        rank, v.name, v.kind == kDirect ? -1 : cpu, nodes, correct ? "true" : "false", at(0.5),
        at(0.1), at(0.9));
    std::fflush(stdout);
    check(cudaGraphExecDestroy(ge), "destroy");
    check(cudaGraphDestroy(g), "destroy");
    check(cudaFree(data), "free");
    check(cudaFree(state), "free");
    check(cudaFree(error), "free");
    if (!correct) break;
  }
  check(cudaHostUnregister(shared), "unregister");
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  const int nodes = argc > 1 ? std::atoi(argv[1]) : 200;
  const int replays = argc > 2 ? std::atoi(argv[2]) : 31;
  const size_t bytes = 4096 + kVariants * 2 * kRankBytes;
  // Shared before fork, and fork before any CUDA call (a child must not inherit a context).
  void* shared = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) {
    std::printf("{\"error\": \"mmap\"}\n");
    return 2;
  }
  std::memset(shared, 0, bytes);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const pid_t child = fork();
  if (child == 0) std::_Exit(runRank(1, static_cast<unsigned char*>(shared), nodes, replays));
  const int status = runRank(0, static_cast<unsigned char*>(shared), nodes, replays);
  int child_status = 0;
  waitpid(child, &child_status, 0);
  return status != 0 || !WIFEXITED(child_status) || WEXITSTATUS(child_status) != 0 ? 1 : 0;
}
