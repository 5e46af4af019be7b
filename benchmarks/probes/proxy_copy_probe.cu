// Where does the proxy path's time go on one host? The proxy (csrc/cuda/gpu_communicator_proxy.cpp)
// first checks every LL line of a trigger's range for its flags (host memory the GPU just wrote
// over PCIe), then the shm transport memcpys the range into the peer's inbox, which the peer's
// kernel then polls over PCIe. Per payload size (LL lines: twice the bytes), 50 runs each:
//   a writer kernel (the kernels' LL store, 2 KiB of payload per 256-thread part, one part per
//   block up to 16 blocks) fills buffer A (mapped host memory, as the outbox); this thread
//   processes A into B (as the peer's inbox) by a method, timed on the host clock from the first
//   line seen to the last one stored:
//     check+memcpy: the plain proxy order (every line's flags, then memcpy), with the two phases
//     split fused:        one pass: a 16-byte load per line, its flags checked, a 16-byte store
//     fused-nt:     the same with non-temporal stores (the lines bypass this core's cache)
//   then a reader kernel (the kernels' LL load) reads B into device memory, timed on the GPU —
//   and, as a reference, the same reader on A (lines the GPU wrote, never in a CPU cache).
// One JSON line per size and method, medians, microseconds. From the repository root:
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Xcompiler -msse4.1 -Ikernels -Icsrc \
//     benchmarks/probes/proxy_copy_probe.cu -o probe
#include <cuda_runtime.h>
#include <smmintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ll_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using probe::median;

using resident::gpu::kThreads;

struct Stamps {
  unsigned long long start, end;
};

__global__ void writer(unsigned char* lines, uint32_t nlines, uint32_t flag) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nlines; i += gridDim.x * blockDim.x)
    resident::gpu::storeLine(lines + 16ull * i, 0x0101010101010101ull * (i & 0xff), flag);
}

__global__ void reader(const unsigned char* lines, uint64_t* dst, uint32_t nlines, uint32_t flag,
                       Stamps* s) {
  if (threadIdx.x == 0) atomicMin(&s->start, resident::gpu::globalTimerNs());
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nlines;
       i += gridDim.x * blockDim.x) {
    uint64_t v;
    while (!resident::gpu::loadLine(lines + 16ull * i, flag, v)) {
    }
    dst[i] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&s->end, resident::gpu::globalTimerNs());
}

double nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool lineOk(const unsigned char* p, uint32_t flag) {
  const auto* w = reinterpret_cast<const uint32_t*>(p);
  return __atomic_load_n(w + 1, __ATOMIC_RELAXED) == flag &&
         __atomic_load_n(w + 3, __ATOMIC_RELAXED) == flag;
}

unsigned char* hostBuffer(size_t bytes, unsigned char** dev) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::exit(2);
  std::memset(p, 0, bytes);
  check(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), "register");
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(dev), p, 0), "pointer");
  return static_cast<unsigned char*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 50;
  const size_t max_lines = (1u << 20) / 8;  // 1 MiB of payload
  unsigned char *a_dev, *b_dev;
  unsigned char* a = hostBuffer(max_lines * 16, &a_dev);
  unsigned char* b = hostBuffer(max_lines * 16, &b_dev);
  uint64_t* dst;
  Stamps* stamps;
  check(cudaMalloc(&dst, max_lines * 8), "cudaMalloc");
  check(cudaMalloc(&stamps, sizeof(Stamps)), "cudaMalloc");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  uint32_t flag = 0;
  const char* names[] = {"check+memcpy", "fused", "fused-nt", "gpu-reads-outbox"};
  for (uint32_t payload : {4096u, 16384u, 65536u, 262144u, 1048576u}) {
    const uint32_t nlines = payload / 8;
    const uint32_t blocks = std::min(16u, std::max(1u, payload / 2048));
    for (int method = 0; method < 4; ++method) {
      std::vector<double> cpu_us, check_us, gpu_us;
      for (int it = 0; it < iters + 3; ++it) {
        ++flag;
        writer<<<blocks, kThreads, 0, s>>>(a_dev, nlines, flag);
        check(cudaGetLastError(), "writer");
        // The first line, then the whole range in order as the proxy would (spinning per line).
        while (!lineOk(a, flag)) {
        }
        const double t0 = nowUs();
        double t_check = t0;
        if (method == 0) {
          for (uint32_t i = 0; i < nlines; ++i)
            while (!lineOk(a + 16ull * i, flag)) {
            }
          __atomic_thread_fence(__ATOMIC_ACQUIRE);
          t_check = nowUs();
          std::memcpy(b, a, 16ull * nlines);
        } else if (method == 1 || method == 2) {
          for (uint32_t i = 0; i < nlines; ++i) {
            const auto* p = reinterpret_cast<const __m128i*>(a + 16ull * i);
            auto* q = reinterpret_cast<__m128i*>(b + 16ull * i);
            __m128i v;
            for (;;) {
              asm volatile("" ::: "memory");  // re-load every pass
              v = _mm_load_si128(p);
              const uint32_t f1 = static_cast<uint32_t>(_mm_extract_epi32(v, 1));
              const uint32_t f3 = static_cast<uint32_t>(_mm_extract_epi32(v, 3));
              if (f1 == flag && f3 == flag) break;
            }
            if (method == 1)
              _mm_store_si128(q, v);
            else
              _mm_stream_si128(q, v);
          }
          if (method == 2) _mm_sfence();
        } else {
          for (uint32_t i = 0; i < nlines; ++i)
            while (!lineOk(a + 16ull * i, flag)) {
            }
        }
        const double t1 = nowUs();
        check(cudaStreamSynchronize(s), "writer sync");
        const Stamps reset{~0ull, 0ull};
        check(cudaMemcpy(stamps, &reset, sizeof reset, cudaMemcpyHostToDevice), "reset");
        reader<<<blocks, kThreads, 0, s>>>(method == 3 ? a_dev : b_dev, dst, nlines, flag, stamps);
        check(cudaStreamSynchronize(s), "reader");
        Stamps st;
        check(cudaMemcpy(&st, stamps, sizeof st, cudaMemcpyDeviceToHost), "stamps");
        if (it < 3) continue;
        cpu_us.push_back(t1 - t0);
        check_us.push_back(t_check - t0);
        gpu_us.push_back((st.end - st.start) / 1e3);
      }
      std::printf(
          "{\"payload\": %u, \"line_bytes\": %u, \"blocks\": %u, \"method\": \"%s\", "
          "\"cpu_us\": %.2f, \"cpu_check_us\": %.2f, \"gpu_read_us\": %.2f}\n",
          payload, nlines * 16, blocks, names[method], median(cpu_us),
          method == 0 ? median(check_us) : 0.0, median(gpu_us));
      std::fflush(stdout);
    }
  }
  return 0;
}
