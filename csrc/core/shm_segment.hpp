// A POSIX shared-memory segment: created private to the user (0600) under an unguessable
// name that embeds the creator's pid, mapped by peers on the same host, and unlinked as soon
// as every peer has mapped it, so that no name is left in /dev/shm even if a rank is killed.
#pragma once

#include <cstddef>
#include <string>

namespace resident {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Creates and maps a zero-filled segment of `bytes`.
  static ShmSegment create(size_t bytes);
  // Maps an existing segment created by a peer.
  static ShmSegment open(const std::string& name, size_t bytes);

  // Removes the name (the mapping stays valid). Idempotent.
  void unlinkName();
  // Removes names of segments whose creating process no longer exists (a killed rank that
  // died between creating and unlinking). Returns how many were removed.
  static int removeStale();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

  static constexpr const char* kPrefix = "resident_pg-";

 private:
  void release();
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = false;
};

}  // namespace resident
