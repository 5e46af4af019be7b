// tcp_sockets.hpp: the set-up of tcp_floor.cpp's connection, off the measured path: HOST:PORT
// arguments, socket addresses (the library's tcp_address helpers), waiting for a listening or a
// connecting socket, connecting with retries, and the options of a connected socket.
// Header-only, so that the program builds from its one .cpp.
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/transport/tcp_address.hpp"
#include "tcp_shared.hpp"

inline void TuneSocket(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// Waits (poll, not on the measured path) until fd is ready for `events` or the deadline passes.
inline bool WaitFd(int fd, short events, uint64_t end) {
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

// A connected socket to ip:port, or -1 with errno set; a refused connection is tried again
// every 100 ms until `end` when `retry` (the other host's --listen may not be up yet).
inline int ConnectTo(const char* ip, int port, uint64_t end, bool retry) {
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
// "HOST:PORT" split, HOST resolved to an IPv4 or IPv6 address (a name through getaddrinfo, its
// first address; an IPv6 address in brackets: "[::1]:PORT"); with `host_optional` a bare "PORT"
// listens on every IPv4 address. "" or what is wrong.
inline std::string ParseHostPort(const std::string& arg, bool host_optional, std::string* ip,
                                 int* port) {
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
