#include "core/transport/shm_transport.hpp"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "core/transport/ll_line_check.hpp"
#include "core/transport/streaming_copy.hpp"

namespace resident {

void ShmTransport::write(int peer, size_t offset, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(inboxes_[peer] + offset, src, bytes);
}

void ShmTransport::writeForDevice(int peer, size_t offset, const void* src, size_t bytes,
                                  size_t prefetch) {
  if (bytes < kStreamingMinBytes) return write(peer, offset, src, bytes);
  streamingCopy(inboxes_[peer] + offset, src, bytes, prefetch);
}

uint64_t ShmTransport::writeLandedLines(int peer, size_t offset, const unsigned char* src,
                                        uint64_t bytes, uint32_t flag, uint64_t prefetch) {
  unsigned char* dst = inboxes_[peer] + offset;
  // Small ranges as writeForDevice takes them (cached); unaligned ones the same way.
  if (bytes < kStreamingMinBytes ||
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) != 0)
    return Transport::writeLandedLines(peer, offset, src, bytes, flag, prefetch);
  return copyLandedLlLines(dst, src, bytes, flag, prefetch);
}

void ShmTransport::flushDeviceWrites() {
  streamingFence();
}

void ShmTransport::signal(int peer, size_t offset, uint64_t value) {
  // The release store orders every earlier write to the peer's inbox before the flag
  // (streamingCopy fences its non-temporal stores before it returns).
  reinterpret_cast<std::atomic<uint64_t>*>(inboxes_[peer] + offset)
      ->store(value, std::memory_order_release);
}

}  // namespace resident
