// The resident kernel of a communicator (RESIDENT_GPU_PERSISTENT=1): a few blocks that stay
// on the GPU and run collectives handed over by stream memory operations (see
// persistent_args.hpp for the hand-off), so an op costs the caller's stream no kernel launch.
//
// Block 0's thread 0 is the leader: it polls the mailbox (a word in mapped host memory) and
// publishes each op to the other blocks as a command (sequence number, tag); every block then
// runs its share of the op with the same body as the one-kernel-per-op path, and the last block
// to finish completes the op (round numbers, mailbox cleared, done_seq). The leader also
// decides when to leave: on the host's quit word, or after RESIDENT_GPU_PERSISTENT_IDLE_US
// without an op (and no eager op handed to a stream still to come), so that a device-wide
// synchronize or a process exit never waits on a kernel that spins forever. An eager op whose
// instance left launches a new one from its own thread; a graph replay's op (only with
// RESIDENT_GPU_PERSISTENT_GRAPHS=resident) gets one from the channel's launcher thread.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "launch_device.cuh"
#include "persistent_args.hpp"
#include "persistent_launch.hpp"

namespace resident {
namespace gpu {
namespace {

__device__ __forceinline__ uint32_t loadAcquire32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t loadAcquire32Gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void storeRelease32Gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long loadAcquire64Gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void storeRelease32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void storeRelease64Gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

constexpr uint64_t kHostCheckNs = 20000;  // how often an idle leader reads the host's quit word

// An eager op was handed to a stream and is not complete yet.
__device__ __forceinline__ bool pendingEager(const PersistentArgs& pa) {
  return loadAcquire32(&pa.host->issued) != loadAcquire32(&pa.host->eager_done);
}

// Leader: the tag of the next op, or kExitCommand (quit, or idle for longer than idle_ns).
__device__ __forceinline__ uint32_t nextTag(const PersistentArgs& pa, uint64_t last_op_ns) {
  uint64_t next_check = 0;
  for (uint32_t spins = 0;;) {
    const uint32_t tag = loadAcquire32(&pa.host->mailbox);
    if (tag != 0) return tag;
    if (++spins < 64) continue;
    spins = 0;
    const uint64_t now = globalTimerNs();
    if (now < next_check) continue;
    next_check = now + kHostCheckNs;
    if (loadAcquire32(&pa.host->quit) != 0) return kExitCommand;
    // An eager op the host handed to a stream that has not reached its doorbell yet keeps
    // the instance here: eager ops never depend on the proxy's relaunch (only graph replays do).
    if (pendingEager(pa)) continue;
    const uint64_t idle = now - last_op_ns;
    const bool leave =
        (pa.idle_ns != 0 && idle > pa.idle_ns) ||
        (idle > kFailedIdleNs && (*reinterpret_cast<const volatile uint32_t*>(pa.failed) != 0 ||
                                  loadVolatile64(pa.abort_word) != 0));
    if (!leave) continue;
    // Announce, then look once more: a host that published `issued` before it read `leaving`
    // either is seen here (stay) or sees `leaving` and launches the next instance itself.
    storeRelease32(&pa.host->leaving, pa.generation);
    __threadfence_system();
    if (loadAcquire32(&pa.host->mailbox) == 0 && !pendingEager(pa)) return kExitCommand;
    storeRelease32(&pa.host->leaving, 0);
  }
}

// Every thread of the block: the op's descriptor into `a` (shared). From the device table when
// it holds the tag's generation, else from the host mirror (the host wrote the slot since; see
// persistent_args.hpp), and then the leader block refreshes the table for the next op of the
// slot. The other blocks decide for themselves: both copies hold the same bytes.
__device__ __forceinline__ void loadDescriptor(const PersistentArgs& pa, uint32_t tag,
                                               bool leader_block, CollectiveArgs& a, bool& fresh) {
  const uint32_t slot = tagSlot(tag);
  const uint32_t generation = tagGeneration(tag);
  if (threadIdx.x == 0) fresh = loadAcquire32Gpu(pa.table_generation + slot) == generation;
  __syncthreads();
  auto* dst = reinterpret_cast<unsigned long long*>(&a);
  const uint32_t words = (pa.args_bytes + 7) / 8;
  if (fresh) {
    const auto* src = reinterpret_cast<const unsigned long long*>(pa.table + slot);
    for (uint32_t i = threadIdx.x; i < words; i += blockDim.x)
      dst[i] = __ldcg(src + i);  // L2: the leader may have refreshed this slot since
    __syncthreads();
    return;
  }
  const auto* src = reinterpret_cast<const unsigned long long*>(
      pa.mirror + static_cast<size_t>(slot) * pa.mirror_stride);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = loadVolatile64(src + i);
  __syncthreads();
  if (!leader_block) return;
  auto* cache = reinterpret_cast<unsigned long long*>(pa.table + slot);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) __stcg(cache + i, dst[i]);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the table's words before its generation
    storeRelease32Gpu(pa.table_generation + slot, generation);
  }
}

template <bool Simple>  // as collectiveKernel: a build with the simple protocol
__global__ void __launch_bounds__(kThreads)
    persistentKernel(const __grid_constant__ PersistentArgs pa) {
  __shared__ CollectiveArgs a;
  __shared__ Shared sh;
  __shared__ uint32_t tag_sh;
  __shared__ bool fresh_sh;
  __shared__ uint32_t seq;  // ops (and exits) this block has seen completed
  PersistentState* ps = pa.state;
  const uint32_t nblocks = gridDim.x;
  const bool leader_block = blockIdx.x == 0;
  // No op is in progress when an instance starts (the previous one left between ops), so
  // done_seq is every block's base. The leader publishes nothing before every block has read
  // it (every block of the instance is resident before any op runs).
  if (threadIdx.x == 0) {
    // Tells the host this instance really runs (a launch can sit queued behind other work).
    if (leader_block) storeRelease32(&pa.host->started, pa.generation);
    seq = loadAcquire32(&ps->done_seq);
    __threadfence();
    atomicAdd(&ps->started, 1u);
    if (leader_block) {
      while (loadAcquire32(&ps->started) < nblocks) {
      }
      ps->started = 0;  // the next instance starts after this one left (same stream)
    }
  }
  uint64_t last_op_ns = globalTimerNs();
  for (;;) {
    if (threadIdx.x == 0) {
      if (leader_block) {
        while (loadAcquire32(&ps->done_seq) != seq) {
        }
        tag_sh = nextTag(pa, last_op_ns);
        storeRelease64Gpu(&ps->cmd, (static_cast<unsigned long long>(seq + 1) << 32) | tag_sh);
      } else {
        unsigned long long c;
        do {
          c = loadAcquire64Gpu(&ps->cmd);
        } while (static_cast<uint32_t>(c >> 32) != seq + 1);
        tag_sh = static_cast<uint32_t>(c);
      }
    }
    __syncthreads();
    const uint32_t tag = tag_sh;
    const bool run = tag != kExitCommand && tagSlot(tag) < pa.slots;
    if (run) {
      loadDescriptor(pa, tag, leader_block, a, fresh_sh);
      loadRoundState(a, sh);
      collectiveBody<Simple>(a, sh, blockIdx.x);
    }
    if (threadIdx.x == 0) {
      if (lastOf(&ps->blocks_done, nblocks)) {
        if (run) {
          advanceRounds(a, sh);
          // A plain store: the host only reads this word (no atomics over PCIe).
          volatile uint32_t* served = &ps->served;
          *served = *served + 1;
          *reinterpret_cast<volatile uint32_t*>(&pa.host->served) = *served;
        }
        if (tag == kExitCommand) {
          storeRelease32(&ps->done_seq, seq + 1);
          __threadfence_system();
          storeRelease32(&pa.host->exits, pa.generation);
        } else {
          // Outputs and round numbers before the mailbox (a release at system scope: the
          // stream's wait reads the word in host memory, then its next work reads them).
          storeRelease32(&pa.host->mailbox, 0);
          storeRelease32(&ps->done_seq, seq + 1);
        }
      }
      seq = seq + 1;
    }
    __syncthreads();
    if (tag == kExitCommand) return;
    last_op_ns = globalTimerNs();
  }
}

}  // namespace

cudaError_t launchPersistent(const PersistentArgs& args, unsigned blocks, cudaStream_t stream,
                             bool simple) {
  // A plain launch, not a cooperative one. Measured with scripts/launch_block_probe.cu (H200,
  // driver 580, with and without MPS): while another thread sits in a pageable D2H copy on a
  // stream held by a stream wait-value, a cooperative launch from this thread blocks inside the
  // driver until the copy returns; a plain one blocks only if that stream is the legacy
  // default stream. The few blocks become resident together on any GPU that is not full of
  // blocks that never finish (the constructor checks they fit).
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  if (simple) return cudaLaunchKernelEx(&cfg, persistentKernel<true>, args);
  return cudaLaunchKernelEx(&cfg, persistentKernel<false>, args);
}

int persistentBlocksPerSm(bool simple) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, simple ? persistentKernel<true> : persistentKernel<false>, kThreads, 0);
  return n;
}

}  // namespace gpu
}  // namespace resident
