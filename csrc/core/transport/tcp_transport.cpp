// The tcp transport's data path (proxy thread): queueing and flushing frames, taking in and
// applying what arrives, peers that fail or leave, and the goodbye at shutdown. Set-up is in
// tcp_setup.cpp.
#include "core/transport/tcp_transport.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/clock.hpp"
#include "core/log.hpp"

namespace resident {
namespace {

using tcp::FrameHeader;
using tcp::FrameType;

// A payload with at least this much left is received straight into the segment.
constexpr size_t kDirectRecvMin = 4096;
// A slot (writeThenSignal) whose payload is at least this large leaves at once, from its source,
// with what is queued; smaller ones are copied and leave with the pass's other frames.
constexpr size_t kDirectSendMin = size_t{16} * 1024;
// A payload from the registered source at least this large is queued by reference; smaller
// ones are copied, as cheap as a reference's bookkeeping.
constexpr size_t kRefMin = 256;
// Regions one flush hands to sendmsg (every reference has one, the ring two at most between).
constexpr int kFlushIovecs = 3 * tcp::OutQueue::kMaxRefs + 2;
constexpr uint64_t kMs = 1000000ull;
constexpr uint64_t kGoodbyeNs = 200 * kMs;

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    reset(o.fd_);
    o.fd_ = -1;
  }
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

TcpTransport::~TcpTransport() {
  shutdown();
}

void TcpTransport::setRankNames(std::vector<std::string> names) {
  names_ = std::move(names);
}

std::string TcpTransport::rankText(int r) const {
  if (r >= 0 && static_cast<size_t>(r) < names_.size()) return names_[static_cast<size_t>(r)];
  return "rank " + std::to_string(r);
}

bool TcpTransport::connected(int peer) const {
  return conns_[static_cast<size_t>(peer)].state == ConnState::kOpen;
}

std::string TcpTransport::peerState(int peer) const {
  const Conn& c = conns_[static_cast<size_t>(peer)];
  if (c.state != ConnState::kOpen) return "tcp connection closed";
  std::string s = "tcp: " + std::to_string(c.out.size()) + " B queued to send, " +
                  std::to_string(c.reader.frames()) + " frames taken in, ";
  if (c.reader.inPayload())
    s += "inside a payload (" + std::to_string(c.reader.payloadRemaining()) + " B to come)";
  else
    s += c.reader.atBoundary() ? "between frames" : "inside a frame header";
  return s;
}

std::vector<TcpTransport::Event> TcpTransport::takeEvents() {
  std::vector<Event> out;
  out.swap(events_);
  return out;
}

// ---- data path (proxy thread) ---------------------------------------------------------------

void TcpTransport::write(int peer, size_t offset, const void* src, size_t bytes) {
  if (bytes == 0) return;
  appendFrame(peer, FrameHeader{static_cast<uint32_t>(FrameType::kWrite), 0, offset, bytes}, src,
              bytes);
}

bool TcpTransport::registerSource(const void* base, size_t bytes) {
  source_ = static_cast<const unsigned char*>(base);
  source_bytes_ = bytes;
  return true;
}

void TcpTransport::releaseSource() {
  const uint64_t deadline = nowNs() + kGoodbyeNs;
  for (int p = 0; p < nranks_; ++p) {
    Conn& c = conns_[static_cast<size_t>(p)];
    while (c.state == ConnState::kOpen && c.out.hasRefs()) {
      flush(c, p);
      if (c.state != ConnState::kOpen || !c.out.hasRefs()) break;
      if (abort_.load(std::memory_order_acquire) || nowNs() > deadline) {
        // A frame cut short: the peer reports this rank as failed mid-message, as it would
        // if this process exited now.
        drop(p, false,
             "resident: " + rankText(p) + " took no data from " + rankText(rank_) +
                 " over tcp while its GPU path shut down; connection closed");
        break;
      }
      receiveAll();  // the peer may be blocked sending to this rank
      pollfd f{c.fd.get(), POLLOUT, 0};
      ::poll(&f, 1, 1);
    }
  }
  source_ = nullptr;
  source_bytes_ = 0;
}

void TcpTransport::signal(int peer, size_t offset, uint64_t value) {
  appendFrame(peer, FrameHeader{static_cast<uint32_t>(FrameType::kSignal), 0, offset, value},
              nullptr, 0);
}

void TcpTransport::appendFrame(int peer, const FrameHeader& h, const void* payload, size_t bytes) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  if (c.state != ConnState::kOpen) return;  // gone or failed: the owner has been told
  if (bytes >= kRefMin && inSource(payload, bytes)) {
    // From the registered source: queued by reference, sent with the rest of the pass.
    if (append(c, peer, &h, sizeof(h)) && !c.out.appendRef(payload, bytes))
      append(c, peer, payload, bytes);
    return;
  }
  if (append(c, peer, &h, sizeof(h)) && bytes != 0) append(c, peer, payload, bytes);
}

void TcpTransport::writeThenSignal(int peer, const WriteRegion* regions, int n, size_t flag_offset,
                                   uint64_t value) {
  constexpr int kMaxRegions = 4;
  Conn& c = conns_[static_cast<size_t>(peer)];
  bool direct = c.state == ConnState::kOpen && n <= kMaxRegions && !c.out.hasRefs();
  bool large = false;
  for (int i = 0; i < n; ++i) {
    large = large || regions[i].bytes >= kDirectSendMin;
    direct = direct && (regions[i].bytes == 0 || !inSource(regions[i].src, regions[i].bytes));
  }
  if (!direct || !large) {
    // Small writes wait for the pass's one flush per peer; the source's go by reference.
    Transport::writeThenSignal(peer, regions, n, flag_offset, value);
    return;
  }
  // One system call instead of three (the queue, the payload's frame, then header and flag at
  // the pass's end): on loopback each sendmsg also runs the peer's receive work.
  FrameHeader headers[kMaxRegions + 1];
  iovec iov[2 * kMaxRegions + 3];
  int k = c.out.gather(iov, 3);  // the ring's bytes: no references are queued
  const int queued = k;
  for (int i = 0; i < n; ++i) {
    if (regions[i].bytes == 0) continue;  // as write(): no frame
    headers[i] = FrameHeader{static_cast<uint32_t>(FrameType::kWrite), 0, regions[i].offset,
                             regions[i].bytes};
    iov[k++] = {&headers[i], sizeof(FrameHeader)};
    iov[k++] = {const_cast<void*>(regions[i].src), regions[i].bytes};
  }
  headers[n] = FrameHeader{static_cast<uint32_t>(FrameType::kSignal), 0, flag_offset, value};
  iov[k++] = {&headers[n], sizeof(FrameHeader)};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = static_cast<size_t>(k);
  ssize_t sent;
  do {
    sent = sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (sent < 0 && errno == EINTR);
  if (trace_) trace_->record(TraceEvent::kSent, peer, sent > 0 ? static_cast<uint64_t>(sent) : 0);
  if (sent < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK) return lost(peer, std::strerror(errno), errno);
    sent = 0;
  }
  size_t left = static_cast<size_t>(sent);
  const size_t ring_bytes = c.out.size();
  c.out.consume(left < ring_bytes ? left : ring_bytes);
  left -= left < ring_bytes ? left : ring_bytes;
  for (int i = queued; i < k; ++i) {
    const size_t skip = left < iov[i].iov_len ? left : iov[i].iov_len;
    left -= skip;
    if (skip < iov[i].iov_len &&
        !append(c, peer, static_cast<const unsigned char*>(iov[i].iov_base) + skip,
                iov[i].iov_len - skip))
      return;
  }
}

bool TcpTransport::append(Conn& c, int peer, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (;;) {
    const size_t k = c.out.append(p, n);
    p += k;
    n -= k;
    if (n == 0) return true;
    const size_t half = c.out.capacity() / 2;
    if (!makeRoom(c, peer, n < half ? n : half)) return false;
  }
}

bool TcpTransport::makeRoom(Conn& c, int peer, size_t want) {
  uint64_t last_progress = nowNs();
  for (;;) {
    const size_t queued = c.out.size();
    flush(c, peer);
    if (c.state != ConnState::kOpen) return false;
    if (c.out.space() >= want) return true;
    if (c.out.size() < queued) last_progress = nowNs();
    if (abort_.load(std::memory_order_acquire)) {
      // The group is going away: the rest of this frame is dropped, so is the connection.
      c.fd.reset();
      c.state = ConnState::kClosed;
      c.out.clear();
      return false;
    }
    // The peer may itself be blocked sending to this rank: keep taking in what arrives, from
    // every peer, while waiting (two proxies writing to each other never deadlock).
    receiveAll();
    if (c.state != ConnState::kOpen) return false;
    if (nowNs() - last_progress > opts_.stall_timeout_ns) {
      drop(peer, true,
           "resident: " + rankText(peer) + " took no data from " + rankText(rank_) +
               " over tcp for " + std::to_string(opts_.stall_timeout_ns / kMs) +
               " ms (it hung, or the network between them is down)",
           true);
      return false;
    }
    wait_fds_.clear();
    wait_fds_.push_back(pollfd{c.fd.get(), POLLOUT, 0});
    for (const Conn& o : conns_)
      if (o.state == ConnState::kOpen && &o != &c)
        wait_fds_.push_back(pollfd{o.fd.get(), POLLIN, 0});
    ::poll(wait_fds_.data(), wait_fds_.size(), 1);
  }
}

void TcpTransport::flush(Conn& c, int peer) {
  while (c.out.size() != 0) {
    iovec iov[kFlushIovecs];
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(c.out.gather(iov, kFlushIovecs));
    const ssize_t k = sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (trace_) trace_->record(TraceEvent::kSent, peer, k > 0 ? static_cast<uint64_t>(k) : 0);
    if (k > 0) {
      c.out.consume(static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return lost(peer, k < 0 ? std::strerror(errno) : "send took nothing", k < 0 ? errno : 0);
  }
}

void TcpTransport::poll() {
  if (!established_ || shut_down_) return;
  for (int p = 0; p < nranks_; ++p) {
    Conn& c = conns_[static_cast<size_t>(p)];
    if (c.state == ConnState::kOpen && c.out.size() != 0) flush(c, p);
  }
  if (only_peer_ >= 0) {
    // A rank with one tcp peer reads that socket directly: one system call per pass, as an
    // empty epoll_wait, and when data is there one instead of two; its peer's sends also skip
    // the epoll wake-up callback (2 ranks on 2 cores, 8 B all_reduce: docs/decisions.md). The
    // listener, which only turns away strangers once the group is up, is looked at every
    // kListenerPasses passes, and by serviceListener.
    if (conns_[static_cast<size_t>(only_peer_)].state == ConnState::kOpen) receiveFrom(only_peer_);
    if (++passes_ % kListenerPasses != 0 && pending_.empty()) return;
  }
  pollEpollSet();
}

void TcpTransport::serviceListener() {
  if (!established_ || shut_down_ || only_peer_ < 0) return;  // with epoll: every pass
  pollEpollSet();
}

void TcpTransport::pollEpollSet() {
  epoll_event evs[16];
  const int n = epoll_wait(epoll_.get(), evs, 16, 0);
  for (int i = 0; i < n; ++i) {
    if (evs[i].data.u64 == kListenerTag) {
      acceptNew(nowNs() + opts_.handshake_timeout_ns);
    } else {
      if (trace_) trace_->record(TraceEvent::kReadable, static_cast<int>(evs[i].data.u64), 0);
      receiveFrom(static_cast<int>(evs[i].data.u64));
    }
  }
  for (size_t k = 0; k < pending_.size();) {
    if (servicePending(pending_[k], false))
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
    else
      ++k;
  }
}

void TcpTransport::receiveAll() {
  for (int p = 0; p < nranks_; ++p)
    if (conns_[static_cast<size_t>(p)].state == ConnState::kOpen) receiveFrom(p);
}

void TcpTransport::receiveFrom(int peer) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  for (int i = 0; i < 64 && c.state == ConnState::kOpen; ++i) {
    // Between frames, read a little (headers and small payloads, a few frames at once): a large
    // payload behind a header is then read straight into the segment, not copied from here,
    // and the frames behind it (its slot's header and flag) in the same call.
    const size_t direct = c.reader.inPayload() && c.reader.payloadRemaining() >= kDirectRecvMin
                              ? c.reader.payloadRemaining()
                              : 0;
    const size_t asked = direct + kStagingRecvBytes;
    ssize_t k;
    if (direct != 0) {
      iovec iov[2] = {{c.reader.payloadDest(), direct}, {staging_.data(), kStagingRecvBytes}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      k = recvmsg(c.fd.get(), &m, MSG_DONTWAIT);
    } else {
      // recv costs less than recvmsg, and most calls of a polling pass find nothing.
      k = recv(c.fd.get(), staging_.data(), kStagingRecvBytes, MSG_DONTWAIT);
    }
    if (trace_ && k > 0) trace_->record(TraceEvent::kReceived, peer, static_cast<uint64_t>(k));
    if (k > 0) {
      activity_ = true;
      const size_t into_segment = static_cast<size_t>(k) < direct ? static_cast<size_t>(k) : direct;
      if (into_segment != 0) c.reader.payloadReceived(into_segment);
      if (static_cast<size_t>(k) > into_segment &&
          !applyStaged(c, peer, static_cast<size_t>(k) - into_segment))
        return;
      if (static_cast<size_t>(k) < asked) return;  // drained for now
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return lost(peer, k == 0 ? "connection closed" : std::strerror(errno), k == 0 ? 0 : errno);
  }
}

bool TcpTransport::applyStaged(Conn& c, int peer, size_t bytes) {
  const auto st = c.reader.consume(staging_.data(), bytes);
  if (st == tcp::FrameReader::Status::kError) {
    drop(peer, true,
         "resident: " + rankText(peer) + " sent a malformed frame over tcp to " + rankText(rank_) +
             ": " + c.reader.error() + "; connection closed");
    return false;
  }
  if (st == tcp::FrameReader::Status::kClosed) {
    drop(peer, false,
         "resident: " + rankText(peer) + " shut down its process group (" + rankText(rank_) +
             " got its goodbye over tcp)");
    return false;
  }
  return true;
}

void TcpTransport::lost(int peer, const char* how, int err) {
  const Conn& c = conns_[static_cast<size_t>(peer)];
  if (err == ETIMEDOUT) {  // the kernel gave up: nothing acknowledged for unreachable_timeout_ns
    drop(peer, true,
         "resident: " + rankText(peer) + " acknowledged nothing over tcp to " + rankText(rank_) +
             " for " + std::to_string(opts_.unreachable_timeout_ns / kMs) +
             " ms: its host or the network between them is down",
         true);
  } else if (c.reader.atBoundary()) {
    drop(peer, false,
         "resident: " + rankText(peer) + " closed its tcp connection to " + rankText(rank_) +
             " without a goodbye (" + how + "): it exited, crashed or was killed");
  } else {
    drop(peer, true,
         "resident: the tcp connection from " + rankText(peer) + " to " + rankText(rank_) +
             " broke inside a frame (" + how + "): " + rankText(peer) +
             " crashed or was killed mid-message");
  }
}

void TcpTransport::drop(int peer, bool fatal, const std::string& reason, bool unreachable) {
  Conn& c = conns_[static_cast<size_t>(peer)];
  if (c.state != ConnState::kOpen) return;
  const bool goodbye = c.reader.closed();
  if (goodbye) {
    RLOG_INFO("%s", reason.c_str());
  } else {
    RLOG_WARN("%s", reason.c_str());
  }
  c.fd.reset();  // closing also removes it from the epoll set
  c.state = ConnState::kClosed;
  c.out.clear();
  events_.push_back(Event{peer, fatal, goodbye, reason, unreachable});
}

void TcpTransport::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  const uint64_t deadline = nowNs() + kGoodbyeNs;
  const FrameHeader bye{static_cast<uint32_t>(FrameType::kClose), 0, 0, 0};
  for (int p = 0; p < nranks_; ++p) {
    Conn& c = conns_[static_cast<size_t>(p)];
    if (c.state == ConnState::kOpen) {
      // What is queued, then the goodbye, within a bounded time; then stop sending, and read
      // what is left so that closing does not reset the connection under the peer.
      if (c.out.space() >= sizeof(bye)) c.out.append(&bye, sizeof(bye));
      while (c.state == ConnState::kOpen && c.out.size() != 0 && nowNs() < deadline) {
        flush(c, p);
        if (c.state != ConnState::kOpen || c.out.size() == 0) break;
        pollfd f{c.fd.get(), POLLOUT, 0};
        ::poll(&f, 1, 10);
      }
      if (c.state == ConnState::kOpen) {
        ::shutdown(c.fd.get(), SHUT_WR);
        for (int i = 0;
             i < 64 && recv(c.fd.get(), staging_.data(), staging_.size(), MSG_DONTWAIT) > 0; ++i) {
        }
      }
    }
    c.fd.reset();
    c.state = ConnState::kClosed;
  }
  pending_.clear();
  listener_.reset();
  epoll_.reset();
  if (trace_) {
    static std::atomic<int> serial{0};
    trace_->save(opts_.trace_prefix, rank_, serial, ".tcp.tsv");
    trace_.reset();
  }
}

}  // namespace resident
