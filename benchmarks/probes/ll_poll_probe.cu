// Why does a one-way send/recv of 64 KiB cost ~30 us when the data floor moves 64 KiB through
// host memory in ~6.5 us (benchmarks/floors/README.md)? Mirrors the p2p kernels' data
// movement in one process: a writer kernel stores LL lines (8 payload bytes and two copies of
// the flag in 16 bytes) into mapped pinned host memory (MAP_SHARED + cudaHostRegister, as the
// communicator's segments), part by part (2 KiB of payload per 256-thread pass); a reader
// kernel polls the lines and copies the payload to device memory. Each run is measured with
// %globaltimer stamps in both kernels:
//   serial:     writer, stream synchronize, then the reader (no line is polled before it lands)
//   concurrent: the reader first (polling), then the writer on another stream, as a receiver
//               that waits for a sender
// Reader poll modes: thread (every thread polls its line, as the recv kernel), block (thread 0
// polls the last line of the block's last part with a 100 ns sleep between polls, then every
// thread reads its lines), relaxed (thread, with ld.relaxed.sys), cached (thread, with
// ld.global.cg; serial only). One line of JSON
// per configuration: medians over the iterations, in microseconds.
//
// Allocations compared (ALLOCS, comma-separated): shared (MAP_SHARED anonymous + cudaHostRegister,
// as the segments), cudaHostAlloc (as the floor benchmark), shared-thp / private-thp (the same
// with madvise(MADV_HUGEPAGE)), shared-hugetlb (MAP_HUGETLB); each line says the pages it got.
//
// Sections (SECTIONS, comma-separated, default all): sweep (the above), credit (the send
// kernel's credit wait per block count), abort (a receiver reading one shared host word every
// 128 misses while it waits for a late sender). The LL store and load are the kernels' own
// (kernels/ll_device.cuh). From the repository root:
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/ll_poll_probe.cu -o
//   ll_poll_probe
//   ./ll_poll_probe [ITERS [ALLOCS [SECTIONS]]]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ll_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using probe::median;

using resident::gpu::kPartPayload;
using resident::gpu::kThreads;

struct Stamps {
  unsigned long long w_start, w_end, r_start, r_end;
};

__device__ __forceinline__ unsigned long long now() {
  return resident::gpu::globalTimerNs();
}

// The kernels' own LL store (kernels/ll_device.cuh).
__device__ __forceinline__ void storeLine(uint4* p, uint64_t v, uint32_t flag) {
  resident::gpu::storeLine(reinterpret_cast<unsigned char*>(p), v, flag);
}

// One LL line: the kernels' ld.volatile (how 0), ld.relaxed.sys (1, the memory model's way to
// poll) or ld.global.cg (2, cached in L2: not a valid way to poll, measured in the serial
// scenario only, where every line is there). True when both flag words carry `flag`.
__device__ __forceinline__ bool loadLineAs(int how, const uint4* p, uint32_t flag, uint64_t& v) {
  if (how == 0) return resident::gpu::loadLine(reinterpret_cast<const unsigned char*>(p), flag, v);
  uint32_t d0, f0, d1, f1;
  if (how == 1) {
    asm volatile("ld.relaxed.sys.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                 : "l"(p)
                 : "memory");
  } else {
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
                 : "l"(p)
                 : "memory");
  }
  v = static_cast<uint64_t>(d0) | (static_cast<uint64_t>(d1) << 32);
  return f0 == flag && f1 == flag;
}

__device__ __forceinline__ bool loadLine(const uint4* p, uint32_t flag, uint64_t& v) {
  return loadLineAs(0, p, flag, v);
}

__device__ __forceinline__ uint64_t pollLine(const uint4* p, uint32_t flag, uint32_t sleep_ns,
                                             int how = 0) {
  uint64_t v;
  while (!loadLineAs(how, p, flag, v))
    if (sleep_ns) __nanosleep(sleep_ns);
  return v;
}

// Credit modes of the writer (the send kernel's flow control before a round): 0 none; 1 thread
// 0 of every block polls the one host word until it carries `flag` (as the send kernel);
// 2 block 0's thread 0 polls the host word and publishes it in device memory, where the other
// blocks' thread 0 polls.
__global__ void writer(uint4* lines, const uint64_t* src, uint32_t parts, uint32_t ppb,
                       uint32_t flag, Stamps* s, const unsigned* host_credit = nullptr,
                       unsigned* dev_credit = nullptr, int credit_mode = 0) {
  const uint32_t t = threadIdx.x;
  if (t == 0) atomicMin(&s->w_start, now());
  if (credit_mode != 0) {
    if (t == 0) {
      const bool from_host = credit_mode == 1 || blockIdx.x == 0;
      const volatile unsigned* word = from_host ? host_credit : dev_credit;
      while (*word != flag) {
      }
      if (credit_mode == 2 && blockIdx.x == 0) {
        *reinterpret_cast<volatile unsigned*>(dev_credit) = flag;
        __threadfence();
      }
    }
    __syncthreads();
  }
  const uint32_t j0 = blockIdx.x * ppb, j1 = min(parts, j0 + ppb);
  for (uint32_t j = j0; j < j1; ++j) {
    const uint64_t i = static_cast<uint64_t>(j) * kThreads + t;
    storeLine(lines + i, __ldcg(reinterpret_cast<const unsigned long long*>(src) + i), flag);
  }
  __syncthreads();
  if (t == 0) atomicMax(&s->w_end, now());
}

enum Mode : int {
  kThread = 0,
  kBlock = 1,
  kRelaxed = 2,
  kCached = 3,
  kAbortCheck = 4,  // thread, and every 128 misses a read of one shared host word (as Waiter)
};

// Polls as Waiter::line does: every 128 misses the thread also reads the abort word, one host
// address shared by every thread of the grid.
__device__ __forceinline__ uint64_t pollLineCheckingAbort(const uint4* p, uint32_t flag,
                                                          const unsigned long long* abort_word,
                                                          unsigned long long* sink) {
  uint64_t v;
  for (uint32_t spins = 0; !loadLine(p, flag, v);) {
    if (++spins == 128) {
      spins = 0;
      unsigned long long a;
      asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(a) : "l"(abort_word) : "memory");
      if (a == 1ull) *sink = a;  // never true: keeps the load
    }
  }
  return v;
}

__global__ void reader(const uint4* lines, uint64_t* dst, uint32_t parts, uint32_t ppb,
                       uint32_t flag, int mode, Stamps* s,
                       const unsigned long long* abort_word = nullptr) {
  const uint32_t t = threadIdx.x;
  if (t == 0) atomicMin(&s->r_start, now());
  const uint32_t j0 = blockIdx.x * ppb, j1 = min(parts, j0 + ppb);
  if (mode == kBlock && j1 > j0) {
    if (t == 0) pollLine(lines + static_cast<uint64_t>(j1) * kThreads - 1, flag, 100);
    __syncthreads();
  }
  for (uint32_t j = j0; j < j1; ++j) {
    const uint64_t i = static_cast<uint64_t>(j) * kThreads + t;
    uint64_t v;
    if (mode == kAbortCheck) {
      v = pollLineCheckingAbort(lines + i, flag, abort_word, &s->w_start);
    } else {
      v = pollLine(lines + i, flag, 0, mode == kRelaxed ? 1 : mode == kCached ? 2 : 0);
    }
    dst[i] = v;
  }
  __syncthreads();
  if (t == 0) atomicMax(&s->r_end, now());
}

void resetStamps(Stamps* stamps) {
  const Stamps reset{~0ull, 0ull, ~0ull, 0ull};
  check(cudaMemcpy(stamps, &reset, sizeof reset, cudaMemcpyHostToDevice), "reset");
}

Stamps readStamps(const Stamps* stamps) {
  Stamps s;
  check(cudaMemcpy(&s, stamps, sizeof s, cudaMemcpyDeviceToHost), "stamps");
  return s;
}

void spinUs(double us) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() <
         us) {
  }
}

// Host memory for the lines, by one of the ways a process can get mapped pinned memory.
// Returns nullptr (and says why) where the way is not available here.
void* allocLines(const std::string& how, size_t bytes) {
  void* p = nullptr;
  if (how == "cudaHostAlloc") {
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    return p;
  }
  int flags = MAP_ANONYMOUS | (how == "private-thp" ? MAP_PRIVATE : MAP_SHARED);
  if (how == "shared-hugetlb") flags |= MAP_HUGETLB;
  // 2 MiB alignment so that a huge page can back the whole range.
  const size_t align = 2u << 20;
  void* raw = mmap(nullptr, bytes + align, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (raw == MAP_FAILED) {
    std::printf("{\"alloc\": \"%s\", \"error\": \"mmap failed (errno %d)\"}\n", how.c_str(), errno);
    return nullptr;
  }
  p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(raw) + align - 1) & ~(align - 1));
  if (how == "shared-thp" || how == "private-thp") madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);  // fault the pages in (huge ones where the kernel gives them)
  if (cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) !=
      cudaSuccess) {
    cudaGetLastError();
    std::printf("{\"alloc\": \"%s\", \"error\": \"cudaHostRegister failed\"}\n", how.c_str());
    return nullptr;
  }
  return p;
}

// The kernel page size and huge-page counters of the mapping holding p (from /proc/self/smaps).
std::string pageInfo(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line, out;
  bool in = false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  while (std::getline(f, line)) {
    unsigned long lo, hi;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > 8) {
      in = a >= lo && a < hi;
      continue;
    }
    if (in && (line.rfind("KernelPageSize", 0) == 0 || line.rfind("AnonHugePages", 0) == 0 ||
               line.rfind("ShmemPmdMapped", 0) == 0 || line.rfind("FilePmdMapped", 0) == 0)) {
      std::string k = line.substr(0, line.find(':')), v = line.substr(line.find(':') + 1);
      v.erase(0, v.find_first_not_of(' '));
      out += (out.empty() ? "" : ", ") + k + "=" + v;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 50;
  const std::string allocs = argc > 2 ? argv[2] : "shared";
  const std::string sections = argc > 3 ? argv[3] : "sweep,credit,abort";
  auto has = [&](const char* name) { return sections.find(name) != std::string::npos; };
  const uint32_t max_bytes = 256 * 1024;
  const size_t line_bytes = static_cast<size_t>(max_bytes) * 2;
  uint64_t *src = nullptr, *dst = nullptr;
  Stamps* stamps = nullptr;
  check(cudaMalloc(&src, max_bytes), "cudaMalloc");
  check(cudaMalloc(&dst, max_bytes), "cudaMalloc");
  check(cudaMalloc(&stamps, sizeof(Stamps)), "cudaMalloc");
  check(cudaMemset(src, 0x5a, max_bytes), "cudaMemset");
  cudaStream_t sw, sr;
  check(cudaStreamCreateWithFlags(&sw, cudaStreamNonBlocking), "stream");
  check(cudaStreamCreateWithFlags(&sr, cudaStreamNonBlocking), "stream");
  const char* mode_names[] = {"thread", "block", "relaxed", "cached"};
  uint32_t flag = 0;
  size_t from = 0;
  while (from <= allocs.size()) {
    const size_t comma = std::min(allocs.find(',', from), allocs.size());
    const std::string how = allocs.substr(from, comma - from);
    from = comma + 1;
    void* host = allocLines(how, line_bytes);
    if (!host) continue;
    std::printf("{\"alloc\": \"%s\", \"pages\": \"%s\"}\n", how.c_str(), pageInfo(host).c_str());
    std::fflush(stdout);
    uint4* lines = nullptr;
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&lines), host, 0), "device pointer");
    // Both kernels once, one after the other, before any run that launches the writer while the
    // reader polls: under lazy module loading a kernel's first launch waits for the kernels
    // running on the device, so a first writer launch behind a polling reader never starts.
    ++flag;
    writer<<<1, kThreads, 0, sw>>>(lines, src, 1, 1, flag, stamps);
    check(cudaStreamSynchronize(sw), "warm-up writer");
    reader<<<1, kThreads, 0, sr>>>(lines, dst, 1, 1, flag, kThread, stamps);
    check(cudaStreamSynchronize(sr), "warm-up reader");
    for (uint32_t bytes : {4096u, 16384u, 65536u, 262144u}) {
      if (!has("sweep")) break;
      const uint32_t parts = bytes / kPartPayload;
      for (uint32_t blocks : {1u, 2u, 4u, 8u, 16u, 32u}) {
        if (blocks > parts) continue;
        const uint32_t ppb = (parts + blocks - 1) / blocks;
        for (int mode : {int(kThread), int(kRelaxed), int(kBlock), int(kCached)}) {
          for (int concurrent = 0; concurrent < (mode == kCached ? 1 : 2); ++concurrent) {
            std::vector<double> write_us, read_us, total_us;
            for (int it = 0; it < iters + 3; ++it) {
              ++flag;
              resetStamps(stamps);
              if (concurrent) {
                reader<<<blocks, kThreads, 0, sr>>>(lines, dst, parts, ppb, flag, mode, stamps);
                spinUs(30);  // the reader polls before the first line is written
                writer<<<blocks, kThreads, 0, sw>>>(lines, src, parts, ppb, flag, stamps);
              } else {
                writer<<<blocks, kThreads, 0, sw>>>(lines, src, parts, ppb, flag, stamps);
                check(cudaStreamSynchronize(sw), "writer");
                reader<<<blocks, kThreads, 0, sr>>>(lines, dst, parts, ppb, flag, mode, stamps);
              }
              check(cudaStreamSynchronize(sw), "writer");
              check(cudaStreamSynchronize(sr), "reader");
              if (it < 3) continue;  // warm-up
              const Stamps s = readStamps(stamps);
              write_us.push_back((s.w_end - s.w_start) / 1e3);
              // serial: the reader's own time; concurrent: last line written to last line copied
              read_us.push_back(concurrent ? (s.r_end - s.w_end) / 1e3
                                           : (s.r_end - s.r_start) / 1e3);
              total_us.push_back(concurrent ? (s.r_end - s.w_start) / 1e3
                                            : (s.w_end - s.w_start + s.r_end - s.r_start) / 1e3);
            }
            std::printf(
                "{\"alloc\": \"%s\", \"bytes\": %u, \"blocks\": %u, \"parts_per_block\": %u, "
                "\"mode\": \"%s\", \"scenario\": \"%s\", \"write_us\": %.2f, \"read_us\": %.2f, "
                "\"total_us\": %.2f}\n",
                how.c_str(), bytes, blocks, ppb, mode_names[mode],
                concurrent ? "concurrent" : "serial", median(write_us), median(read_us),
                median(total_us));
            std::fflush(stdout);
          }
        }
      }
    }
    // The receiver's periodic abort-word read (Waiter::shouldStop every 128 misses) while it
    // waits for a late sender: 64 KiB over 16 blocks, the writer launched DELAY us after the
    // reader; read_us = last line written to last line read.
    if (has("abort")) {
      unsigned long long* abort_host =
          reinterpret_cast<unsigned long long*>(static_cast<char*>(host) + line_bytes - 128);
      *abort_host = 0;
      unsigned long long* abort_d = nullptr;
      check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&abort_d), abort_host, 0), "ptr");
      const uint32_t bytes = 65536, parts = bytes / kPartPayload, blocks = 16;
      const uint32_t ppb = (parts + blocks - 1) / blocks;
      for (double delay_us : {0.0, 200.0, 1000.0}) {
        for (int mode : {int(kThread), int(kAbortCheck)}) {
          std::vector<double> read_us;
          for (int it = 0; it < iters + 3; ++it) {
            ++flag;
            resetStamps(stamps);
            reader<<<blocks, kThreads, 0, sr>>>(lines, dst, parts, ppb, flag, mode, stamps,
                                                abort_d);
            spinUs(30 + delay_us);
            writer<<<blocks, kThreads, 0, sw>>>(lines, src, parts, ppb, flag, stamps);
            check(cudaStreamSynchronize(sw), "writer");
            check(cudaStreamSynchronize(sr), "reader");
            if (it < 3) continue;
            const Stamps st = readStamps(stamps);
            read_us.push_back((st.r_end - st.w_end) / 1e3);
          }
          std::printf(
              "{\"alloc\": \"%s\", \"bytes\": %u, \"blocks\": %u, \"late_sender_us\": %.0f, "
              "\"mode\": \"%s\", \"read_after_last_write_us\": %.2f}\n",
              how.c_str(), bytes, blocks, delay_us,
              mode == kThread ? "thread" : "thread+abort-word-every-128", median(read_us));
          std::fflush(stdout);
        }
      }
    }
    // The send kernel's credit wait, per block count: every block's thread 0 polls one host
    // word, or block 0 polls it and the others a device word (writer alone, 64 KiB).
    if (has("credit")) {
      unsigned* host_credit =
          reinterpret_cast<unsigned*>(static_cast<char*>(host) + line_bytes - 64);
      unsigned *host_credit_d = nullptr, *dev_credit = nullptr;
      check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_credit_d), host_credit, 0),
            "ptr");
      check(cudaMalloc(&dev_credit, 64), "cudaMalloc");
      const uint32_t bytes = 65536, parts = bytes / kPartPayload;
      for (uint32_t blocks : {1u, 2u, 4u, 8u, 16u, 32u}) {
        const uint32_t ppb = (parts + blocks - 1) / blocks;
        for (int credit = 0; credit < 3; ++credit) {
          std::vector<double> write_us;
          for (int it = 0; it < iters + 3; ++it) {
            ++flag;
            resetStamps(stamps);
            *reinterpret_cast<volatile unsigned*>(host_credit) = flag;
            writer<<<blocks, kThreads, 0, sw>>>(lines, src, parts, ppb, flag, stamps, host_credit_d,
                                                dev_credit, credit);
            check(cudaStreamSynchronize(sw), "writer");
            if (it < 3) continue;
            const Stamps st = readStamps(stamps);
            write_us.push_back((st.w_end - st.w_start) / 1e3);
          }
          const char* names[] = {"none", "every-block-host", "block0-host-others-device"};
          std::printf(
              "{\"alloc\": \"%s\", \"bytes\": %u, \"blocks\": %u, \"credit\": \"%s\", "
              "\"write_us\": %.2f}\n",
              how.c_str(), bytes, blocks, names[credit], median(write_us));
          std::fflush(stdout);
        }
      }
      check(cudaFree(dev_credit), "cudaFree");
    }
    if (how == "cudaHostAlloc") {
      check(cudaFreeHost(host), "cudaFreeHost");
    } else {
      check(cudaHostUnregister(host), "cudaHostUnregister");
    }
  }
  return 0;
}
