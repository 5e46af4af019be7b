// floors.cu: one-way latency floors of moving small messages through mapped pinned host memory.
// Standalone (no torch); see README.md for what each floor means and how to run it under MPS.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "floor_results.hpp"

[[noreturn]] static void Die(const char* file, int line, const char* what, const char* why) {
  fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, why);
  exit(2);
}
// Every CUDA runtime call is checked; a failure prints file:line and exits with status 2.
#define CK(call)                                                                   \
  do {                                                                             \
    const cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) Die(__FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
  } while (0)
#define PCK(cond)                                                 \
  do {                                                            \
    if (!(cond)) Die(__FILE__, __LINE__, #cond, strerror(errno)); \
  } while (0)

namespace {

constexpr uint64_t kAbort = ~0ull;                  // written to a flag to release a stuck peer
constexpr uint64_t kSpinTimeoutNs = 2000000000ull;  // any single device wait
constexpr uint64_t kBudgetNs = 5000000000ull;       // whole ping-pong kernel (time-sliced case)
constexpr int kBatch = 10;  // reps per sample: keeps samples far above timer granularity
constexpr int kWarmup = 200;
constexpr size_t kShmBytes = 4096;
enum : int { kOk = 0, kTimeout = 1, kPeerAbort = 2, kBudget = 3 };
const char* ErrName(int e) {
  const char* n[] = {"ok", "timeout", "peer_abort", "budget_truncated"};
  return e >= 0 && e <= 3 ? n[e] : "not_run";
}

// Flags on separate 128 B lines so the two directions never share a line. Lives in one page of
// mapped pinned (or registered shm) host memory; the host-only fields coordinate the processes.
struct Mailbox {
  alignas(128) uint64_t ping;     // written by the pinger kernel
  alignas(128) uint64_t pong;     // written by the responder (host thread or the other process)
  alignas(128) uint64_t go;       // blocker kernel token / child start signal
  uint64_t ping_done, pong_done;  // round trips completed, written by each kernel at its end
  int32_t ping_err, pong_err, blocker_timeout;
  int32_t child_ready, child_done;
};
static_assert(sizeof(Mailbox) <= kShmBytes, "mailbox must fit one page");
struct PingStatus {
  uint64_t done;
  int err;
};

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void StReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t LdAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// How a flag is published and polled. kAcqRel: an 8-byte st.release.sys / ld.acquire.sys (what
// a flag that guards other data needs). kLl: the kernels' LL line (kernels/ll_device.cuh): one
// 16-byte st.volatile carrying the value and two copies of it as flag, polled by ld.volatile,
// no fence — how the library signals a small message, whose data travels in the flag's line.
enum FlagKind : int { kAcqRel = 0, kLl = 1 };

__device__ __forceinline__ void Publish(uint64_t* p, uint64_t v, int kind) {
  if (kind == kAcqRel) return StReleaseSys(p, v);
  const uint32_t lo = uint32_t(v), hi = uint32_t(v >> 32);
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(lo), "r"(lo),
               "r"(hi), "r"(lo)
               : "memory");
}
// The value, or 0 while an LL line is not whole (its flag copies differ from its value).
__device__ __forceinline__ uint64_t Poll(const uint64_t* p, int kind) {
  if (kind == kAcqRel) return LdAcquireSys(p);
  uint32_t d0, f0, d1, f1;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
               : "l"(p)
               : "memory");
  return f0 == d0 && f1 == d0 ? (uint64_t(d1) << 32 | d0) : 0;
}

// Every device spin is bounded by %globaltimer (wall clock, keeps running while descheduled).
__device__ int WaitEq(const uint64_t* p, uint64_t want, int kind = kAcqRel) {
  const uint64_t t0 = GlobalTimer();
  for (;;) {
    const uint64_t v = Poll(p, kind);
    if (v == want) return kOk;
    if (v == kAbort) return kPeerAbort;
    if (GlobalTimer() - t0 > kSpinTimeoutNs) return kTimeout;
  }
}

// One thread: publish seq on `out`, wait for the echo on `in`; a timestamp every kBatch round
// trips. Timestamps go to shared memory: a global store before each st.release.sys would add
// its drain to the measured path. Sequence numbers run from base + 1 to base + n.
__global__ void Pinger(Mailbox* m, uint64_t n, uint64_t* ts, uint64_t base, int kind) {
  uint64_t *out = &m->ping, *in = &m->pong;
  extern __shared__ uint64_t sts[];
  sts[0] = GlobalTimer();
  uint64_t done = 0;
  int err = kOk;
  while (done < n) {
    Publish(out, base + done + 1, kind);
    if ((err = WaitEq(in, base + done + 1, kind)) != kOk) break;
    if (++done % kBatch == 0) {
      const uint64_t t = sts[done / kBatch] = GlobalTimer();
      if (t - sts[0] > kBudgetNs && done < n) {
        err = kBudget;
        break;
      }
    }
  }
  if (err == kTimeout || err == kBudget) Publish(out, kAbort, kind);
  for (uint64_t b = 0; b <= done / kBatch; ++b) ts[b] = sts[b];
  m->ping_done = done;
  m->ping_err = err;
}

// The other process's half: echo each seq it sees. Adds its round trips to pong_done and keeps
// the first error in pong_err (one launch per flag kind).
__global__ void Ponger(Mailbox* m, uint64_t n, uint64_t base, int kind) {
  uint64_t *out = &m->pong, *in = &m->ping, done = 0;
  int err = kOk;
  while (done < n) {
    if ((err = WaitEq(in, base + done + 1, kind)) != kOk) break;
    Publish(out, base + ++done, kind);
  }
  if (err == kTimeout) Publish(out, kAbort, kind);
  m->pong_done += done;
  if (m->pong_err == kOk) m->pong_err = err;
}

// Holds the stream until the host has queued a whole batch, so the batch is timed back-to-back
// on the GPU instead of at the host's launch rate.
__global__ void Blocker(const uint64_t* go, uint64_t token, int32_t* timed_out) {
  if (WaitEq(go, token) != kOk) *timed_out = 1;
}

__global__ void Empty() {}

// 16 B per thread; four loads in flight per thread before the stores, because every load from
// host memory is a PCIe round trip. n must be a multiple of 8.
__global__ void Copy16(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, size_t n) {
  const size_t nv = n / 16, stride = size_t(gridDim.x) * blockDim.x;
  const size_t t = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint4* s = reinterpret_cast<const uint4*>(src);
  size_t i = t;
  for (; i + 3 * stride < nv; i += 4 * stride) {
    const uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
    d[i] = a, d[i + stride] = b, d[i + 2 * stride] = c, d[i + 3 * stride] = e;
  }
  for (; i < nv; i += stride) d[i] = s[i];
  if (n % 16 != 0 && t == 0) {
    *reinterpret_cast<uint2*>(dst + nv * 16) = *reinterpret_cast<const uint2*>(src + nv * 16);
  }
}

double NowUs() {
  using Us = std::chrono::duration<double, std::micro>;
  return Us(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs Pinger on mailbox h (device view d) while `respond` runs on this thread; returns the
// kernel's status and per-batch timestamps.
template <class F>
PingStatus RunPinger(cudaStream_t s, Mailbox* h, Mailbox* d, uint64_t n, std::vector<uint64_t>* ts,
                     F respond, uint64_t base = 0, int kind = kAcqRel) {
  ts->resize(n / kBatch + 1);
  const size_t smem = ts->size() * sizeof(uint64_t);
  uint64_t* ts_d;
  CK(cudaMalloc(&ts_d, smem));
  h->ping_err = -1;  // stays -1 if the kernel never ran
  CK(cudaFuncSetAttribute(Pinger, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  Pinger<<<1, 1, smem, s>>>(d, n, ts_d, base, kind);
  CK(cudaGetLastError());
  respond();
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(ts->data(), ts_d, smem, cudaMemcpyDeviceToHost));
  CK(cudaFree(ts_d));
  return {h->ping_done, h->ping_err};
}

// Maps the shared segment and registers it as mapped pinned memory of this process's context.
Mailbox* MapShm(int fd, Mailbox** d) {
  void* p = mmap(nullptr, kShmBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  PCK(p != MAP_FAILED);
  CK(cudaHostRegister(p, kShmBytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  CK(cudaHostGetDevicePointer(d, p, 0));
  return static_cast<Mailbox*>(p);
}

// One-way samples (round trip / 2, averaged over kBatch round trips), warm-up dropped.
Result FlagResult(const char* name, const std::vector<uint64_t>& ts, const PingStatus& st,
                  uint64_t n, const std::string& note) {
  std::vector<double> v;
  for (uint64_t b = kWarmup / kBatch; b < std::min<uint64_t>(st.done, n) / kBatch; ++b) {
    v.push_back(double(ts[b + 1] - ts[b]) / (2.0 * kBatch) / 1000.0);
  }
  const std::string what = "round_trips=" + std::to_string(st.done) + "/" + std::to_string(n) +
                           " kernel=" + ErrName(st.err) + note;
  return Summarize(
      {name, "", 8, "us one-way (round trip / 2)", what, st.err == kOk || st.err == kBudget}, v);
}

// 1. GPU -> spinning host thread -> GPU.
Result GpuCpuGpuFlag(cudaStream_t s, uint64_t n) {
  Mailbox *h, *d;
  CK(cudaHostAlloc(&h, kShmBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  memset(h, 0, kShmBytes);
  CK(cudaHostGetDevicePointer(&d, h, 0));
  std::string note;
  std::vector<uint64_t> ts;
  const PingStatus st = RunPinger(s, h, d, n, &ts, [&] {
    // The host responder; its own deadline covers a kernel that never starts.
    const double deadline = NowUs() + 1e-3 * (kBudgetNs + 3 * kSpinTimeoutNs);
    for (uint64_t i = 1; i <= n && note.empty(); ++i) {
      for (uint32_t spins = 0;; ++spins) {
        const uint64_t v = __atomic_load_n(&h->ping, __ATOMIC_ACQUIRE);
        if (v == i) break;
        if (v == kAbort) note = " host=saw_abort";
        if (v != kAbort && (spins & 1023) == 0 && NowUs() > deadline) note = " host=timeout";
        if (!note.empty()) break;
      }
      __atomic_store_n(&h->pong, note.empty() ? i : kAbort, __ATOMIC_RELEASE);
    }
  });
  CK(cudaFreeHost(h));
  return FlagResult("gpu_cpu_gpu_flag", ts, st, n, note);
}

// Child of fork(): its own CUDA context on GPU 0, echoing through the shared segment.
int ChildMain(int fd, uint64_t n, pid_t parent) {
  CK(cudaSetDeviceFlags(cudaDeviceScheduleSpin));
  CK(cudaSetDevice(0));
  Mailbox *d, *h = MapShm(fd, &d);
  __atomic_store_n(&h->child_ready, 1, __ATOMIC_RELEASE);
  // Wait for the parent to reach this floor (go == 1); leave if it gave up (2) or died.
  for (uint64_t g; (g = __atomic_load_n(&h->go, __ATOMIC_ACQUIRE)) != 1; usleep(100)) {
    if (g == 2 || getppid() != parent) return 3;
  }
  h->pong_done = 0;
  h->pong_err = kOk;
  // Both flag kinds, in the parent's order: sequence numbers 1..n, then n+1..2n.
  Ponger<<<1, 1>>>(d, n, 0, kAcqRel);
  Ponger<<<1, 1>>>(d, n, n, kLl);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  __atomic_store_n(&h->child_done, 1, __ATOMIC_RELEASE);
  CK(cudaHostUnregister(h));
  return 0;
}

// 2. Kernel in this process <-> kernel in the forked child, through the registered shm page:
// with acquire/release flags (variant "") and with LL lines (variant "ll"), one after the other.
void CrossProcessFlag(cudaStream_t s, int fd, pid_t child, uint64_t n, std::vector<Result>& out) {
  Mailbox *d, *h = MapShm(fd, &d);
  PingStatus st{0, -1}, st_ll{0, -1};
  std::vector<uint64_t> ts, ts_ll;
  std::string note;
  bool reaped = false, child_ok = false;
  int wstatus = 0;
  // Polls a flag the child sets, noticing if the child exits instead.
  auto wait_flag = [&](int32_t* f, double sec) {
    for (const double end = NowUs() + sec * 1e6;; usleep(100)) {
      if (__atomic_load_n(f, __ATOMIC_ACQUIRE)) return true;
      if (!reaped) reaped = waitpid(child, &wstatus, WNOHANG) == child;
      if (reaped || NowUs() > end) return __atomic_load_n(f, __ATOMIC_ACQUIRE) != 0;
    }
  };
  if (!wait_flag(&h->child_ready, 60)) {
    __atomic_store_n(&h->go, uint64_t(2), __ATOMIC_RELEASE);
    note = " child=not_ready";
  } else {
    __atomic_store_n(&h->go, uint64_t(1), __ATOMIC_RELEASE);
    st = RunPinger(s, h, d, n, &ts, [] {});
    st_ll = RunPinger(
        s, h, d, n, &ts_ll, [] {}, n, kLl);
    if (!wait_flag(&h->child_done, 30)) {
      note = " child=no_report";
    } else {
      note = std::string(" child=") + ErrName(h->pong_err) +
             " child_round_trips=" + std::to_string(h->pong_done);
      // The child sees peer_abort when we cut a time-sliced run short; that is not a fault.
      const bool budget = st.err == kBudget || st_ll.err == kBudget;
      child_ok = h->pong_err == kOk || (budget && h->pong_err == kPeerAbort);
    }
  }
  // Every wait in the child is bounded, so it exits soon; kill it (by pid) only if it does not.
  for (const double end = NowUs() + 30e6; !reaped && NowUs() < end; usleep(1000)) {
    reaped = waitpid(child, &wstatus, WNOHANG) == child;
  }
  if (!reaped) {
    kill(child, SIGKILL);
    waitpid(child, &wstatus, 0);
    note += " child=killed";
  } else if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    note += " child_exit=" + std::to_string(WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1);
    child_ok = false;
  }
  CK(cudaHostUnregister(h));
  PCK(munmap(h, kShmBytes) == 0);
  for (int kind : {kAcqRel, kLl}) {
    Result r = FlagResult("cross_process_flag", kind == kLl ? ts_ll : ts, kind == kLl ? st_ll : st,
                          n, note);
    r.variant = kind == kLl ? "ll" : "";
    r.ok = r.ok && child_ok && reaped;
    out.push_back(r);
  }
}

// Time `reps` back-to-back calls of `enqueue` with events, the stream held by Blocker meanwhile.
template <class F>
double TimedBatchUs(cudaStream_t s, Mailbox* h, Mailbox* d, cudaEvent_t e0, cudaEvent_t e1,
                    int reps, F enqueue) {
  const uint64_t token = h->go + 1;
  Blocker<<<1, 1, 0, s>>>(&d->go, token, &d->blocker_timeout);
  CK(cudaGetLastError());
  CK(cudaEventRecord(e0, s));
  for (int i = 0; i < reps; ++i) enqueue();
  CK(cudaEventRecord(e1, s));
  __atomic_store_n(&h->go, token, __ATOMIC_RELEASE);
  CK(cudaEventSynchronize(e1));
  if (h->blocker_timeout) Die(__FILE__, __LINE__, "Blocker", "host flag never seen by the GPU");
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  return 1000.0 * ms / reps;
}

// 3. N bytes GPU -> mapped host -> GPU: two SM copy kernels vs two copy-engine memcpys, each
// pair as one graph; verified byte-exact.
void DataFloor(cudaStream_t s, long iters, std::vector<Result>& out) {
  Mailbox *mh, *md;
  CK(cudaHostAlloc(&mh, kShmBytes, cudaHostAllocMapped));
  memset(mh, 0, kShmBytes);
  CK(cudaHostGetDevicePointer(&md, mh, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::mt19937_64 rng(12345);
  for (size_t n : {size_t(8), size_t(1) << 10, size_t(4) << 10, size_t(8) << 10, size_t(16) << 10,
                   size_t(64) << 10, size_t(256) << 10, size_t(1) << 20}) {
    std::vector<uint8_t> in(n), back(n);
    for (auto& b : in) b = uint8_t(rng());
    uint8_t *src, *dst, *host, *host_d;
    CK(cudaMalloc(&src, n));
    CK(cudaMalloc(&dst, n));
    CK(cudaHostAlloc(&host, n, cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(&host_d, host, 0));
    CK(cudaMemcpy(src, in.data(), n, cudaMemcpyHostToDevice));
    const int ctas = int(std::max<size_t>(1, std::min<size_t>(n / 4096, 32)));
    for (int ce = 0; ce < 2; ++ce) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      if (ce) {
        CK(cudaMemcpyAsync(host, src, n, cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpyAsync(dst, host, n, cudaMemcpyHostToDevice, s));
      } else {
        Copy16<<<ctas, 256, 0, s>>>(host_d, src, n);
        Copy16<<<ctas, 256, 0, s>>>(dst, host_d, n);
        CK(cudaGetLastError());
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      // Zero both targets, then check the first replay alone and the last timed one.
      bool ok = true;
      auto zero = [&] {
        memset(host, 0, n);
        CK(cudaMemset(dst, 0, n));
        CK(cudaDeviceSynchronize());
      };
      auto check = [&] {
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(back.data(), dst, n, cudaMemcpyDeviceToHost));
        ok = ok && memcmp(back.data(), in.data(), n) == 0 && memcmp(host, in.data(), n) == 0;
      };
      zero();
      CK(cudaGraphLaunch(ge, s));
      check();
      zero();
      for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, s));  // warm-up
      std::vector<double> samples;
      for (long i = 0; i < iters / kBatch; ++i) {
        samples.push_back(
            TimedBatchUs(s, mh, md, e0, e1, kBatch, [&] { CK(cudaGraphLaunch(ge, s)); }));
      }
      check();
      const char* variant = ce ? "copy_engine" : "sm_kernels";
      if (!ok) fprintf(stderr, "data_floor_sm: MISMATCH at %zu bytes (%s)\n", n, variant);
      const std::string note =
          ce ? "2 memcpy nodes" : "2 kernel nodes, " + std::to_string(ctas) + " CTAs x 256";
      out.push_back(Summarize({"data_floor_sm", variant, n, "us per graph replay (GPU->host->GPU)",
                               note + (ok ? "" : " MISMATCH"), ok},
                              samples));
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
    CK(cudaFree(src));
    CK(cudaFree(dst));
    CK(cudaFreeHost(host));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFreeHost(mh));
}

// 4. Host-timed launch + sync, per repetition.
template <class F>
Result LaunchSync(const char* name, cudaStream_t s, long iters, F launch, const char* note) {
  std::vector<double> v;
  for (long i = 0; i < iters + kWarmup; ++i) {
    const double t0 = NowUs();
    launch();
    CK(cudaStreamSynchronize(s));
    if (i >= kWarmup) v.push_back(NowUs() - t0);
  }
  CK(cudaGetLastError());
  return Summarize({name, "", 0, "us launch+sync (host clock)", note, true}, v);
}

struct Opts {
  std::vector<std::string> only;
  long iters = 10000;
  std::string json;
  bool Want(const char* name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
  bool Start(const char* name) const {  // Want(), plus a progress line if it will run
    if (Want(name)) printf("running %s\n", name);
    return Want(name);
  }
};
const char* kNames[] = {"gpu_cpu_gpu_flag", "cross_process_flag", "data_floor_sm", "kernel_launch",
                        "graph_replay"};

void WriteJson(const std::string& path, const cudaDeviceProp& prop, const char* mps, long iters,
               const std::vector<Result>& res) {
  FILE* f = fopen(path.c_str(), "w");
  PCK(f != nullptr);
  fprintf(f, "{\"device\": %s, \"cc\": \"%d.%d\", \"cuda_mps_pipe_directory\": %s, ",
          JsonStr(prop.name).c_str(), prop.major, prop.minor, mps ? JsonStr(mps).c_str() : "null");
  fprintf(f, "\"iters\": %ld, \"batch\": %d, ", iters, kBatch);
  WriteResultRows(f, res);
  fprintf(f, "}\n");
  PCK(fclose(f) == 0);
}

void Usage() {
  fprintf(stderr,
          "usage: floors [--only NAME[,NAME]] [--iters N] [--json PATH]\n  names: "
          "gpu_cpu_gpu_flag cross_process_flag data_floor_sm kernel_launch graph_replay\n");
  exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress survives a kill when piped
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) {
      if (!ParseNameList(argv[++i], kNames, &o.only)) Usage();
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(atol(argv[++i]), long(kBatch));
    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else {
      Usage();
    }
  }
  // Flag timestamps live in shared memory: cap the round trips so they fit (160 KB).
  const uint64_t n_rt = uint64_t(std::min(o.iters, 200000L)) + kWarmup;

  // Fork before any CUDA call: a child must not inherit an initialized CUDA context.
  int fd = -1;
  pid_t child = -1;
  if (o.Want("cross_process_flag")) {
    const std::string name = "/resident_pg_floors_" + std::to_string(getpid());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    PCK(fd >= 0);
    PCK(shm_unlink(name.c_str()) == 0);  // the fd keeps it alive; nothing leaks on a crash
    PCK(ftruncate(fd, kShmBytes) == 0);
    fflush(stdout), fflush(stderr);
    const pid_t parent = getpid();
    child = fork();
    PCK(child >= 0);
    if (child == 0) exit(ChildMain(fd, n_rt, parent));
  }

  const char* mps = getenv("CUDA_MPS_PIPE_DIRECTORY");
  printf("CUDA_MPS_PIPE_DIRECTORY: %s\n",
         mps ? mps
             : "(not set; cross_process_flag time-slices unless an MPS daemon serves the "
               "default pipe)");
  CK(cudaSetDeviceFlags(cudaDeviceScheduleSpin));  // lowest sync latency
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (cc %d.%d), iters %ld\n", prop.name, prop.major, prop.minor, o.iters);
  if (prop.major != 9 || prop.minor != 0) printf("warning: built and tuned for cc 9.0\n");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::vector<Result> res;
  if (o.Start("gpu_cpu_gpu_flag")) res.push_back(GpuCpuGpuFlag(s, n_rt));
  if (o.Start("cross_process_flag")) {
    CrossProcessFlag(s, fd, child, n_rt, res);
    close(fd);
  }
  if (o.Start("data_floor_sm")) DataFloor(s, o.iters, res);
  if (o.Start("kernel_launch")) {
    res.push_back(LaunchSync(
        "kernel_launch", s, o.iters, [&] { Empty<<<1, 1, 0, s>>>(); },
        "empty <<<1,1>>> + cudaStreamSynchronize"));
  }
  if (o.Start("graph_replay")) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    Empty<<<1, 1, 0, s>>>();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphUpload(ge, s));
    res.push_back(LaunchSync(
        "graph_replay", s, o.iters, [&] { CK(cudaGraphLaunch(ge, s)); },
        "1 empty-kernel node + cudaStreamSynchronize"));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
  }

  const bool all_ok = PrintResults(res);
  if (!o.json.empty()) {
    WriteJson(o.json, prop, mps, o.iters, res);
    printf("wrote %s\n", o.json.c_str());
  }
  CK(cudaStreamDestroy(s));
  return all_ok ? 0 : 1;
}
