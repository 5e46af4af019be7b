// Transport to ranks on other hosts over TCP (no RDMA needed). One connection per peer pair;
// write() and signal() queue frames (tcp_frame.hpp) in a preallocated per-peer buffer (the GPU
// path's payloads by reference to its outbox, registerSource), poll() flushes each peer's queue
// in one sendmsg and applies incoming frames to the local segment (the sockets epoll says are
// readable; a rank with one tcp peer reads its socket directly). Only the thread running a proxy
// pass calls write, signal and poll (directCapable is false; the communicator's pass lock makes
// it one thread at a time: the proxy thread, or a caller waiting on its op), so nothing here is
// locked.
//
// Set-up, once per group: every rank listens (port 0: ephemeral) and publishes its endpoint;
// each rank connects to its lower-ranked tcp peers and accepts the higher ones; the connector
// sends {magic, group secret, rank, nranks}, the acceptor checks them all and answers. The
// listener stays open for the group's life and keeps rejecting (and logging) whatever else
// connects. A peer that sends a malformed frame, or whose connection drops inside a frame, is
// reported as fatal (the owner poisons the engine); one that closes cleanly is reported as
// lost (ops stuck on it fail). No connection problem crashes, hangs or writes outside the
// segment.
#pragma once

#include <netinet/in.h>
#include <poll.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/proxy/proxy_trace.hpp"
#include "core/transport/tcp_frame.hpp"
#include "core/transport/transport.hpp"

namespace resident {

struct TcpOptions {
  // RESIDENT_TCP_ADDR: an IPv4 address or an interface name to listen on (tcp_address.hpp).
  std::string bind_addr;
  // The rendezvous store's host (a TCPStore's), whose route picks the address where bind_addr
  // is empty; empty: unknown.
  std::string rendezvous_host;
  size_t out_buffer_bytes = size_t{1} << 20;   // per peer, allocated once
  uint64_t stall_timeout_ns = 30000000000ull;  // a peer that takes no data this long fails
  // A peer whose host acknowledges nothing this long (sent data, or keepalive probes of an idle
  // connection) fails: a host that vanished without closing its connections (power lost, link
  // cut). The kernel aborts the connection (TCP_USER_TIMEOUT, SO_KEEPALIVE every second).
  uint64_t unreachable_timeout_ns = 10000000000ull;
  uint64_t handshake_timeout_ns = 10000000000ull;  // unauthenticated connections are dropped
  // RESIDENT_GPU_PROXY_TRACE: a path prefix; each sendmsg and recv of the data path, and each
  // time epoll_wait found a peer's socket readable (two tcp peers or more), is recorded and written
  // to <prefix>.rank<r>.<n>.tcp.tsv at shutdown. Empty: off.
  std::string trace_prefix;
};

// A file descriptor closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

class TcpTransport : public Transport {
 public:
  // Starts listening at once; throws InvalidArgument/CommError if it cannot.
  TcpTransport(int rank, int nranks, unsigned char* segment, size_t segment_bytes,
               const TcpOptions& opts);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  // "a.b.c.d:port": what peers connect to.
  const std::string& endpoint() const { return endpoint_; }
  // Connects every peer p with tcp_peer[p] (endpoints[p] is its endpoint): to lower ranks,
  // from higher ones. Throws CommError naming the ranks not connected within the timeout.
  void establish(const std::vector<std::string>& endpoints, const std::vector<bool>& tcp_peer,
                 const tcp::Secret& secret, uint64_t timeout_ns);

  const char* name() const override { return "tcp"; }
  // A payload inside the registered source (the GPU path's outbox) is queued by reference and
  // sent from where it is with the rest of the pass's frames, in one sendmsg per peer.
  void write(int peer, size_t offset, const void* src, size_t bytes) override;
  bool registerSource(const void* base, size_t bytes) override;
  void releaseSource() override;
  void signal(int peer, size_t offset, uint64_t value) override;
  // With a payload of kDirectSendMin or more from outside the registered source (a CPU
  // tensor's slot), what is queued for the peer, the frames and the flag go in one sendmsg;
  // what the kernel does not take is copied into the queue.
  void writeThenSignal(int peer, const WriteRegion* regions, int n, size_t flag_offset,
                       uint64_t value) override;
  bool directCapable(int) const override { return false; }
  void poll() override;
  // With one tcp peer, poll() looks at the listener every kListenerPasses passes only; the
  // owner calls this every few milliseconds so that strangers are turned away as promptly
  // when the passes are slow (an idle proxy sleeps between them). Same thread as poll().
  void serviceListener();

  // What happened to peers, for the owner (the proxy thread): fatal -> poison the group;
  // otherwise the peer left (ops stuck on it should fail).
  struct Event {
    int peer;
    bool fatal;
    bool goodbye;  // the peer shut its group down in order (it said goodbye first)
    std::string reason;
    bool unreachable = false;  // it stopped answering (its host or the network down, or hung)
  };
  bool hasEvents() const { return !events_.empty(); }
  std::vector<Event> takeEvents();
  // True once after poll() or write() took in bytes: the proxy stays hot while data flows
  // (a receiver's inbox fills only through the proxy).
  bool takeActivity() {
    const bool a = activity_;
    activity_ = false;
    return a;
  }

  // Any thread: a proxy waiting for buffer room gives up (the group is going away).
  void abort() { abort_.store(true, std::memory_order_release); }
  // Sends goodbyes (best effort, bounded), closes every socket. Not concurrent with the
  // proxy. Idempotent.
  void shutdown();

  bool connected(int peer) const;
  std::string peerState(int peer) const override;
  // How errors name ranks (index: group rank), e.g. "rank 5 (group rank 1)"; default "rank r".
  void setRankNames(std::vector<std::string> names);
  uint64_t rejectedConnections() const { return rejected_; }

 private:
  static constexpr uint64_t kListenerTag = ~0ull;  // epoll tag of the listener
  static constexpr size_t kStagingBytes = size_t{64} * 1024;
  // What one read between frames asks for: headers and small frames, a few at once; a larger
  // payload then goes from the socket straight into the segment (kDirectRecvMin).
  static constexpr size_t kStagingRecvBytes = 4096;
  // With one tcp peer, the passes between two looks at the listener (poll()).
  static constexpr uint32_t kListenerPasses = 256;
  // The listener's events (a stranger connecting), the peers' with epoll, pending handshakes.
  void pollEpollSet();
  enum class ConnState { kNone, kIdle, kConnecting, kAwaitAck, kOpen, kClosed };
  struct Conn {
    UniqueFd fd;
    ConnState state = ConnState::kNone;
    tcp::OutQueue out;
    tcp::FrameReader reader;
    // Set-up of an outgoing connection.
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    std::string endpoint;
    uint64_t retry_at = 0;
    size_t ack_have = 0;
    unsigned char ack[sizeof(tcp::HelloAck)] = {0};
    std::string last_error;
  };
  struct Pending {  // an accepted connection that has not completed its hello
    UniqueFd fd;
    std::string from;
    uint64_t deadline = 0;
    size_t have = 0;
    unsigned char hello[sizeof(tcp::Hello)] = {0};
  };

  void appendFrame(int peer, const tcp::FrameHeader& h, const void* payload, size_t bytes);
  bool append(Conn& c, int peer, const void* data, size_t n);
  bool makeRoom(Conn& c, int peer, size_t want);
  void flush(Conn& c, int peer);
  void receiveFrom(int peer);
  void receiveAll();
  void acceptNew(uint64_t deadline);
  // True when the pending connection is finished with (adopted or rejected).
  bool servicePending(Pending& p, bool setting_up);
  void reject(Pending& p, const std::string& reason);
  void startConnect(int peer, uint64_t now);
  void advanceConnect(int peer, short revents, uint64_t now);
  void retryLater(int peer, const std::string& why, uint64_t now);
  void drop(int peer, bool fatal, const std::string& reason, bool unreachable = false);
  // The connection from `peer` failed with `how` (errno `err`, 0 for none).
  void lost(int peer, const char* how, int err = 0);
  // Applies `bytes` received into staging_ to the peer's frame reader; false when that
  // dropped the connection (a malformed frame, or the peer's goodbye).
  bool applyStaged(Conn& c, int peer, size_t bytes);
  // Whether [p, p + bytes) lies in the registered source (sent by reference, not copied).
  bool inSource(const void* p, size_t bytes) const {
    const auto* b = static_cast<const unsigned char*>(p);
    return b >= source_ && b + bytes <= source_ + source_bytes_;
  }
  std::string rankText(int r) const;

  const int rank_, nranks_;
  unsigned char* const segment_;
  const size_t segment_bytes_;
  const TcpOptions opts_;
  tcp::Secret secret_;
  std::vector<bool> expected_;  // tcp peers
  std::vector<Conn> conns_;
  std::vector<Pending> pending_;
  std::vector<unsigned char> staging_;
  std::vector<pollfd> wait_fds_;
  UniqueFd listener_, epoll_;
  std::string endpoint_;
  bool established_ = false;
  bool activity_ = false;
  int only_peer_ = -1;   // the one tcp peer, read directly on each pass; -1: epoll
  uint32_t passes_ = 0;  // poll() calls, with only_peer_
  bool shut_down_ = false;
  std::atomic<bool> abort_{false};
  std::vector<Event> events_;
  uint64_t rejected_ = 0;
  std::vector<std::string> names_;
  std::unique_ptr<ProxyTrace> trace_;      // RESIDENT_GPU_PROXY_TRACE only
  const unsigned char* source_ = nullptr;  // registerSource
  size_t source_bytes_ = 0;
};

}  // namespace resident
