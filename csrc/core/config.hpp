// Communicator configuration: RESIDENT_* environment variables, overridable per group by
// backend options (a string map passed from Python). Every field is documented in docs/tuning.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace resident {

enum class PathMode : uint8_t {
  kAuto,    // direct stores for same-host peers, proxy for the rest
  kDirect,  // the calling thread writes into the peer's segment (same host only)
  kProxy,   // every write goes through the resident proxy thread (the cross-node path)
};

// Config::gpu_proxy_simple_above when the simple protocol is off for proxied pairs.
constexpr uint32_t kGpuSimpleNever = 0xffffffffu;

struct Config {
  PathMode path = PathMode::kAuto;       // RESIDENT_PATH=auto|direct|proxy
  uint32_t slot_bytes = 64 * 1024;       // RESIDENT_SLOT_BYTES: payload bytes per slot
  uint32_t slots = 4;                    // RESIDENT_SLOTS: slots per channel ring
  uint32_t max_inflight = 256;           // RESIDENT_MAX_INFLIGHT: ops in flight per group
  uint64_t spin_us = 50;                 // RESIDENT_SPIN_US: hot polling before yielding
  uint64_t yield_us = 2000;              // RESIDENT_YIELD_US: yielding before sleeping
  uint64_t max_sleep_us = 200;           // RESIDENT_MAX_SLEEP_US: cap of sleep back-off
  uint64_t proxy_spin_us = 20000;        // RESIDENT_PROXY_SPIN_US: proxy hot after work
  int proxy_cpu = -1;                    // RESIDENT_PROXY_CPU: pin the proxy (-1: don't)
  std::string transport = "auto";        // RESIDENT_TRANSPORT=auto|shm|tcp
  std::string tcp_addr;                  // RESIDENT_TCP_ADDR: IPv4 the tcp transport listens on
  uint32_t gpu_chunk_bytes = 64 * 1024;  // RESIDENT_GPU_CHUNK_BYTES: CUDA payload per round
  // RESIDENT_GPU_MAX_BLOCKS: thread blocks of a CUDA op at most (0: a fair share of the GPU
  // among the ranks that use it); fewer leaves more SMs to compute kernels.
  uint32_t gpu_max_blocks = 0;
  uint64_t gpu_proxy_spin_us = 200000;  // RESIDENT_GPU_PROXY_SPIN_US: proxy hot after a GPU trigger
  bool gpu_pdl = true;                  // RESIDENT_GPU_PDL=0|1: programmatic dependent launch
  bool gpu_prefetch = true;  // RESIDENT_GPU_PREFETCH=0|1: first payload word loaded at start
  // RESIDENT_GPU_ONE_ROUND=0|1: collectives of one round with every partner run the one-round
  // kernel (kernels/one_round_kernel.cu); 0: the general kernel for every op.
  bool gpu_one_round = true;
  // RESIDENT_GPU_TRIGGER_FENCE=0|1: 1 fences every proxy trigger on the device instead of
  // letting the proxy check the lines' flags.
  bool gpu_trigger_fence = false;
  // RESIDENT_GPU_TRIGGER_FENCE_FROM=bytes|off: with RESIDENT_GPU_TRIGGER_FENCE=0, ops whose
  // largest round to one peer carries at least this many bytes fence their triggers (smaller
  // ones leave the lines to the proxy's check); off: none does.
  uint64_t gpu_trigger_fence_from = 64 * 1024;
  // RESIDENT_GPU_PROXY_STREAMING=0|1: the proxy posts the CUDA path's lines with
  // Transport::writeForDevice (shm: non-temporal stores) instead of write (memcpy).
  bool gpu_proxy_streaming = true;
  // RESIDENT_GPU_PROXY_PREFETCH_BYTES: how far ahead the proxy asks for the outbox bytes it
  // checks (unfenced LL lines) and copies (streaming copies); 0: no prefetch.
  uint32_t gpu_proxy_prefetch_bytes = 1024;
  // RESIDENT_GPU_PROXY_FUSED_CHECK=0|1: 1 (default) checks and copies an unfenced trigger's LL
  // lines in one pass as it pops it (Transport::writeLandedLines); 0 checks them, then posts
  // the pass's writes sorted and merged.
  bool gpu_proxy_fused_check = true;
  // RESIDENT_GPU_P2P_STREAM=auto|own: where a send/recv on CUDA tensors runs. auto (default):
  // launched lazily, a blocking one on the caller's stream; own: on a stream per peer and
  // direction, launched when called (c10d/work_cuda.hpp, runCudaP2P).
  bool gpu_p2p_lazy = true;
  // RESIDENT_GPU_PROTOCOL=ll|simple: how collective rounds reach direct peers. ll: LL lines
  // (8 payload bytes and a flag per 16 bytes); simple (default: faster on the
  // H200 wherever it applies): ops whose first round carries more than half a chunk as payload
  // plus one flag per 2 KiB part (kernels/simple_device.cuh), LL lines below. All ranks agree.
  bool gpu_protocol_simple = true;
  // RESIDENT_GPU_PROXY_SIMPLE_ABOVE=off|bytes: collective rounds to a proxied peer go as payload
  // plus one flag per 2 KiB part (signalled by the proxy after the payload) for ops whose first
  // round to that peer carries more than this many bytes (at most half a chunk: larger values
  // act as half a chunk); kGpuSimpleNever (off): LL lines for every op. All ranks agree.
  uint32_t gpu_proxy_simple_above = 32 * 1024;
  // RESIDENT_GPU_PROXY_TRACE=path prefix: the proxy records a timeline of its CUDA work
  // (core/proxy_trace.hpp) and writes it to <prefix>.rank<r>.<n>.tsv when the group is
  // destroyed; empty (default): off.
  std::string gpu_proxy_trace;
  // Not a variable: set by the adapter when this process can use CUDA, so that the segment
  // carries the GPU region (CPU-only processes do not pay for it).
  bool gpu_region = false;

  // Reads the environment; then applies `options` (keys as the variables without the
  // RESIDENT_ prefix, lower case, e.g. {"path": "proxy"}). Throws InvalidArgument on bad values.
  static Config fromEnvironment(const std::map<std::string, std::string>& options = {});
  std::string describe() const;
};

const char* pathModeName(PathMode mode);
// A byte limit as its variable spells it: "off" when it is `off_value`, else the number.
std::string limitName(uint64_t value, uint64_t off_value);

}  // namespace resident
