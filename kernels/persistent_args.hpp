// The resident (persistent) kernel's interface, shared by the host channel
// (csrc/cuda/persistent_channel.cpp) and the device code (persistent_kernel.cu). Plain data.
//
// Hand-off of one op, with no kernel launch on the caller's stream: the stream runs ONE batch
// of stream memory operations on words in mapped host memory:
//   write `mailbox` = tag         (tag = descriptor slot + 1)
//   wait  `mailbox` == 0          (the op is complete; its outputs are visible)
//   write `eager_done` = stamp    (eager ops only: the descriptor slot may be reused)
// The mailbox is in host memory, not device memory, so that the proxy thread sees a waiting op
// with a plain load (it has an idle kernel relaunched without any stream operation of its
// own, which could queue behind the very stream that waits), and so that stop() can release a
// stream whose op no instance will run.
// The descriptor (the op's CollectiveArgs) sits in a device-memory table, written once per
// call site (eager, content-addressed cache) or once per captured graph, never per replay.
#pragma once

#include <cstdint>

#include "exchange_args.hpp"

namespace resident {
namespace gpu {

constexpr uint32_t kExitCommand = 0xffffffffu;  // cmd tag: leave the loop

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
  const CollectiveArgs* table;  // device memory, `slots` descriptors
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
