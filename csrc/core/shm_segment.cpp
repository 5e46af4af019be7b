#include "core/shm_segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/process_state.hpp"

namespace resident {
namespace {

std::string randomHex(size_t bytes) {
  unsigned char buf[32];
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(buf + got, bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw CommError(std::string("resident: getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    out += kHex[buf[i] >> 4];
    out += kHex[buf[i] & 15];
  }
  return out;
}

void* mapFd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw CommError("resident: mmap of shared segment " + name + " (" + std::to_string(bytes) +
                    " bytes) failed: " + std::strerror(errno));
  }
  return p;
}

}  // namespace

ShmSegment::~ShmSegment() {
  release();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept {
  *this = std::move(other);
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

ShmSegment ShmSegment::create(size_t bytes) {
  ShmSegment seg;
  // 128 random bits: the name cannot be guessed by another user; the pid lets removeStale()
  // recognise segments of dead creators.
  seg.name_ = std::string("/") + kPrefix + std::to_string(getpid()) + "-" + randomHex(16);
  const int fd = shm_open(seg.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw CommError("resident: shm_open(" + seg.name_ + ") failed: " + std::strerror(errno));
  }
  seg.owner_ = true;
  seg.linked_ = true;
  // Sized by reserving its pages now: a tmpfs past its size limit would otherwise hand out pages
  // until a write (by this rank, a peer, or the GPU's registration) faults with SIGBUS.
  int err = fchmod(fd, 0600) != 0 ? errno : 0;
  if (err == 0) {
    do err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    while (err == EINTR);
  }
  if (err != 0) {
    struct statvfs fs {};
    const unsigned long long free_bytes =
        fstatvfs(fd, &fs) == 0 ? static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize : 0;
    close(fd);
    seg.release();
    throw CommError(
        "resident: reserving " + std::to_string(bytes) +
        " bytes of shared memory for this rank's segment failed: " + std::strerror(err) +
        " (/dev/shm has " + std::to_string(free_bytes) +
        " bytes free; the segment grows with the group's size, RESIDENT_SLOTS, "
        "RESIDENT_SLOT_BYTES and, with CUDA, RESIDENT_GPU_CHUNK_BYTES: enlarge /dev/shm, "
        "e.g. docker run --shm-size=4g or --ipc=host)");
  }
  try {
    seg.data_ = mapFd(fd, bytes, seg.name_);
  } catch (...) {
    close(fd);
    seg.release();
    throw;
  }
  close(fd);
  seg.size_ = bytes;
  RLOG_DEBUG("created shared segment %s (%zu bytes)", seg.name_.c_str(), bytes);
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  ShmSegment seg;
  seg.name_ = name;
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    throw CommError("resident: cannot open peer segment " + name + ": " + std::strerror(errno) +
                    " (peers must share /dev/shm; set RESIDENT_TRANSPORT if they do not)");
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    throw CommError("resident: peer segment " + name + " is smaller than expected");
  }
  try {
    seg.data_ = mapFd(fd, bytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.size_ = bytes;
  return seg;
}

void ShmSegment::unlinkName() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
    RLOG_DEBUG("unlinked shared segment %s", name_.c_str());
  }
}

void ShmSegment::release() {
  unlinkName();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  owner_ = false;
}

int ShmSegment::removeStale() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const uid_t me = getuid();
  const size_t prefix_len = std::strlen(kPrefix);
  while (dirent* ent = readdir(dir)) {
    if (std::strncmp(ent->d_name, kPrefix, prefix_len) != 0) continue;
    const long pid = std::strtol(ent->d_name + prefix_len, nullptr, 10);
    if (pid <= 0) continue;
    struct stat st;
    const std::string path = std::string("/dev/shm/") + ent->d_name;
    if (stat(path.c_str(), &st) != 0 || st.st_uid != me) continue;
    // Gone, or a zombie nobody reaped yet (kill(pid, 0) still succeeds on those).
    if (!processHasExited(static_cast<int>(pid))) continue;
    if (shm_unlink((std::string("/") + ent->d_name).c_str()) == 0) {
      ++removed;
      RLOG_INFO("removed stale shared segment %s of dead pid %ld", ent->d_name, pid);
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace resident
