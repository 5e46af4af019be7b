// The resident (persistent) kernel's interface, shared by the host channel
// (csrc/cuda/persistent_channel.cpp) and the device code (persistent_kernel.cu). Plain data.
//
// Hand-off of one op, with no kernel launch on the caller's stream: the stream runs ONE batch
// of stream memory operations on words in mapped host memory:
//   write `mailbox` = tag         (descriptor slot + 1 and the slot's generation: opTag)
//   wait  `mailbox` == 0          (the op is complete; its outputs are visible)
//   write `eager_done` = stamp    (eager ops only: the descriptor slot may be reused)
// The mailbox is in host memory, not device memory, so that the proxy thread sees a waiting op
// with a plain load (it has an idle kernel relaunched without any stream operation of its
// own, which could queue behind the very stream that waits), and so that stop() can release a
// stream whose op no instance will run.
// The descriptor (the op's CollectiveArgs) is written by the host into a slot of a mirror in
// mapped host memory, once per call site (eager, content-addressed cache) or once per captured
// graph, never per replay, and the slot's generation goes up. No CUDA call on an op's path: a
// copy to the device would be queued work, which may wait behind a resident kernel that never
// leaves (RESIDENT_GPU_PERSISTENT_IDLE_US=0; what was seen to wait forever behind it on the
// H200 under MPS, session 18, was the creation of a stream).
// The kernel caches each slot in a device-memory table: an op whose tag carries the
// generation the table holds reads the table; otherwise it reads the mirror (over PCIe, once)
// and the leader block refreshes the table.
#pragma once

#include <cstdint>

#include "exchange_args.hpp"
#include "host_device.hpp"

namespace resident {
namespace gpu {

constexpr uint32_t kExitCommand = 0xffffffffu;  // cmd tag: leave the loop

// An op's tag: slot + 1 in the low kTagSlotBits (slots <= 65536), the slot's generation
// (1..kMaxTagGeneration, wrapping; a slot is rewritten only after its last op completed, so a
// stale table entry never carries the same generation) above. Never 0 nor kExitCommand.
constexpr uint32_t kTagSlotBits = 17;
constexpr uint32_t kMaxTagGeneration = (1u << (32 - kTagSlotBits)) - 1;
RESIDENT_HOST_DEVICE constexpr uint32_t opTag(uint32_t slot, uint32_t generation) {
  return (slot + 1) | (generation << kTagSlotBits);
}
RESIDENT_HOST_DEVICE constexpr uint32_t tagSlot(uint32_t tag) {
  return (tag & ((1u << kTagSlotBits) - 1)) - 1;
}
RESIDENT_HOST_DEVICE constexpr uint32_t tagGeneration(uint32_t tag) {
  return tag >> kTagSlotBits;
}

// Device memory, zeroed at install; persists across launches of the resident kernel. Each
// word on its own 128-byte line (the stream's memops and the blocks poll different words).
struct PersistentState {
  alignas(128) unsigned long long cmd;  // leader -> other blocks: (seq << 32) | tag
  alignas(128) uint32_t done_seq;       // seq of the last op every block finished
  alignas(128) uint32_t blocks_done;    // lastOf counter of the op's blocks
  alignas(128) uint32_t started;        // blocks of this launch that read their base seq
  alignas(128) uint32_t served;         // ops completed (mirrored to the host words)
};

// Mapped pinned host memory (host pointer on the CPU, device pointer in the kernel).
struct PersistentHostWords {
  alignas(64) uint32_t mailbox;     // tag written by a stream; 0 when no op is pending
  alignas(64) uint32_t started;     // generation of the last kernel instance that began
  alignas(64) uint32_t exits;       // generation of the last kernel instance that left
  alignas(64) uint32_t quit;        // host: leave now (shutdown)
  alignas(64) uint32_t eager_done;  // stamp of the last completed eager op
  alignas(64) uint32_t issued;      // host: stamp of the last eager op handed to a stream
  alignas(64) uint32_t served;      // ops completed (diagnostics; the kernel only stores)
  // Generation of an instance about to leave by itself (idle, or the group failed): it
  // stores this, then looks once more for work (Dekker with the host's `issued`; see
  // PersistentChannel::ensureInstance), so an eager op never waits for a relaunch.
  alignas(64) uint32_t leaving;
};

struct PersistentArgs {
  PersistentState* state;       // device memory
  CollectiveArgs* table;        // device memory, `slots` descriptors: the cache of the mirror
  uint32_t* table_generation;   // device memory, per slot: the generation the table holds
  const unsigned char* mirror;  // device pointer of the mapped host mirror, `slots` x stride
  uint32_t mirror_stride;       // bytes per mirror slot (a multiple of 8)
  uint32_t args_bytes;          // meaningful bytes of a descriptor (header + this group's peers)
  PersistentHostWords* host;    // device pointer of the mapped host words
  const uint32_t* failed;       // DeviceState::failed: an op of this group gave up
  const uint64_t* abort_word;   // the host's abort word (device pointer of mapped memory)
  uint32_t slots;
  uint32_t generation;  // written to host->exits when this instance leaves
  uint64_t idle_ns;     // leave after this long without an op (0: never idle out)
};

// Once the group failed or was aborted, an idle instance leaves after this long even when
// idle_ns is 0 (ops still handed over complete at once, as no-ops, on a relaunched one).
constexpr uint64_t kFailedIdleNs = 1000000;

}  // namespace gpu
}  // namespace resident
