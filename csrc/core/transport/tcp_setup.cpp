// Set-up of the tcp transport: the listener, and the connections of a group (connect to the
// lower ranks, accept the higher ones, a checked handshake each way); after set-up the same
// handshake code keeps rejecting whatever else connects to the listener.
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/transport/tcp_address.hpp"
#include "core/transport/tcp_transport.hpp"

namespace resident {
namespace {

constexpr size_t kMaxPending = 16;  // unauthenticated connections at once
constexpr uint64_t kMs = 1000000ull;
constexpr uint64_t kRetryNs = 50 * kMs;

// <linux/tcp.h> of Linux 6.15+; absent from older headers.
constexpr int kTcpRtoMinUs = 45;
// The least TCP_RTO_MIN_US a kernel takes (it rounds up to whole jiffies).
constexpr int kRtoFloorUs = 5000;

// Small messages leave at once (TCP_NODELAY), and a lost one is resent within milliseconds: a
// lone segment in flight (a send/recv round trip, the last message before a wait) is resent by
// the tail loss probe after 2 RTTs plus the minimum RTO, 200 ms unless the socket lowers it
// (TCP_RTO_MIN_US). The RTO still grows with the measured RTT; a kernel without the option
// refuses it and keeps 200 ms.
void setLatencyOptions(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, kTcpRtoMinUs, &kRtoFloorUs, sizeof(kRtoFloorUs));
}

// A host that vanishes without closing its connections is noticed: the kernel aborts the
// connection (ETIMEDOUT) once sent data, or the keepalive probes that an idle connection sends
// every second, go unacknowledged for `timeout_ns`.
void setUnreachableTimeout(int fd, uint64_t timeout_ns) {
  const int one = 1;
  const unsigned ms = static_cast<unsigned>(std::max<uint64_t>(timeout_ns / kMs, 1));
  const int probes = static_cast<int>(std::max<unsigned>(ms / 1000, 1));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

// A handshake message on a fresh socket: the kernel takes it whole or the attempt failed.
bool sendSmall(int fd, const void* data, size_t n) {
  for (;;) {
    const ssize_t k = send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    return k == static_cast<ssize_t>(n);
  }
}

}  // namespace

TcpTransport::TcpTransport(int rank, int nranks, unsigned char* segment, size_t segment_bytes,
                           const TcpOptions& opts)
    : rank_(rank),
      nranks_(nranks),
      segment_(segment),
      segment_bytes_(segment_bytes),
      opts_(opts),
      expected_(static_cast<size_t>(nranks), false),
      conns_(static_cast<size_t>(nranks)),
      staging_(kStagingBytes) {
  if (!opts.trace_prefix.empty()) trace_ = std::make_unique<ProxyTrace>(size_t{1} << 21);
  const ListenAddress chosen = chooseListenAddress(opts.bind_addr, opts.rendezvous_host);
  const std::string& addr = chosen.address;
  sockaddr_storage sa{};
  socklen_t len = 0;
  socketAddress(addr, 0, sa, len);  // a literal of either family, checked by chooseListenAddress
  listener_.reset(socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listener_.get() < 0)
    throw CommError(std::string("resident: socket() failed: ") + std::strerror(errno));
  if (bind(listener_.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0 ||
      listen(listener_.get(), 128) != 0) {
    throw CommError("resident: rank " + std::to_string(rank) + " cannot listen on tcp address " +
                    addr + (opts.bind_addr.empty() ? "" : " (RESIDENT_TCP_ADDR)") + ": " +
                    std::strerror(errno));
  }
  len = sizeof(sa);
  getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&sa), &len);
  endpoint_ = endpointText(reinterpret_cast<const sockaddr*>(&sa));
  epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
  if (epoll_.get() < 0)
    throw CommError(std::string("resident: epoll_create1 failed: ") + std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenerTag;
  epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &ev);
  pending_.reserve(kMaxPending);
  RLOG_DEBUG("rank %d: tcp listening on %s (%s)", rank_, endpoint_.c_str(), chosen.reason.c_str());
}

void TcpTransport::establish(const std::vector<std::string>& endpoints,
                             const std::vector<bool>& tcp_peer, const tcp::Secret& secret,
                             uint64_t timeout_ns) {
  secret_ = secret;
  const uint64_t start = nowNs();
  const uint64_t deadline = start + timeout_ns;
  for (int p = 0; p < nranks_; ++p) {
    const auto i = static_cast<size_t>(p);
    expected_[i] = p != rank_ && tcp_peer[i];
    if (!expected_[i]) continue;
    Conn& c = conns_[i];
    c.out = tcp::OutQueue(opts_.out_buffer_bytes);
    c.reader = tcp::FrameReader(segment_, segment_bytes_);
    c.state = ConnState::kIdle;
    c.endpoint = endpoints[i];
    if (p < rank_ && !parseEndpoint(c.endpoint, c.addr, c.addr_len)) {
      throw CommError("resident: " + rankText(p) + " published a malformed tcp endpoint '" +
                      c.endpoint + "'");
    }
  }
  std::vector<pollfd> fds;
  std::vector<int> who;  // -1: the listener; otherwise the peer whose connection it is
  for (;;) {
    const uint64_t now = nowNs();
    std::string missing;
    for (int p = 0; p < nranks_; ++p) {
      const Conn& c = conns_[static_cast<size_t>(p)];
      if (!expected_[static_cast<size_t>(p)] || c.state == ConnState::kOpen) continue;
      missing += " " + rankText(p);
      missing += p < rank_ ? " at " + c.endpoint + " (" +
                                 (c.last_error.empty() ? "no answer" : c.last_error) + ");"
                           : " did not connect;";
    }
    if (missing.empty()) break;
    if (now > deadline) {
      throw CommError("resident: " + rankText(rank_) + " could not set up its tcp connections in " +
                      std::to_string(timeout_ns / kMs) + " ms:" + missing +
                      " (is the address reachable? RESIDENT_TCP_ADDR picks the interface)");
    }
    for (int p = 0; p < rank_; ++p) {
      Conn& c = conns_[static_cast<size_t>(p)];
      if (expected_[static_cast<size_t>(p)] && c.state == ConnState::kIdle && now >= c.retry_at)
        startConnect(p, now);
    }
    fds.assign(1, pollfd{listener_.get(), POLLIN, 0});
    who.assign(1, -1);
    for (const Pending& pd : pending_) {
      fds.push_back(pollfd{pd.fd.get(), POLLIN, 0});
      who.push_back(-2);
    }
    for (int p = 0; p < rank_; ++p) {
      const Conn& c = conns_[static_cast<size_t>(p)];
      if (c.state == ConnState::kConnecting || c.state == ConnState::kAwaitAck) {
        fds.push_back(
            pollfd{c.fd.get(),
                   static_cast<short>(c.state == ConnState::kConnecting ? POLLOUT : POLLIN), 0});
        who.push_back(p);
      }
    }
    if (::poll(fds.data(), fds.size(), 20) < 0 && errno != EINTR)
      throw CommError(std::string("resident: poll failed: ") + std::strerror(errno));
    const uint64_t t = nowNs();
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      if (who[k] == -1) acceptNew(deadline);
      if (who[k] >= 0) advanceConnect(who[k], fds[k].revents, t);
    }
    for (size_t k = 0; k < pending_.size();) {
      if (servicePending(pending_[k], true))
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
      else
        ++k;
    }
  }
  int peers = 0;
  for (int p = 0; p < nranks_; ++p)
    if (expected_[static_cast<size_t>(p)]) {
      ++peers;
      only_peer_ = p;
    }
  // One peer: its socket is read on each pass and stays out of the epoll set (see poll()).
  if (peers != 1) only_peer_ = -1;
  for (int p = 0; p < nranks_; ++p) {
    if (!expected_[static_cast<size_t>(p)] || only_peer_ >= 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<uint64_t>(p);
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, conns_[static_cast<size_t>(p)].fd.get(), &ev);
  }
  wait_fds_.reserve(static_cast<size_t>(nranks_) + 1);
  established_ = true;
  RLOG_INFO("rank %d: tcp connections to %d peer(s) up in %llu ms (listening on %s)", rank_, peers,
            static_cast<unsigned long long>((nowNs() - start) / kMs), endpoint_.c_str());
}

void TcpTransport::startConnect(int peer, uint64_t now) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  c.fd.reset(socket(c.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (c.fd.get() < 0) return retryLater(peer, std::string("socket: ") + std::strerror(errno), now);
  setLatencyOptions(c.fd.get());
  setUnreachableTimeout(c.fd.get(), opts_.unreachable_timeout_ns);
  if (connect(c.fd.get(), reinterpret_cast<const sockaddr*>(&c.addr), c.addr_len) == 0) {
    c.state = ConnState::kConnecting;
    return advanceConnect(peer, POLLOUT, now);
  }
  if (errno != EINPROGRESS) return retryLater(peer, std::strerror(errno), now);
  c.state = ConnState::kConnecting;
}

void TcpTransport::advanceConnect(int peer, short revents, uint64_t now) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  if (c.state == ConnState::kConnecting) {
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(c.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return retryLater(peer, std::strerror(err), now);
    tcp::Hello h{};
    h.magic = tcp::kHelloMagic;
    std::memcpy(h.secret, secret_.bytes, sizeof(h.secret));
    h.rank = static_cast<uint32_t>(rank_);
    h.nranks = static_cast<uint32_t>(nranks_);
    if (!sendSmall(c.fd.get(), &h, sizeof(h)))
      return retryLater(peer, "could not send the handshake", now);
    c.state = ConnState::kAwaitAck;
    c.ack_have = 0;
    return;
  }
  if (c.state != ConnState::kAwaitAck) return;
  while (c.ack_have < sizeof(c.ack)) {
    const ssize_t k =
        recv(c.fd.get(), c.ack + c.ack_have, sizeof(c.ack) - c.ack_have, MSG_DONTWAIT);
    if (k > 0) {
      c.ack_have += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return retryLater(
        peer,
        k == 0 ? "it closed the connection during the handshake (rejected?)" : std::strerror(errno),
        now);
  }
  tcp::HelloAck a;
  std::memcpy(&a, c.ack, sizeof(a));
  if (a.magic != tcp::kAckMagic || a.rank != static_cast<uint32_t>(peer) ||
      a.nranks != static_cast<uint32_t>(nranks_)) {
    return retryLater(peer, "unexpected answer to the handshake", now);
  }
  c.state = ConnState::kOpen;
  RLOG_DEBUG("rank %d: tcp connection to rank %d (%s) up", rank_, peer, c.endpoint.c_str());
}

void TcpTransport::retryLater(int peer, const std::string& why, uint64_t now) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  RLOG_DEBUG("rank %d: tcp connection to rank %d (%s): %s; retrying", rank_, peer,
             c.endpoint.c_str(), why.c_str());
  c.fd.reset();
  c.state = ConnState::kIdle;
  c.retry_at = now + kRetryNs;
  c.last_error = why;
}

void TcpTransport::acceptNew(uint64_t deadline) {
  for (int i = 0; i < 64; ++i) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    const int fd = accept4(listener_.get(), reinterpret_cast<sockaddr*>(&from), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        RLOG_WARN("rank %d: tcp accept failed: %s", rank_, std::strerror(errno));
      return;
    }
    Pending p;
    p.fd.reset(fd);
    p.from = endpointText(reinterpret_cast<const sockaddr*>(&from));
    p.deadline = deadline;
    if (pending_.size() >= kMaxPending) {
      reject(p, "too many connections are waiting for their handshake");
      continue;
    }
    pending_.push_back(std::move(p));
  }
}

void TcpTransport::reject(Pending& p, const std::string& reason) {
  ++rejected_;
  RLOG_WARN("rank %d: rejected a tcp connection from %s: %s", rank_, p.from.c_str(),
            reason.c_str());
  p.fd.reset();
}

bool TcpTransport::servicePending(Pending& p, bool setting_up) {
  while (p.have < sizeof(p.hello)) {
    const ssize_t k = recv(p.fd.get(), p.hello + p.have, sizeof(p.hello) - p.have, MSG_DONTWAIT);
    if (k > 0) {
      p.have += static_cast<size_t>(k);
      uint64_t magic = 0;
      std::memcpy(&magic, p.hello, sizeof(magic));
      if (p.have >= sizeof(magic) && magic != tcp::kHelloMagic) {
        reject(p, "bad magic in the handshake (not a resident peer)");
        return true;
      }
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (nowNs() <= p.deadline) return false;
      reject(p, "no complete handshake in time (" + std::to_string(p.have) + " of " +
                    std::to_string(sizeof(p.hello)) + " bytes)");
      return true;
    }
    reject(p, k == 0 ? "closed during the handshake (" + std::to_string(p.have) + " of " +
                           std::to_string(sizeof(p.hello)) + " bytes)"
                     : std::string("receive failed during the handshake: ") + std::strerror(errno));
    return true;
  }
  tcp::Hello h;
  std::memcpy(&h, p.hello, sizeof(h));
  if (const char* why = tcp::validateHello(h, secret_, nranks_, rank_)) {
    reject(p, why);
    return true;
  }
  const int peer = static_cast<int>(h.rank);
  Conn& c = conns_[static_cast<size_t>(peer)];
  if (!expected_[static_cast<size_t>(peer)] || peer < rank_) {
    reject(p, rankText(peer) + " does not connect to this rank over tcp");
    return true;
  }
  if (!setting_up || c.state != ConnState::kIdle) {
    reject(p, rankText(peer) + " is already connected (reconnecting is not supported)");
    return true;
  }
  const tcp::HelloAck ack{tcp::kAckMagic, static_cast<uint32_t>(rank_),
                          static_cast<uint32_t>(nranks_)};
  if (!sendSmall(p.fd.get(), &ack, sizeof(ack))) {
    reject(p, "could not answer the handshake");
    return true;
  }
  setLatencyOptions(p.fd.get());
  setUnreachableTimeout(p.fd.get(), opts_.unreachable_timeout_ns);
  c.fd = std::move(p.fd);
  c.state = ConnState::kOpen;
  RLOG_DEBUG("rank %d: tcp connection from rank %d (%s) accepted", rank_, peer, p.from.c_str());
  return true;
}

}  // namespace resident
