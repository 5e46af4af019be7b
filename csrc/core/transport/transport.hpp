// The one narrow interface between the proxy (or a direct-mode caller) and the wire.
// A transport writes local bytes into a peer's inbox at an offset, and raises 8-byte flags
// there with release semantics: a signal becomes visible only after every write posted
// before it to the same peer. Receivers only ever poll their own inbox.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/transport/ll_line_check.hpp"

namespace resident {

// One region of a writeThenSignal: [src, src + bytes) to `offset` of the peer's inbox.
struct WriteRegion {
  size_t offset;
  const void* src;
  size_t bytes;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Plain bytes into `peer`'s inbox at `offset`.
  virtual void write(int peer, size_t offset, const void* src, size_t bytes) = 0;
  // The same for bytes a GPU will read (the CUDA path's lines): a transport may write them so
  // that they do not linger in this CPU's caches, where a GPU read over PCIe must snoop them.
  // `prefetch`: how far ahead (bytes) a copy may ask for a source a GPU wrote (streamingCopy);
  // the proxy passes the same distance here and to writeLandedLines.
  virtual void writeForDevice(int peer, size_t offset, const void* src, size_t bytes,
                              size_t /*prefetch*/) {
    write(peer, offset, src, bytes);
  }
  // The CUDA path's unfenced LL lines (16 bytes, the flag in words 1 and 3): writes the leading
  // lines of [src, src + bytes) that carry `flag` into `peer`'s inbox at `offset` and returns
  // their bytes; the caller waits for the next line and calls again for the rest. `prefetch`:
  // see landedLlLines. The writes may stay unordered until flushDeviceWrites (LL lines need no
  // order: the reader checks each one). Here: the check, then writeForDevice.
  virtual uint64_t writeLandedLines(int peer, size_t offset, const unsigned char* src,
                                    uint64_t bytes, uint32_t flag, uint64_t prefetch) {
    const uint64_t landed = landedLlLines(src, bytes, flag, prefetch);
    std::atomic_thread_fence(std::memory_order_acquire);  // the payload after its flags
    if (landed != 0) writeForDevice(peer, offset, src, landed, prefetch);
    return landed;
  }
  // Makes every writeLandedLines before it visible before the writes and signals after it.
  virtual void flushDeviceWrites() {}
  // True when writeLandedLines to `peer` checks and copies in one pass (shm); otherwise the
  // proxy keeps checking lines itself and posting a pass's writes sorted and merged (fewer,
  // larger network writes).
  virtual bool fusesLineCheck(int /*peer*/) const { return false; }
  // Release-store `value` into the 8-byte word at `offset` of `peer`'s inbox.
  virtual void signal(int peer, size_t offset, uint64_t value) = 0;
  // The regions' write()s in order, then signal(): a slot's payload, its header and its flag.
  // A network transport may hand them to the kernel in one call; the sources may change once
  // it returns.
  virtual void writeThenSignal(int peer, const WriteRegion* regions, int n, size_t flag_offset,
                               uint64_t value) {
    for (int i = 0; i < n; ++i) write(peer, regions[i].offset, regions[i].src, regions[i].bytes);
    signal(peer, flag_offset, value);
  }
  // True when writes may be issued by any thread without a system call (shm); otherwise
  // only the proxy thread issues them.
  virtual bool directCapable(int peer) const = 0;
  // Moves incoming bytes into the local inbox (network transports); a no-op for shm.
  virtual void poll() {}
  // Memory that write() will be given as `src` and that its owner leaves unchanged until the
  // peer has consumed what was written from it (the GPU path's outbox: a slot is rewritten only
  // after the peer answered that round). A network transport may then send straight from it
  // instead of copying it first. It must stay allocated while the group can still write.
  // False: not taken (writes from it are copied like any others).
  virtual bool registerSource(const void* /*base*/, size_t /*bytes*/) { return false; }
  // The registered source goes away (its owner shuts down): what is still queued from it is
  // sent first, within a bounded time, or its connection is closed. Only the thread that runs
  // proxy passes, or one that holds them off.
  virtual void releaseSource() {}
  // What the connection to `peer` holds now (queued and partly received bytes), for the log
  // of a failure; empty where there is nothing to say (shm).
  virtual std::string peerState(int /*peer*/) const { return {}; }
};

}  // namespace resident
