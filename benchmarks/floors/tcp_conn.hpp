// tcp_conn.hpp: the busy-polled socket of one end of tcp_floor.cpp's ping-pong, receiving by one
// of the four methods (spin, epoll, io_uring, io_uring with SQPOLL). Header-only, so that the
// program builds from its one .cpp.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "io_uring_ring.hpp"
#include "tcp_shared.hpp"

// The CPUs this process may run on (its affinity mask).
inline int UsableCpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

// The busy-polled socket of one end. Every wait spins (on a non-blocking call, or on the ring's
// completion queue) and stops at its deadline, checked every 256 spins.
class Conn {
 public:
  explicit Conn(int fd) : fd_(fd) {}
  ~Conn() {
    if (ep_ >= 0) close(ep_);
    ring_.Close();
    close(fd_);
  }
  // Method kEpoll receives as the library's proxy does: epoll_wait with timeout 0, then recv
  // until the socket is drained. The epoll set exists only while that method runs, so that the
  // spin method's receive path carries no epoll callback. The io_uring methods make their ring
  // here and make the socket blocking: io_uring hands a non-blocking socket's EAGAIN back instead
  // of waiting for the data (the other methods pass MSG_DONTWAIT on each call).
  int32_t Use(int recv, std::string* why) {
    if (int32_t e = Flush(why)) return e;
    if (ep_ >= 0) close(ep_), ep_ = -1;
    ring_.Close();
    recv_ = recv;
    const int fl = fcntl(fd_, F_GETFL);
    fcntl(fd_, F_SETFL, recv >= kUring ? fl & ~O_NONBLOCK : fl | O_NONBLOCK);
    if (recv == kUringSqpoll && UsableCpus() < 4) {
      // Two spinning ends and two polling kernel threads on fewer CPUs share time slices:
      // milliseconds per message, which would measure the scheduler, not the method.
      *why = "uring_sqpoll needs 4 usable CPUs, this process has " + std::to_string(UsableCpus());
      return kNoUring;
    }
    if (recv >= kUring) {
      *why = ring_.Open(recv == kUringSqpoll);
      return why->empty() ? kOk : kNoUring;
    }
    if (recv != kEpoll) return kOk;
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (ep_ < 0 || epoll_ctl(ep_, EPOLL_CTL_ADD, fd_, &ev) != 0) {
      *why = std::string("epoll: ") + strerror(errno);
      return kSysError;
    }
    return kOk;
  }
  // Waits for a send still in the ring (its buffer must outlive it).
  int32_t Flush(std::string* why) { return Drain(nullptr, 0, why); }
  // Through the ring a send is only queued: its completion is reaped by the next Recv (the
  // peer answers only once it has every byte, so the buffer is not reused before that).
  int32_t Send(const uint8_t* p, size_t n, std::string* why) {
    if (recv_ >= kUring) {
      send_p_ = p, send_left_ = n;
      return PushSend() ? kOk : Fail(kSysError, "io_uring_enter (send)", why);
    }
    const uint64_t end = NowNs() + kWaitNs;
    for (uint32_t spins = 0; n > 0; ++spins) {
      const ssize_t k = send(fd_, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k > 0) {
        p += k, n -= size_t(k);
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Fail(errno == EPIPE || errno == ECONNRESET ? kPeerClosed : kSysError, "send", why);
      } else if ((spins & 255) == 255 && NowNs() > end) {
        return Fail(kTimeout, "send", why);
      }
    }
    return kOk;
  }
  int32_t Recv(uint8_t* p, size_t n, std::string* why) {
    if (recv_ >= kUring) {
      if (!ring_.Push(IORING_OP_RECV, fd_, p, uint32_t(n), 0, kRecvTag)) {
        return Fail(kSysError, "io_uring_enter (recv)", why);
      }
      return Drain(p, n, why);
    }
    const uint64_t end = NowNs() + kWaitNs;
    epoll_event evs[4];
    for (uint32_t spins = 0; n > 0; ++spins) {
      if (recv_ == kSpin || epoll_wait(ep_, evs, 4, 0) > 0) {
        for (;;) {  // drain: several reads when the message came in several segments
          const ssize_t k = recv(fd_, p, n, MSG_DONTWAIT);
          if (k > 0) {
            p += k, n -= size_t(k);
            if (n == 0 || recv_ == kSpin) break;
            continue;
          }
          if (k == 0) return Fail(kPeerClosed, "recv: connection closed", why, false);
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
          return Fail(errno == ECONNRESET ? kPeerClosed : kSysError, "recv", why);
        }
      }
      if ((spins & 255) == 255 && NowNs() > end) return Fail(kTimeout, "recv", why);
    }
    return kOk;
  }

 private:
  static constexpr uint64_t kSendTag = 1, kRecvTag = 2;
  static int32_t Fail(int32_t err, const char* what, std::string* why, bool with_errno = true) {
    *why = std::string(what) + (err == kTimeout ? ": no progress for 10 s"
                                : with_errno    ? std::string(": ") + strerror(errno)
                                                : "");
    return err;
  }
  bool PushSend() {
    return ring_.Push(IORING_OP_SEND, fd_, const_cast<uint8_t*>(send_p_), uint32_t(send_left_),
                      MSG_NOSIGNAL, kSendTag);
  }
  // Spins on the ring's completions until the queued send (if any) and the receive of n bytes
  // into p (if n) are done; a partial transfer is queued again for its rest.
  int32_t Drain(uint8_t* p, size_t n, std::string* why) {
    const uint64_t end = NowNs() + kWaitNs;
    io_uring_cqe c;
    for (uint32_t spins = 0; n > 0 || send_left_ > 0; ++spins) {
      if (ring_.Reap(&c)) {
        const bool is_send = c.user_data == kSendTag;
        if (c.res < 0 || (c.res == 0 && !is_send)) {
          errno = -c.res;
          const int32_t err =
              c.res == 0 || errno == EPIPE || errno == ECONNRESET ? kPeerClosed : kSysError;
          return Fail(err, is_send ? "io_uring send" : "io_uring recv: connection closed", why,
                      c.res != 0);
        }
        if (is_send) {
          send_p_ += c.res, send_left_ -= size_t(c.res);
          if (send_left_ > 0 && !PushSend()) return Fail(kSysError, "io_uring_enter (send)", why);
        } else {
          p += c.res, n -= size_t(c.res);
          if (n > 0 && !ring_.Push(IORING_OP_RECV, fd_, p, uint32_t(n), 0, kRecvTag)) {
            return Fail(kSysError, "io_uring_enter (recv)", why);
          }
        }
      } else if ((spins & 255) == 255 && NowNs() > end) {
        return Fail(kTimeout, n > 0 ? "io_uring recv" : "io_uring send", why);
      }
    }
    return kOk;
  }
  int fd_, ep_ = -1, recv_ = kSpin;
  Ring ring_;
  const uint8_t* send_p_ = nullptr;
  size_t send_left_ = 0;
};
