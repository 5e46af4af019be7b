// Communicator configuration: RESIDENT_* environment variables, overridable per group by
// backend options (a string map passed from Python).
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

enum class P2PStream : uint8_t {
  kAuto,  // in a capture, launched lazily: a blocking send/recv on the capturing stream
  kOwn,   // in a capture too, launched when called on a stream per peer and direction
          // (outside captures every send/recv is; c10d/work_cuda.hpp)
};

enum class GpuProtocol : uint8_t {
  kLl,      // LL lines for every op to a direct peer
  kSimple,  // payload plus a flag per 2 KiB part above 32 KiB per peer (kernels/simple_device.cuh)
};

// The values of the options in core/options.def that Config reads; the defaults, ranges and
// meanings are declared there (docs/tuning.md is generated from it). A default-constructed
// Config holds every default.
struct Config {
  PathMode path;
  std::string transport;
  std::string tcp_addr;  // checked when the tcp transport listens
  uint32_t slot_bytes;   // a multiple of 64, so that every element type stays aligned in a slot
  uint32_t slots;
  uint32_t max_inflight;
  uint64_t spin_us;
  uint64_t yield_us;
  uint64_t max_sleep_us;
  uint64_t proxy_spin_us;
  int proxy_cpu;
  uint32_t gpu_chunk_bytes;  // a multiple of the 2 KiB part a block moves per round; 0: automatic
  uint32_t gpu_max_blocks;
  uint64_t gpu_proxy_spin_us;
  P2PStream gpu_p2p_stream;
  GpuProtocol gpu_protocol;
  uint32_t gpu_first_round;
  std::string gpu_proxy_trace;  // a path prefix, opened when the group is destroyed
  uint64_t handoff_bytes;       // read by resident_pg/_backend.py, which sets up the hand-off
  // Not an option: set by the adapter when this process can use CUDA, so that the segment
  // carries the GPU region (CPU-only processes do not pay for it).
  bool gpu_region = false;
  // Not an option: whether spin_us was set (environment or pg_options) rather than left at its
  // default, which the communicator replaces where the host's ranks outnumber its CPUs.
  bool spin_us_given = false;

  Config();
  // Reads the environment; then applies `options` (keys as the variables without the
  // RESIDENT_ prefix, lower case, e.g. {"path": "proxy"}). Throws InvalidArgument on bad values
  // and on removed options.
  static Config fromEnvironment(const std::map<std::string, std::string>& options = {});
  // "key=value" for every option Config reads, in options.def's order (empty strings left out).
  std::string describe() const;
};

const char* pathModeName(PathMode mode);

}  // namespace resident
