#include "core/shm_transport.hpp"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "core/streaming_copy.hpp"

namespace resident {

void ShmTransport::write(int peer, size_t offset, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(inboxes_[peer] + offset, src, bytes);
}

void ShmTransport::writeForDevice(int peer, size_t offset, const void* src, size_t bytes) {
  if (bytes != 0) streamingCopy(inboxes_[peer] + offset, src, bytes);
}

void ShmTransport::signal(int peer, size_t offset, uint64_t value) {
  // The release store orders every earlier write to the peer's inbox before the flag
  // (streamingCopy fences its non-temporal stores before it returns).
  reinterpret_cast<std::atomic<uint64_t>*>(inboxes_[peer] + offset)
      ->store(value, std::memory_order_release);
}

}  // namespace resident
