// The one narrow interface between the proxy (or a direct-mode caller) and the wire.
// A transport writes local bytes into a peer's inbox at an offset, and raises 8-byte flags
// there with release semantics: a signal becomes visible only after every write posted
// before it to the same peer. Receivers only ever poll their own inbox.
#pragma once

#include <cstddef>
#include <cstdint>

namespace resident {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Plain bytes into `peer`'s inbox at `offset`.
  virtual void write(int peer, size_t offset, const void* src, size_t bytes) = 0;
  // The same for bytes a GPU will read (the CUDA path's lines): a transport may write them so
  // that they do not linger in this CPU's caches, where a GPU read over PCIe must snoop them.
  virtual void writeForDevice(int peer, size_t offset, const void* src, size_t bytes) {
    write(peer, offset, src, bytes);
  }
  // Release-store `value` into the 8-byte word at `offset` of `peer`'s inbox.
  virtual void signal(int peer, size_t offset, uint64_t value) = 0;
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
};

}  // namespace resident
