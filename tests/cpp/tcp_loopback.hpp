// The tcp transport on real loopback sockets, as test_tcp_transport.cpp (the data path) and
// test_tcp_faults.cpp (misbehaving peers) drive it: a segment with guard bytes around it, a
// plain socket posing as a peer, a hello for it, polling until a condition holds, and a count of
// open file descriptors (each test ends with as many as it began with).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/clock.hpp"
#include "core/transport/tcp_transport.hpp"

namespace tcp_loopback {

using resident::TcpTransport;
using resident::tcp::FrameHeader;
using resident::tcp::FrameType;
using resident::tcp::Hello;
using resident::tcp::HelloAck;
using resident::tcp::Secret;

constexpr size_t kGuard = 4096;
constexpr uint64_t kSec = 1000000000ull;

inline int fdCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

struct Segment {
  explicit Segment(size_t bytes) : buf(bytes + 2 * kGuard, 0x5A), size(bytes) {
    std::memset(data(), 0, bytes);
  }
  unsigned char* data() { return buf.data() + kGuard; }
  bool guardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i)
      if (buf[i] != 0x5A || buf[kGuard + size + i] != 0x5A) return false;
    return true;
  }
  uint64_t flag(size_t off) {
    return reinterpret_cast<std::atomic<uint64_t>*>(data() + off)->load(std::memory_order_acquire);
  }
  std::vector<unsigned char> buf;
  size_t size;
};

// A plain socket playing a peer.
struct Raw {
  explicit Raw(const std::string& endpoint, int rcvbuf = 0) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    const size_t colon = endpoint.rfind(':');
    inet_pton(AF_INET, endpoint.substr(0, colon).c_str(), &a.sin_addr);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(endpoint.substr(colon + 1))));
    CHECK(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  }
  ~Raw() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  void send(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    while (n > 0) {
      const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
      if (k <= 0) return;  // the other side closed: fine for these tests
      c += k;
      n -= static_cast<size_t>(k);
    }
  }
  void frame(FrameType t, uint64_t off, uint64_t value, const void* payload = nullptr,
             size_t n = 0) {
    const FrameHeader h{static_cast<uint32_t>(t), 0, off, value};
    send(&h, sizeof(h));
    if (n != 0) send(payload, n);
  }
  bool readAck(int rank) {
    HelloAck a{};
    size_t got = 0;
    while (got < sizeof(a)) {
      const ssize_t k = recv(fd, reinterpret_cast<char*>(&a) + got, sizeof(a) - got, 0);
      if (k <= 0) return false;
      got += static_cast<size_t>(k);
    }
    return a.magic == resident::tcp::kAckMagic && a.rank == static_cast<uint32_t>(rank);
  }
  int fd = -1;
};

inline Hello helloFor(const Secret& s, uint32_t rank, uint32_t nranks) {
  Hello h{};
  h.magic = resident::tcp::kHelloMagic;
  std::memcpy(h.secret, s.bytes, sizeof(h.secret));
  h.rank = rank;
  h.nranks = nranks;
  return h;
}

// Polls `t` until `done` or a few seconds passed.
template <typename F>
bool pollUntil(TcpTransport& t, F done, double seconds = 5) {
  const uint64_t end = resident::nowNs() + static_cast<uint64_t>(seconds * 1e9);
  while (resident::nowNs() < end) {
    t.poll();
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return done();
}

}  // namespace tcp_loopback
