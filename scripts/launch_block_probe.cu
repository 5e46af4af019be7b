// Does a kernel launch from one thread block while another thread waits in a CUDA call on a
// stream that is itself blocked in a stream wait-value (the persistent mode's graph-replay
// relaunch, issue 5)? Mirrors it: stream A waits (cuStreamWaitValue32) for a word in mapped
// host memory; the main thread then waits on A (a pageable D2H copy, a pinned one plus a
// stream synchronize, or a stream synchronize alone); a second thread launches, on a
// high-priority non-blocking stream B, the kernel that writes the word. If the launch has not
// returned after 3 s the host writes the word itself, and the probe reports the launch as
// blocked. One line of JSON per run.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 launch_block_probe.cu -o launch_block_probe
//   ./launch_block_probe {coop|plain} {[graph-|legacy-]pageable|pinned|sync} [EXTRA [normal|high
//   [STACK]]]
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "probe_util.hpp"

namespace {

using probe::check;

__global__ void release(volatile unsigned* word) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    __threadfence_system();
    *word = 1;
    __threadfence_system();
  }
}

// The same with a per-thread stack frame of Bytes (a volatile local array): does a kernel that
// needs local memory block where one that needs none does not?
template <int Bytes>
__global__ void releaseWithStack(volatile unsigned* word, int n) {
  volatile unsigned char buf[Bytes];
  for (int i = 0; i < n; ++i) buf[(i * 7) % Bytes] = static_cast<unsigned char>(i);
  if (blockIdx.x == 0 && threadIdx.x == 0 && buf[n % Bytes] != 0xFFu) {
    __threadfence_system();
    *word = 1;
    __threadfence_system();
  }
}

double secondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const bool coop = argc > 1 && std::strcmp(argv[1], "coop") == 0;
  const char* wait = argc > 2 ? argv[2] : "pageable";
  const char* mode = wait;
  check(cudaSetDevice(0), "cudaSetDevice");
  unsigned* host_word = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&host_word), sizeof(unsigned), cudaHostAllocMapped),
        "cudaHostAlloc");
  *host_word = 0;
  unsigned* dev_word = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_word), host_word, 0),
        "cudaHostGetDevicePointer");
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t a = nullptr, b = nullptr;
  check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream a");
  // Streams created between A and B: with CUDA_DEVICE_MAX_CONNECTIONS hardware queues handed
  // out in turn, B may then share A's queue (as in a process with many streams).
  const int extra = argc > 3 ? std::atoi(argv[3]) : 0;
  const bool b_high = !(argc > 4 && std::strcmp(argv[4], "normal") == 0);
  std::vector<cudaStream_t> between(extra);
  for (auto& st : between) check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "extra");
  check(cudaStreamCreateWithPriority(&b, cudaStreamNonBlocking, b_high ? greatest : least),
        "stream b");
  const size_t bytes = 1 << 16;
  void* dbuf = nullptr;
  check(cudaMalloc(&dbuf, bytes), "cudaMalloc");
  std::vector<char> pageable(bytes);
  void* pinned = nullptr;
  check(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault), "pinned");
  const int stack = argc > 5 ? std::atoi(argv[5]) : 0;
  void (*stack_kernel)(volatile unsigned*, int) = nullptr;
  if (stack >= 8192)
    stack_kernel = releaseWithStack<8192>;
  else if (stack >= 2048)
    stack_kernel = releaseWithStack<2048>;
  else if (stack > 0)
    stack_kernel = releaseWithStack<128>;
  // Warm the kernel (module load) so the probed launch is an ordinary one.
  release<<<1, 32, 0, b>>>(dev_word);
  if (stack_kernel != nullptr) stack_kernel<<<4, 256, 0, b>>>(dev_word, 300);
  check(cudaStreamSynchronize(b), "warm-up");
  *host_word = 0;

  // Through the runtime's entry point: no link against libcuda.
  using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  check(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault,
                                         &found),
        "cudaGetDriverEntryPointByVersion");
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::printf("{\"error\": \"no cuStreamWaitValue32\"}\n");
    return 2;
  }
  // graph-pageable: the wait is a node of a captured graph, replayed (as in the persistent
  // mode's graph replays).
  const bool in_graph = std::strncmp(wait, "graph-", 6) == 0;
  if (in_graph) wait += 6;
  // legacy-*: the wait and the main thread's copy on the legacy default stream (PyTorch's
  // default current stream), not on a non-blocking stream.
  if (std::strncmp(wait, "legacy-", 7) == 0) {
    wait += 7;
    a = cudaStreamLegacy;
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (in_graph) check(cudaStreamBeginCapture(a, cudaStreamCaptureModeRelaxed), "begin capture");
  CUresult r = reinterpret_cast<WaitValueFn>(fn)(a, reinterpret_cast<CUdeviceptr>(dev_word), 1,
                                                 CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    std::printf("{\"error\": \"cuStreamWaitValue32 failed: %d\"}\n", static_cast<int>(r));
    return 2;
  }
  if (in_graph) {
    check(cudaStreamEndCapture(a, &graph), "end capture");
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    check(cudaGraphLaunch(exec, a), "graph launch");
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<double> launch_returned{-1.0};
  std::atomic<int> launch_err{0};
  std::thread launcher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the main thread waits by now
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(4);
    cfg.blockDim = dim3(128);
    cfg.stream = b;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = coop ? 1 : 0;
    cudaError_t e;
    if (stack_kernel != nullptr) {
      cfg.blockDim = dim3(256);
      e = cudaLaunchKernelEx(&cfg, stack_kernel, static_cast<volatile unsigned*>(dev_word), 300);
    } else {
      e = cudaLaunchKernelEx(&cfg, release, static_cast<volatile unsigned*>(dev_word));
    }
    launch_err.store(static_cast<int>(e));
    launch_returned.store(secondsSince(t0));
  });
  std::atomic<bool> host_released{false};
  std::thread rescuer([&] {
    while (secondsSince(t0) < 3.2) {
      if (launch_returned.load() >= 0 && __atomic_load_n(host_word, __ATOMIC_ACQUIRE) != 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (__atomic_load_n(host_word, __ATOMIC_ACQUIRE) == 0) {
      host_released.store(true);
      __atomic_store_n(host_word, 1u, __ATOMIC_RELEASE);
    }
  });
  cudaError_t e = cudaSuccess;
  if (std::strcmp(wait, "pageable") == 0) {
    e = cudaMemcpyAsync(pageable.data(), dbuf, bytes, cudaMemcpyDeviceToHost, a);
    if (e == cudaSuccess) e = cudaStreamSynchronize(a);
  } else if (std::strcmp(wait, "pinned") == 0) {
    e = cudaMemcpyAsync(pinned, dbuf, bytes, cudaMemcpyDeviceToHost, a);
    if (e == cudaSuccess) e = cudaStreamSynchronize(a);
  } else {
    e = cudaStreamSynchronize(a);
  }
  const double main_returned = secondsSince(t0);
  launcher.join();
  rescuer.join();
  check(e, "main thread's wait");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const double lr = launch_returned.load();
  std::printf(
      "{\"launch\": \"%s\", \"main_waits_in\": \"%s\", \"launch_returned_s\": %.3f, "
      "\"main_returned_s\": %.3f, \"host_had_to_release\": %s, \"launch_blocked\": %s, "
      "\"kernel_released_the_wait\": %s, \"launch_error\": %d, \"streams_between\": %d, "
      "\"b_priority\": \"%s\", \"stack_bytes\": %d}\n",
      coop ? "cooperative" : "plain", mode, lr, main_returned,
      host_released.load() ? "true" : "false", host_released.load() && lr > 3.0 ? "true" : "false",
      host_released.load() ? "false" : "true", launch_err.load(), extra,
      b_high ? "greatest" : "least", stack);
  return 0;
}
