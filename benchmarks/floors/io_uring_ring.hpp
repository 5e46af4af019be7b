// io_uring_ring.hpp: the io_uring of tcp_floor.cpp's uring rows (raw system calls, no
// liburing). Header-only, so that the program builds from its one .cpp.
#pragma once

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

// An io_uring of a few entries, driven by raw system calls (no liburing). Without SQPOLL each
// submission is an io_uring_enter and a receive that finds no data completes from the socket's
// wake-up (task work run when this thread next enters the kernel: the wake-up interrupts its
// spin); with SQPOLL a kernel thread polls the submission queue, so no system call is made at
// all. Completions are busy-polled in the completion queue.
class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() { Close(); }

  // "" or why no ring could be made (io_uring refused by the kernel or a sandbox).
  std::string Open(bool sqpoll) {
    Close();
    io_uring_params p{};
    if (sqpoll) {
      p.flags = IORING_SETUP_SQPOLL;
      p.sq_thread_idle = 2000;  // ms the kernel thread keeps polling an idle queue
    }
    fd_ = int(syscall(__NR_io_uring_setup, 8, &p));
    if (fd_ < 0) return std::string("io_uring_setup: ") + strerror(errno);
    sqpoll_ = sqpoll;
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    sqe_len_ = p.sq_entries * sizeof(io_uring_sqe);
    const bool one_map = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (one_map) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ = Map(sq_len_, IORING_OFF_SQ_RING);
    cq_ = one_map ? sq_ : Map(cq_len_, IORING_OFF_CQ_RING);
    auto* sqes = static_cast<io_uring_sqe*>(Map(sqe_len_, IORING_OFF_SQES));
    if (sq_ == nullptr || cq_ == nullptr || sqes == nullptr) {
      const std::string why = std::string("io_uring mmap: ") + strerror(errno);
      if (sqes != nullptr) munmap(sqes, sqe_len_);
      Close();
      return why;
    }
    sqes_ = sqes;
    auto at = [](void* base, uint32_t off) {
      return reinterpret_cast<unsigned*>(static_cast<char*>(base) + off);
    };
    sq_tail_ = at(sq_, p.sq_off.tail), sq_mask_ = *at(sq_, p.sq_off.ring_mask);
    sq_flags_ = at(sq_, p.sq_off.flags), sq_array_ = at(sq_, p.sq_off.array);
    cq_head_ = at(cq_, p.cq_off.head), cq_tail_ = at(cq_, p.cq_off.tail);
    cq_mask_ = *at(cq_, p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(static_cast<char*>(cq_) + p.cq_off.cqes);
    return "";
  }
  void Close() {
    if (sqes_ != nullptr) munmap(sqes_, sqe_len_), sqes_ = nullptr;
    if (cq_ != nullptr && cq_ != sq_) munmap(cq_, cq_len_);
    if (sq_ != nullptr) munmap(sq_, sq_len_);
    sq_ = cq_ = nullptr;
    if (fd_ >= 0) close(fd_), fd_ = -1;  // cancels what is still queued
  }
  bool open() const { return fd_ >= 0; }

  // Queues one send or receive (IORING_OP_SEND / IORING_OP_RECV) and submits it; false with
  // errno when the submission failed.
  bool Push(uint8_t op, int fd, void* addr, uint32_t len, uint32_t msg_flags, uint64_t tag) {
    const unsigned tail = *sq_tail_;  // this thread is the queue's only producer
    const unsigned idx = tail & sq_mask_;
    io_uring_sqe* e = &sqes_[idx];
    memset(e, 0, sizeof(*e));
    e->opcode = op, e->fd = fd, e->addr = uint64_t(uintptr_t(addr)), e->len = len;
    e->msg_flags = msg_flags, e->user_data = tag;
    sq_array_[idx] = idx;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    if (sqpoll_) {
      // The kernel thread sets NEED_WAKEUP before it sleeps; the fence orders the tail's store
      // before this load (io_uring(7)).
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      if ((__atomic_load_n(sq_flags_, __ATOMIC_RELAXED) & IORING_SQ_NEED_WAKEUP) == 0) return true;
      return syscall(__NR_io_uring_enter, fd_, 0, 0, IORING_ENTER_SQ_WAKEUP, nullptr, 0) >= 0;
    }
    return syscall(__NR_io_uring_enter, fd_, 1, 0, 0, nullptr, 0) == 1;
  }
  // Takes the oldest completion, if any.
  bool Reap(io_uring_cqe* out) {
    const unsigned head = *cq_head_;  // this thread is the queue's only consumer
    if (head == __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) return false;
    *out = cqes_[head & cq_mask_];
    __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
    return true;
  }

 private:
  void* Map(size_t len, off_t off) const {
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, off);
    return m == MAP_FAILED ? nullptr : m;
  }
  int fd_ = -1;
  bool sqpoll_ = false;
  size_t sq_len_ = 0, cq_len_ = 0, sqe_len_ = 0;
  void *sq_ = nullptr, *cq_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_tail_ = nullptr, *sq_flags_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};
