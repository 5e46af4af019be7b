// tcp_floor.cpp: one-way latency floor of a busy-polled TCP ping-pong between two processes, on
// loopback, between two network namespaces joined by a veth pair, or between two hosts (one run
// of the program on each: --listen and --connect). Standalone (no torch, no CUDA); see README.md
// for what each row means and how to run it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "core/transport/tcp_address.hpp"
#include "floor_results.hpp"
#include "io_uring_ring.hpp"
#include "netns_rtnetlink.hpp"

[[noreturn]] static void Die(const char* file, int line, const char* what) {
  fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, strerror(errno));
  exit(2);
}
// A failed POSIX call of the parent's own set-up prints file:line and exits with status 2.
#define PCK(cond)                                \
  do {                                           \
    if (!(cond)) Die(__FILE__, __LINE__, #cond); \
  } while (0)

namespace {

constexpr size_t kSizes[] = {8, 1 << 10, 8 << 10, 64 << 10, 256 << 10};
constexpr int kNumSizes = 5;
enum Recv : int { kSpin = 0, kEpoll = 1, kUring = 2, kUringSqpoll = 3 };
constexpr int kNumRecv = 4;
const char* kRecvName[] = {"spin_recv", "epoll_recv", "uring", "uring_sqpoll"};
const char* kNames[] = {"tcp_loopback", "tcp_netns"};
const char* kHostsName = "tcp_hosts";  // the rows of --connect: between two hosts

constexpr uint64_t kMs = 1000000ull;
constexpr uint64_t kWaitNs = 10000 * kMs;     // any single wait of the ping-pong
constexpr uint64_t kBudgetNs = 10000 * kMs;   // one (receive method, size) block, warm-up included
constexpr uint64_t kSetupNs = 30000 * kMs;    // listen / connect / namespace commands
constexpr uint64_t kListenNs = 600000 * kMs;  // --listen: until the other host's --connect
constexpr uint64_t kLast = 1ull << 63;        // set in a message's first word: the block's last
constexpr int kMinSamples = 10;               // fewer timed round trips fail the row

// Namespaces and their veth ends; the lock keeps two runs of this program off the same names.
const char* kNsA = "resident_floor_a";
const char* kNsB = "resident_floor_b";
const char* kAddrA = "10.214.0.1";
const char* kAddrB = "10.214.0.2";
const char* kLockPath = "/run/resident_floor.lock";

uint64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec);
}

enum Err : int32_t { kOk = 0, kTimeout, kPeerClosed, kMismatch, kSysError, kNotRun, kNoUring };
const char* ErrName(int e) {
  const char* n[] = {"ok",        "timeout", "peer_closed", "mismatch",
                     "sys_error", "not_run", "no_uring"};
  return e >= 0 && e <= kNoUring ? n[e] : "?";
}

// What one end reports about one (receive method, size) block: kNotRun until it starts it.
struct Side {
  int32_t err;
  char msg[120];
};
struct Block {
  Side client, server;
  uint64_t round_trips;  // completed, warm-up included
  uint64_t timed;        // samples written
  int32_t truncated;     // the block's budget ran out before --iters timed round trips
};
// Shared by the parent and both ends (an anonymous shared mapping made before the forks); between
// hosts each run has its own, and the echo end's checks reach the timing end as its verdict.
struct Shared {
  std::atomic<int32_t> port;  // 0 until the server listens, -1 if it failed to
  Side setup_client, setup_server;
  Block blocks[kNumRecv][kNumSizes];
  double samples[1];  // [kNumRecv][kNumSizes][iters], one-way µs
};

struct Opts {
  std::vector<std::string> only;
  long iters = 10000;
  long warmup = 1000;
  std::string json;
  bool corrupt = false;  // the client spoils each block's last message (the program's own test)
  std::string listen;    // --listen [ADDR:]PORT: this run is the echo end of tcp_hosts
  std::string connect;   // --connect HOST:PORT: this run is the timing end of tcp_hosts
  bool Want(const char* n) const {
    return only.empty() || std::find(only.begin(), only.end(), n) != only.end();
  }
};

// How the two ends of a placement run. On one host (both forked by this program, reporting
// through the shared mapping): every receive method. Between hosts (one run of the program on
// each): the methods the library's proxy uses, since whether an io_uring block can run depends on
// each host's kernel and CPUs and both ends must walk the same blocks; the echo end waits longer
// for its connection and, the mapping not being shared, sends its checks to the timing end at the
// end (the verdict, after the last block: off the measured path).
struct Ends {
  int methods = kNumRecv;
  bool remote = false;
  uint64_t accept_ns = kSetupNs;
};
constexpr Ends kRemoteEnds{kEpoll + 1, true, kListenNs};

// The bytes of a Shared with --iters samples per block.
size_t SharedBytes(const Opts& o) {
  return sizeof(Shared) + sizeof(double) * kNumRecv * kNumSizes * size_t(o.iters);
}

void SetMsg(Side* s, int32_t err, const std::string& m) {
  if (s->err != kOk) return;  // keep the first failure
  s->err = err;
  snprintf(s->msg, sizeof(s->msg), "%s", m.c_str());
}

// The payload of a block: random bytes, the same on both ends (seeded by size and method).
std::vector<uint8_t> Payload(size_t n, int recv) {
  std::mt19937_64 rng(0x7cf1003 + n * 31 + size_t(recv));
  std::vector<uint8_t> p(n);
  for (auto& b : p) b = uint8_t(rng());
  return p;
}
uint64_t Word0(const uint8_t* p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}

int UsableCpus() {
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

void TuneSocket(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// Waits (poll, not on the measured path) until fd is ready for `events` or the deadline passes.
bool WaitFd(int fd, short events, uint64_t end) {
  for (;;) {
    const uint64_t now = NowNs();
    if (now >= end) return false;
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, int((end - now) / kMs) + 1);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// A socket address of an IPv4 or IPv6 literal (resident::socketAddress) and port.
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  SockAddr(const char* ip, int port) { resident::socketAddress(ip, uint16_t(port), ss, len); }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&ss); }
};

// The echo end: listens on `ip`:`port` (0: any), publishes its port, then for every block
// receives each message, checks its sequence number (every message) and its bytes (the first and
// the last), and sends it back; between hosts it then sends its verdict. 1 when a check failed.
int ServerMain(Shared* sh, const char* ip, int port, const Ends& ends) {
  std::string why;
  SockAddr a(ip, port);
  const int lfd = socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t len = sizeof(a.ss);
  if (lfd < 0 || bind(lfd, a.get(), a.len) != 0 || listen(lfd, 1) ||
      getsockname(lfd, a.get(), &len) != 0) {
    SetMsg(&sh->setup_server, kSysError, std::string("listen on ") + ip + ": " + strerror(errno));
    sh->port.store(-1);
    return 1;
  }
  sh->port.store(resident::portOf(a.get()));
  if (ends.remote) printf("tcp_floor: listening on %s\n", resident::endpointText(a.get()).c_str());
  if (!WaitFd(lfd, POLLIN, NowNs() + ends.accept_ns)) {
    SetMsg(&sh->setup_server, kTimeout,
           "no connection within " + std::to_string(ends.accept_ns / 1000000000ull) + " s");
    return 1;
  }
  const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  close(lfd);
  if (fd < 0) return SetMsg(&sh->setup_server, kSysError, strerror(errno)), 1;
  TuneSocket(fd);
  Conn c(fd);
  int status = 0;
  for (int v = 0; v < ends.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const size_t n = kSizes[s];
      Side* me = &sh->blocks[v][s].server;
      me->err = kOk;
      const std::vector<uint8_t> want = Payload(n, v);
      std::vector<uint8_t> buf(n);
      if (int32_t e = c.Use(v, &why)) {
        SetMsg(me, e, why);
        if (e == kNoUring) continue;  // both ends skip the block: the same kernel refused them
        return 1;
      }
      for (uint64_t seq = 0;; ++seq) {
        if (int32_t e = c.Recv(buf.data(), n, &why)) return SetMsg(me, e, why), 1;
        const uint64_t w = Word0(buf.data()) ^ Word0(want.data());
        const bool last = (w & kLast) != 0;
        if ((w & ~kLast) != seq) {  // every message: its first word (all of an 8 B one)
          SetMsg(me, kMismatch,
                 "sequence " + std::to_string(w & ~kLast) + ", expected " + std::to_string(seq));
        }
        if ((seq == 0 || last) && memcmp(buf.data() + 8, want.data() + 8, n - 8) != 0) {
          SetMsg(me, kMismatch, "payload differs at round trip " + std::to_string(seq));
        }
        if (int32_t e = c.Send(buf.data(), n, &why)) return SetMsg(me, e, why), 1;
        if (last) break;
      }
      if (int32_t e = c.Flush(&why)) return SetMsg(me, e, why), 1;  // before buf goes
      status |= me->err != kOk;
    }
  }
  if (ends.remote) {  // the verdict: this end's Side of every block, in block order
    std::vector<Side> verdict;
    for (int v = 0; v < ends.methods; ++v) {
      for (int s = 0; s < kNumSizes; ++s) verdict.push_back(sh->blocks[v][s].server);
    }
    const auto* p = reinterpret_cast<const uint8_t*>(verdict.data());
    if (int32_t e = c.Send(p, verdict.size() * sizeof(Side), &why)) {
      return SetMsg(&sh->setup_server, e, "sending the verdict: " + why), 1;
    }
    if (int32_t e = c.Flush(&why)) return SetMsg(&sh->setup_server, e, why), 1;
  }
  return status;
}

// A connected socket to ip:port, or -1 with errno set; a refused connection is tried again
// every 100 ms until `end` when `retry` (the other host's --listen may not be up yet).
int ConnectTo(const char* ip, int port, uint64_t end, bool retry) {
  SockAddr a(ip, port);
  for (;;) {
    const int fd = socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    int err = 0;
    socklen_t len = sizeof(err);
    if ((connect(fd, a.get(), a.len) == 0 || errno == EINPROGRESS) && WaitFd(fd, POLLOUT, end) &&
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
      return fd;
    }
    err = err ? err : errno;
    close(fd);
    if (!retry || err != ECONNREFUSED || NowNs() + 100 * kMs > end) {
      errno = err;
      return -1;
    }
    usleep(100000);
  }
}

// The timing end: connects, then per block sends warm-up + --iters messages and times each
// round trip (one-way = half of it); the first and the last echo are checked byte for byte.
// Between hosts it then takes the echo end's verdict into the blocks.
int ClientMain(Shared* sh, const Opts& o, const char* ip, const Ends& ends) {
  std::string why;
  const uint64_t setup_end = NowNs() + kSetupNs;
  int port = 0;
  while ((port = sh->port.load()) == 0 && NowNs() < setup_end) usleep(1000);
  if (port <= 0) return SetMsg(&sh->setup_client, kNotRun, "the server never listened"), 1;
  const int fd = ConnectTo(ip, port, setup_end, ends.remote);
  if (fd < 0) {
    SetMsg(&sh->setup_client, kSysError,
           std::string("connect to ") + ip + ":" + std::to_string(port) + ": " + strerror(errno));
    return 1;
  }
  TuneSocket(fd);
  Conn c(fd);
  int status = 0;
  for (int v = 0; v < ends.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const size_t n = kSizes[s];
      Block* b = &sh->blocks[v][s];
      double* out = sh->samples + (size_t(v) * kNumSizes + size_t(s)) * size_t(o.iters);
      const std::vector<uint8_t> base = Payload(n, v);
      std::vector<uint8_t> msg = base, echo(n);
      b->client.err = kOk;
      if (int32_t e = c.Use(v, &why)) {
        SetMsg(&b->client, e, why);
        if (e == kNoUring) continue;
        return 1;
      }
      const uint64_t total = uint64_t(o.warmup + o.iters), start = NowNs();
      for (uint64_t seq = 0;; ++seq) {
        const bool last = seq + 1 == total || NowNs() - start > kBudgetNs;
        const uint64_t w = Word0(base.data()) ^ seq ^ (last ? kLast : 0);
        memcpy(msg.data(), &w, 8);
        if (last && o.corrupt) msg[n > 8 ? n - 1 : 0] ^= 0x5a;
        const uint64_t t0 = NowNs();
        if (int32_t e = c.Send(msg.data(), n, &why)) return SetMsg(&b->client, e, why), 1;
        if (int32_t e = c.Recv(echo.data(), n, &why)) return SetMsg(&b->client, e, why), 1;
        const uint64_t t1 = NowNs();
        b->round_trips = seq + 1;
        if (seq >= uint64_t(o.warmup)) out[b->timed++] = double(t1 - t0) / 2e3;
        if ((seq == 0 || last) && echo != msg) {
          SetMsg(&b->client, kMismatch, "echo differs at round trip " + std::to_string(seq));
          status = 1;
        }
        if (last) {
          b->truncated = seq + 1 < total;
          break;
        }
      }
    }
  }
  if (ends.remote) {  // the echo end's checks (ServerMain's verdict)
    std::vector<Side> verdict(size_t(ends.methods) * kNumSizes);
    auto* p = reinterpret_cast<uint8_t*>(verdict.data());
    if (int32_t e = c.Recv(p, verdict.size() * sizeof(Side), &why)) {
      return SetMsg(&sh->setup_client, e, "receiving the verdict: " + why), 1;
    }
    for (size_t i = 0; i < verdict.size(); ++i) {
      verdict[i].msg[sizeof(verdict[i].msg) - 1] = 0;
      sh->blocks[i / kNumSizes][i % kNumSizes].server = verdict[i];
    }
  }
  return status;
}

// ---- network namespaces ----

volatile sig_atomic_t g_netns_up = 0;
volatile pid_t g_children[2] = {-1, -1};

// What `ip netns del` does: detach the namespace's bind mount and remove its file. Only
// async-signal-safe calls, so that the signal handler can use it too.
void RemoveNetns() {
  for (const char* ns : {kNsA, kNsB}) {
    char path[64] = "/var/run/netns/";
    strncat(path, ns, sizeof(path) - strlen(path) - 1);
    umount2(path, MNT_DETACH);
    unlink(path);
  }
  g_netns_up = 0;
}

void OnSignal(int sig) {
  for (pid_t p : g_children) {
    if (p > 0) kill(p, SIGKILL);
  }
  if (g_netns_up) RemoveNetns();
  signal(sig, SIG_DFL);
  raise(sig);
}

// Creates the two namespaces joined by a veth pair; returns "" or why not (then none is left).
std::string SetUpNetns(int* lock_fd) {
  if (geteuid() != 0) return "network namespaces need root";
  *lock_fd = open(kLockPath, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (*lock_fd < 0) return std::string("cannot open ") + kLockPath + ": " + strerror(errno);
  for (const uint64_t end = NowNs() + kSetupNs; flock(*lock_fd, LOCK_EX | LOCK_NB) != 0;) {
    if (NowNs() > end) return "another tcp_floor run held " + std::string(kLockPath) + " for 30 s";
    usleep(10000);
  }
  // Under the lock no other run uses these names: any found were left by a killed run.
  RemoveNetns();
  g_netns_up = 1;  // from here on a signal removes whatever exists
  std::string why = rtnl::AddNetns(kNsA);
  if (why.empty()) why = rtnl::AddNetns(kNsB);
  if (why.empty()) why = rtnl::AddVeth(kNsA, "rfloor_a", kNsB, "rfloor_b");
  if (why.empty()) why = rtnl::AddAddress(kNsA, "rfloor_a", kAddrA);
  if (why.empty()) why = rtnl::AddAddress(kNsB, "rfloor_b", kAddrB);
  if (why.empty()) why = rtnl::LinkUp(kNsA, "rfloor_a");
  if (why.empty()) why = rtnl::LinkUp(kNsB, "rfloor_b");
  if (!why.empty()) RemoveNetns();
  return why;
}

// Enters a named network namespace (what `ip netns exec` does before it runs its command).
bool EnterNetns(const char* ns, Side* report) {
  const std::string path = rtnl::NsPath(ns);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    SetMsg(report, kSysError, "setns " + path + ": " + strerror(errno));
    return false;
  }
  close(fd);
  return true;
}

// ---- results ----

// One row per (receive method, size) of the first `methods` methods, from what the ends wrote;
// `ends`: how the ends exited, added to a failed row's note.
void AddRows(const char* name, const Shared& sh, const Opts& o, int methods,
             const std::string& ends, std::vector<Result>& out) {
  std::string setup;
  for (const Side* s : {&sh.setup_server, &sh.setup_client}) {
    if (s->err != kOk) setup += std::string(" setup: ") + s->msg;
  }
  for (int v = 0; v < methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const Block& b = sh.blocks[v][s];
      Result r;
      r.name = name, r.variant = kRecvName[v], r.bytes = kSizes[s];
      r.unit = "us one-way (round trip / 2)";
      const double* smp = sh.samples + (size_t(v) * kNumSizes + size_t(s)) * size_t(o.iters);
      r = Summarize(r, std::vector<double>(smp, smp + b.timed));
      r.ok = b.client.err == kOk && b.server.err == kOk && b.timed >= kMinSamples;
      r.skipped = b.client.err == kNoUring || b.server.err == kNoUring;
      r.note = "round_trips=" + std::to_string(b.round_trips) + " client=" + ErrName(b.client.err) +
               " server=" + ErrName(b.server.err);
      if (b.truncated) r.note += " budget_truncated";
      for (const Side* side : {&b.client, &b.server}) {
        if (side->err != kOk && side->msg[0]) r.note += std::string(" (") + side->msg + ")";
      }
      if (r.skipped)
        r.note = std::string("not run: ") + (b.client.msg[0] ? b.client.msg : b.server.msg);
      if (!r.ok && !r.skipped) r.note += setup + ends;
      out.push_back(r);
    }
  }
}

// One placement: server and client forked (each entering its namespace first when `netns`),
// the parent waiting on both with a deadline; one row per (receive method, size).
// A Shared with room for every block's samples, in an anonymous shared mapping (inherited by
// forked ends); every block kNotRun. Released by FreeShared.
Shared* MapShared(const Opts& o) {
  void* mem =
      mmap(nullptr, SharedBytes(o), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  PCK(mem != MAP_FAILED);
  Shared* sh = new (mem) Shared();
  for (auto& row : sh->blocks) {
    for (Block& b : row) b.client.err = b.server.err = kNotRun;
  }
  return sh;
}
void FreeShared(Shared* sh, const Opts& o) {
  sh->~Shared();
  munmap(sh, SharedBytes(o));
}

void RunPlacement(const char* name, bool netns, const Opts& o, std::vector<Result>& out) {
  Shared* sh = MapShared(o);
  const char* ip = netns ? kAddrB : "127.0.0.1";
  const pid_t parent = getpid();
  for (int i = 0; i < 2; ++i) {
    fflush(stdout), fflush(stderr);
    const pid_t pid = fork();
    PCK(pid >= 0);
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the parent
      if (getppid() != parent) _exit(3);
      Side* setup = i == 0 ? &sh->setup_server : &sh->setup_client;
      if (netns && !EnterNetns(i == 0 ? kNsB : kNsA, setup)) {
        if (i == 0) sh->port.store(-1);
        _exit(1);
      }
      _exit(i == 0 ? ServerMain(sh, ip, 0, Ends{}) : ClientMain(sh, o, ip, Ends{}));
    }
    g_children[i] = pid;
  }
  // Each wait of the ends is bounded; this bound covers all of them.
  const uint64_t end = NowNs() + kSetupNs + kNumRecv * kNumSizes * (kBudgetNs + 2 * kWaitNs);
  int st[2] = {0, 0};
  bool reaped[2] = {false, false}, killed = false;
  while (!(reaped[0] && reaped[1])) {
    for (int i = 0; i < 2; ++i) {
      if (!reaped[i]) reaped[i] = waitpid(g_children[i], &st[i], WNOHANG) == g_children[i];
    }
    if (!killed && NowNs() > end) {
      for (int i = 0; i < 2; ++i) {
        if (!reaped[i]) kill(g_children[i], SIGKILL);
      }
      killed = true;
    }
    usleep(20000);
  }
  g_children[0] = g_children[1] = -1;
  std::string ends;
  for (int i = 0; i < 2; ++i) {
    if (!WIFEXITED(st[i]) || WEXITSTATUS(st[i]) != 0) {
      ends += std::string(i ? " client" : " server") + "_exit=" +
              (WIFEXITED(st[i]) ? std::to_string(WEXITSTATUS(st[i]))
                                : "signal" + std::to_string(WTERMSIG(st[i])));
    }
  }
  if (killed) ends += " killed_after_deadline";
  AddRows(name, *sh, o, kNumRecv, ends, out);
  FreeShared(sh, o);
}

// ---- between two hosts ----

// "HOST:PORT" split, HOST resolved to an IPv4 or IPv6 address (a name through getaddrinfo, its
// first address; an IPv6 address in brackets: "[::1]:PORT"); with `host_optional` a bare "PORT"
// listens on every IPv4 address. "" or what is wrong.
std::string ParseHostPort(const std::string& arg, bool host_optional, std::string* ip, int* port) {
  const size_t c = arg.rfind(':');
  if (c == std::string::npos && !host_optional) return "expected HOST:PORT, got '" + arg + "'";
  std::string host = c == std::string::npos ? "0.0.0.0" : arg.substr(0, c);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return "an IPv6 address goes in brackets: '[" + host + "]:PORT', got '" + arg + "'";
  }
  const std::string p = c == std::string::npos ? arg : arg.substr(c + 1);
  char* end = nullptr;
  const long n = strtol(p.c_str(), &end, 10);
  if (p.empty() || *end != 0 || n < 0 || n > 65535 || (n == 0 && !host_optional)) {
    return "bad port '" + p + "' in '" + arg + "'";
  }
  *port = int(n);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM;
  if (const int e = getaddrinfo(host.c_str(), nullptr, &hints, &found)) {
    return "cannot resolve '" + host + "': " + gai_strerror(e);
  }
  *ip = resident::addressText(found->ai_addr);
  freeaddrinfo(found);
  return "";
}

// --listen: the echo end of tcp_hosts, for one --connect; prints each failed check. 0 when every
// block passed its checks, 1 otherwise.
int RunListen(const Opts& o) {
  std::string ip;
  int port = 0;
  if (const std::string why = ParseHostPort(o.listen, true, &ip, &port); !why.empty()) {
    fprintf(stderr, "tcp_floor: --listen: %s\n", why.c_str());
    return 2;
  }
  Shared* sh = MapShared(o);
  const int status = ServerMain(sh, ip.c_str(), port, kRemoteEnds);
  if (sh->setup_server.err != kOk) printf("tcp_floor: FAILED: %s\n", sh->setup_server.msg);
  for (int v = 0; v < kRemoteEnds.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const Side& me = sh->blocks[v][s].server;
      if (me.err != kOk) {
        printf("tcp_floor: FAILED %s %zu B: %s (%s)\n", kRecvName[v], kSizes[s], ErrName(me.err),
               me.msg);
      }
    }
  }
  printf("tcp_floor: served %s: %s\n",
         resident::endpointText(ip, uint16_t(sh->port.load())).c_str(),
         status ? "failed" : "every check passed");
  FreeShared(sh, o);
  return status ? 1 : 0;
}

// --connect: the timing end of tcp_hosts; its rows carry the echo end's checks.
void RunConnect(const Opts& o, std::vector<Result>& out) {
  std::string ip;
  int port = 0;
  if (const std::string why = ParseHostPort(o.connect, false, &ip, &port); !why.empty()) {
    fprintf(stderr, "tcp_floor: --connect: %s\n", why.c_str());
    exit(2);
  }
  Shared* sh = MapShared(o);
  sh->port.store(port);
  const int status = ClientMain(sh, o, ip.c_str(), kRemoteEnds);
  AddRows(kHostsName, *sh, o, kRemoteEnds.methods,
          status ? " client_exit=" + std::to_string(status) : "", out);
  FreeShared(sh, o);
}

// ---- output ----

void WriteJson(const std::string& path, const Opts& o, const std::vector<Result>& res) {
  FILE* f = fopen(path.c_str(), "w");
  PCK(f != nullptr);
  char host[256] = "?", date[32];
  gethostname(host, sizeof(host) - 1);
  utsname u{};
  uname(&u);
  const time_t now = time(nullptr);
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  fprintf(f, "{\"program\": \"tcp_floor\", \"host\": %s, \"cpus\": %ld, \"kernel\": %s, ",
          JsonStr(host).c_str(), sysconf(_SC_NPROCESSORS_ONLN), JsonStr(u.release).c_str());
  fprintf(f, "\"date\": \"%s\", \"iters\": %ld, \"warmup\": %ld, ", date, o.iters, o.warmup);
  if (!o.connect.empty()) fprintf(f, "\"peer\": %s, ", JsonStr(o.connect).c_str());
  WriteResultRows(f, res);
  fprintf(f, "}\n");
  PCK(fclose(f) == 0);
}

void Usage() {
  fprintf(stderr,
          "usage: tcp_floor [--only NAME[,NAME]] [--iters N] [--json PATH] [--corrupt]\n"
          "       tcp_floor --listen [ADDR:]PORT      (on one host: the echo end of tcp_hosts)\n"
          "       tcp_floor --connect HOST:PORT [--iters N] [--json PATH] [--corrupt]\n"
          "                                           (on the other: the timing end)\n"
          "  HOST, ADDR: a name, an IPv4 address or an IPv6 one in brackets ([::1]:7100)\n"
          "  names: tcp_loopback tcp_netns\n"
          "  --corrupt: spoil each block's last message (checks that the far side notices)\n");
  exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) {
      if (!ParseNameList(argv[++i], kNames, &o.only)) Usage();
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::min(std::max(atol(argv[++i]), long(kMinSamples)), 1000000L);
    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else if (a == "--corrupt") {
      o.corrupt = true;
    } else if (a == "--listen" && i + 1 < argc) {
      o.listen = argv[++i];
    } else if (a == "--connect" && i + 1 < argc) {
      o.connect = argv[++i];
    } else {
      Usage();
    }
  }
  // --listen takes no other option; --connect runs its placement alone
  if (!o.listen.empty() && argc != 3) Usage();
  if (!o.connect.empty() && !o.only.empty()) Usage();
  o.warmup = std::min(std::max(o.iters / 10, 10L), 1000L);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) signal(sig, OnSignal);
  if (!o.listen.empty()) return RunListen(o);
  printf("tcp_floor: %ld cpus, iters %ld, warm-up %ld round trips per row\n",
         sysconf(_SC_NPROCESSORS_ONLN), o.iters, o.warmup);

  std::vector<Result> res;
  if (!o.connect.empty()) {
    printf("running %s to %s\n", kHostsName, o.connect.c_str());
    RunConnect(o, res);
  } else if (o.Want("tcp_loopback")) {
    printf("running tcp_loopback\n");
    RunPlacement("tcp_loopback", false, o, res);
  }
  if (o.connect.empty() && o.Want("tcp_netns")) {
    printf("running tcp_netns\n");
    int lock_fd = -1;
    const std::string why = SetUpNetns(&lock_fd);
    if (why.empty()) {
      RunPlacement("tcp_netns", true, o, res);
      RemoveNetns();
    } else {
      Result r;
      r.name = "tcp_netns", r.skipped = true, r.note = "not run: " + why;
      r.unit = "us one-way (round trip / 2)";
      res.push_back(r);
    }
    if (lock_fd >= 0) close(lock_fd);
  }

  const bool all_ok = PrintResults(res);
  if (!o.json.empty()) {
    WriteJson(o.json, o, res);
    printf("wrote %s\n", o.json.c_str());
  }
  return all_ok ? 0 : 1;
}
