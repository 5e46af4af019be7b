// launch_cost_probe.cu: the host's cost of each CUDA call an eager op of the CUDA path makes
// (csrc/c10d/work_cuda.cpp, CudaPath::collective), one process, as batches of 200 back-to-back
// calls on one stream then one synchronize (as benchmarks/overhead.py times an eager op):
// a launch with the library's launch helper (programmatic dependent launch, through the
// driver's cuLaunchKernelEx with the kernel's handle looked up once) of a kernel taking the
// library's CollectiveArgs by value (~2.8 KB of parameters) and of one taking 24 bytes, a
// plain <<<>>> launch, the same launch through the runtime's cudaLaunchKernelEx, and each call
// around the launch: the capture check, the event record of the op's end (each through the
// runtime and through the driver's entry point), the device guard's get/set. Rows
// `launch_args_<N>_bytes_pdl` take N bytes of parameters (the cost of a launch by the size of its
// arguments). The rows' batches alternate, one batch of each row per round, so that the host's
// drift moves every row alike. Each kernel counts its runs; a count short of the launches fails the
// probe (exit status 1).
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/launch_cost_probe.cu \
//     -o /tmp/launch_cost_probe && /tmp/launch_cost_probe [batches]
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "exchange_args.hpp"
#include "launch_device.cuh"
#include "probe_util.hpp"

namespace {

using resident::gpu::CollectiveArgs;
using resident::gpu::launchKernel;

constexpr int kBatch = 200;

// A driver function through the library's lookup (launch_device.cuh); the probe stops if the
// driver lacks it.
template <typename Fn>
Fn driverEntry(const char* name) {
  const Fn fn = resident::gpu::detail::driverEntry<Fn>(name);
  if (fn == nullptr) probe::check(cudaErrorSymbolNotFound, name);
  return fn;
}

struct SmallArgs {
  unsigned long long* count;
  const void* in;
  unsigned long long bytes;
};

__global__ void countSmall(SmallArgs a) {
  if (threadIdx.x == 0) atomicAdd(a.count, 1ull);
}

// N bytes of parameters, the counter first.
template <size_t N>
struct ArgsOfSize {
  unsigned long long* count;
  unsigned char rest[N - sizeof(unsigned long long*)];
};

template <size_t N>
__global__ void countSized(ArgsOfSize<N> a) {
  if (threadIdx.x == 0) atomicAdd(a.count, 1ull);
}

// The counter rides in the args' first pointer field, the rest is what an op passes.
__global__ void countCollective(CollectiveArgs a) {
  if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(a.out), 1ull);
}

// Median µs per call of each row, over `batches` rounds; in each round every row runs one
// batch of kBatch calls then a synchronize.
struct Row {
  const char* name;
  std::function<void()> call;
  double us = 0;
};

void timeRows(std::vector<Row>& rows, cudaStream_t s, int batches) {
  std::vector<std::vector<double>> v(rows.size());
  for (int b = 0; b < batches; ++b) {
    for (size_t r = 0; r < rows.size(); ++r) {
      probe::check(cudaStreamSynchronize(s), "sync");
      const double t0 = probe::nowUs();
      for (int i = 0; i < kBatch; ++i) rows[r].call();
      const double t1 = probe::nowUs();
      probe::check(cudaStreamSynchronize(s), "sync");
      v[r].push_back((t1 - t0) / kBatch);
    }
  }
  for (size_t r = 0; r < rows.size(); ++r) rows[r].us = probe::median(v[r]);
}

}  // namespace

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 31;
  cudaStream_t s;
  probe::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaEvent_t ev;
  probe::check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event");
  unsigned long long* count;
  probe::check(cudaMalloc(&count, sizeof(*count)), "malloc");
  probe::check(cudaMemset(count, 0, sizeof(*count)), "memset");
  SmallArgs small{count, nullptr, 8};
  CollectiveArgs coll{};
  coll.out = count;
  unsigned long long launched = 0;
  auto launchSmall = [&] {
    probe::check(launchKernel<countSmall>(small, 1, s), "launch");
    ++launched;
  };
  auto launchColl = [&] {
    probe::check(launchKernel<countCollective>(coll, 1, s), "launch");
    ++launched;
  };
  auto launchCollRuntime = [&] {
    probe::check(launchKernel(countCollective, coll, 1, s), "launch");
    ++launched;
  };
  ArgsOfSize<512> args512{count, {}};
  ArgsOfSize<1024> args1024{count, {}};
  ArgsOfSize<2048> args2048{count, {}};
  ArgsOfSize<4096> args4096{count, {}};
  auto launchSized = [&](const auto& args) {
    return [&] {
      probe::check(launchKernel<countSized<sizeof(args)>>(args, 1, s), "launch");
      ++launched;
    };
  };
  auto launchPlain = [&] {
    countSmall<<<1, 256, 0, s>>>(small);
    ++launched;
  };
  auto captureCheckThenLaunch = [&] {
    cudaStreamCaptureStatus c;
    probe::check(cudaStreamIsCapturing(s, &c), "capturing");
    launchColl();
  };
  auto launchThenRecord = [&] {
    launchColl();
    probe::check(cudaEventRecord(ev, s), "record");
  };
  using EventRecordFn = CUresult (*)(CUevent, CUstream);
  using IsCapturingFn = CUresult (*)(CUstream, CUstreamCaptureStatus*);
  const auto cuRecord = driverEntry<EventRecordFn>("cuEventRecord");
  const auto cuCapturing = driverEntry<IsCapturingFn>("cuStreamIsCapturing");
  auto captureCheckDriverThenLaunch = [&] {
    CUstreamCaptureStatus c;
    if (cuCapturing(s, &c) != CUDA_SUCCESS) probe::check(cudaErrorUnknown, "cuStreamIsCapturing");
    launchColl();
  };
  auto launchThenRecordDriver = [&] {
    launchColl();
    if (cuRecord(ev, s) != CUDA_SUCCESS) probe::check(cudaErrorUnknown, "cuEventRecord");
  };
  auto guardThenLaunch = [&] {
    int d = -1;
    probe::check(cudaGetDevice(&d), "get device");
    probe::check(cudaSetDevice(d), "set device");
    launchColl();
  };
  std::vector<Row> rows = {{"launch_small_args_pdl", launchSmall},
                           {"launch_collective_args_pdl", launchColl},
                           {"launch_small_args_plain", launchPlain},
                           {"launch_collective_args_pdl_runtime", launchCollRuntime},
                           {"capture_check_then_launch", captureCheckThenLaunch},
                           {"launch_then_event_record", launchThenRecord},
                           {"capture_check_driver_then_launch", captureCheckDriverThenLaunch},
                           {"launch_then_event_record_driver", launchThenRecordDriver},
                           {"device_guard_then_launch", guardThenLaunch},
                           {"launch_args_512_bytes_pdl", launchSized(args512)},
                           {"launch_args_1024_bytes_pdl", launchSized(args1024)},
                           {"launch_args_2048_bytes_pdl", launchSized(args2048)},
                           {"launch_args_4096_bytes_pdl", launchSized(args4096)}};
  probe::check(cudaSetDevice(0), "set device");
  timeRows(rows, s, 3);  // warm-up
  timeRows(rows, s, batches);
  probe::check(cudaStreamSynchronize(s), "sync");
  unsigned long long counted = 0;
  probe::check(cudaMemcpy(&counted, count, sizeof(counted), cudaMemcpyDeviceToHost), "copy");
  const bool ok = counted == launched;
  const char* mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  for (const Row& r : rows)
    std::printf(
        "{\"variant\": \"%s\", \"us_per_call\": %.3f, \"collective_args_bytes\": %zu, "
        "\"mps_pipe\": \"%s\", \"batch\": %d, \"batches\": %d, \"correct\": %s}\n",
        r.name, r.us, sizeof(CollectiveArgs), mps ? mps : "", kBatch, batches,
        ok ? "true" : "false");
  if (!ok) {
    std::printf("{\"error\": \"kernels ran %llu times, %llu launched\"}\n", counted, launched);
    return 1;
  }
  probe::freeDevice({count});
  return 0;
}
