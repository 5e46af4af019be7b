// A communicator installs everything once — the inbox segment, peers' mappings, channels, the
// trigger FIFO, the progress engine and the resident proxy thread — so that starting an op
// only fills in a pooled op and writes data plus a flag. Torch-free: pointers and byte counts.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/bootstrap.hpp"
#include "core/config.hpp"
#include "core/engine.hpp"
#include "core/gpu_layout.hpp"
#include "core/layout.hpp"
#include "core/peer_monitor.hpp"
#include "core/proxy/fifo.hpp"
#include "core/proxy/proxy.hpp"
#include "core/shm_segment.hpp"
#include "core/transport/shm_transport.hpp"
#include "core/transport/tcp_transport.hpp"
#include "core/transport/transport.hpp"

namespace resident {
namespace ib {
class IbTransport;
}
}  // namespace resident

namespace resident {

// The group's health as torch's Backend::getError reports it (c10d::ErrorType): kTimeout, this
// rank gave up waiting; kRemote, a peer died, or its group or connection failed (noticed even
// between ops); kComm, any other failure. A group shut down while healthy stays kNone.
enum class GroupError : uint8_t { kNone, kTimeout, kComm, kRemote };

class Communicator : public ProxyHandler {
 public:
  // `global_ranks[r]`: the global rank of group rank r, for messages (empty: the same).
  Communicator(BootstrapStore& store, int rank, int nranks, const Config& cfg, uint64_t timeout_ms,
               std::vector<int> global_ranks = {});
  ~Communicator() override;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Stops the proxy, fails ops still in flight, unmaps segments. Idempotent.
  void shutdown();
  // Any thread, any time (a lock-free read of the engine's state).
  GroupError error() const;

  // Collectives. Counts are elements of `dtype`; byte counts are bytes. Per-rank pointer
  // arrays have nranks entries. All return at once; completion through engine().
  OpHandle allReduce(const void* in, void* out, size_t count, DType dtype, RedOp op);
  OpHandle reduceScatter(const void* in, void* out, size_t count_per_rank, DType dtype, RedOp op);
  // List form: inputs[r] is the block for rank r.
  OpHandle reduceScatterV(const void* const* inputs, void* out, size_t count, DType dtype,
                          RedOp op);
  OpHandle reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, int root);
  OpHandle allGather(const void* in, void* const* outs, size_t bytes);
  OpHandle gather(const void* in, void* const* outs, size_t bytes, int root);
  OpHandle scatter(const void* const* ins, void* out, size_t bytes, int root);
  OpHandle allToAll(const void* const* ins, const size_t* in_bytes, void* const* outs,
                    const size_t* out_bytes);
  OpHandle broadcast(void* buf, size_t bytes, int root);
  OpHandle barrier();
  // Host-side barrier that reports the ranks that did not arrive within `timeout_ms` (rank 0
  // waits for each; with `wait_all_ranks` it names them all, otherwise the first). Blocking;
  // throws CommError / TimeoutError with torch's monitored_barrier texts
  // (csrc/core/monitored_barrier.cpp).
  void monitoredBarrier(uint64_t timeout_ms, bool wait_all_ranks);
  OpHandle send(const void* buf, size_t bytes, int peer, uint64_t tag);
  OpHandle recv(void* buf, size_t bytes, int peer, uint64_t tag);
  // Receives the oldest matching message with `tag` from whichever peer sends one first; the
  // sender is the op's `peer` once it finished (sourceOf).
  OpHandle recvAnySource(void* buf, size_t bytes, uint64_t tag);
  // The sender a finished recv took its message from (-1 while a recv from any source waits).
  static int sourceOf(OpHandle h) { return h.op->peer; }

  Engine& engine() { return *engine_; }
  int rank() const { return rank_; }
  int size() const { return nranks_; }
  const Config& config() const { return cfg_; }
  // "shm" / "tcp" / "self", and "direct" / "proxy", for introspection and logs.
  std::string transportFor(int peer) const;
  std::string pathFor(int peer) const;
  int proxyCpu() const { return proxy_ ? proxy_->boundCpu() : -1; }
  // "address:port" this rank's tcp peers connect to; empty without tcp peers.
  std::string tcpEndpoint() const;
  // How messages name group rank `p` ("rank 5", or "rank 5 (group rank 1)" in a subgroup).
  std::string rankName(int p) const {
    return p >= 0 && p < nranks_ ? peers_[static_cast<size_t>(p)].name
                                 : "rank " + std::to_string(p);
  }

  bool proxyPoll() override;
  bool proxyStandby() const override;
  void proxyMark() override;
  void standbyTick() override;

  // Argument checks shared by the CPU and CUDA paths; throw InvalidArgument naming `what`.
  void checkRank(int r, const char* what) const;
  void checkReduction(DType dtype, RedOp op, const char* what) const;

  // For the CUDA path (csrc/cuda), which installs itself on top of this communicator.
  const GpuLayout& gpuLayout() const { return gpu_layout_; }
  // This rank's segment (base, bytes) and the GPU region's offset in every rank's segment.
  unsigned char* segmentBase() const { return static_cast<unsigned char*>(inbox_.data()); }
  size_t segmentBytes() const { return inbox_.size(); }
  size_t gpuRegionOffset() const { return gpu_region_offset_; }
  // A same-host peer's segment mapped here (nullptr otherwise) and its size.
  unsigned char* peerSegment(int p) const {
    return static_cast<unsigned char*>(peer_inboxes_[static_cast<size_t>(p)].data());
  }
  size_t peerSegmentBytes(int p) const { return peer_inboxes_[static_cast<size_t>(p)].size(); }
  bool proxied(int p) const { return proxied_[static_cast<size_t>(p)]; }
  // Either rank of the pair writes to the other through its proxy (RESIDENT_PATH may differ
  // between them): the CUDA path then picks the pair's protocol by the proxied rule, on both.
  bool pairProxied(int p) const {
    return proxied_[static_cast<size_t>(p)] || peer_proxies_[static_cast<size_t>(p)];
  }
  bool sameHost(int p) const { return p == rank_ || peers_[static_cast<size_t>(p)].same_host; }
  Transport& transport() { return *transport_; }
  // Index of this rank among the ranks on its host (to spread proxies over cores).
  int localIndex() const;
  // A second poller the proxy runs on every pass (the GPU trigger ring). Removing it
  // (nullptr) returns only once the proxy is outside the old poller's proxyPoll.
  void setExtraPoller(ProxyHandler* poller);
  // The transport's registered source goes away (Transport::releaseSource), with passes held off.
  void releaseSource();
  Proxy* proxy() { return proxy_.get(); }

 private:
  void install(BootstrapStore& store, uint64_t timeout_ms);  // segments, peers, engine
  // Per peer: "shm", "tcp" (or "self"), from the descriptors all ranks exchanged.
  void chooseTransports();
  void selectEngineTransport();  // transport_ from kinds_: one transport, or a router
  void connectTcp(BootstrapStore& store, const std::vector<std::string>& endpoints, bool group_tcp,
                  uint64_t timeout_ms);
  void deliverTcpEvents();
  // Peers gone (core/peer_monitor.hpp, tcp's closed connections): the ops that still need one
  // fail (Engine::markPeerLost). Proxy pass only.
  void checkPeers();
  // Engine::markPeerLost, and for a peer that left in order its bit in the GPU region's
  // kPeersLeftWord: a CUDA kernel still waiting for something from it gives up. Everything the
  // peer sent came before its state word (on its connection, or into the segment), so it has
  // landed by now.
  void peerLost(int peer, const std::string& why, bool failed);
  void peerFailed(int dead, const std::string& reason, bool unreachable);
  void noteDead(int dead, bool unreachable);
  // Writes this rank's state word into every peer's inbox (kPeerStateLeft or failedState()).
  void tellPeers(uint64_t state);
  uint64_t failedState() const;
  // ib (csrc/core/transport/ib/ib_connect.cpp): queue pairs to the peers whose transport is "ib".
  void connectIb(BootstrapStore& store);
  bool proxyPass();  // one proxy pass; proxyPoll turns a transport's CommError into poison

  const int rank_, nranks_;
  Config cfg_;  // as given, but for gpu_chunk_bytes: 0 (automatic) resolved by install()
  const std::vector<int> global_ranks_;
  const InboxLayout layout_;
  ShmSegment inbox_;
  std::vector<ShmSegment> peer_inboxes_;
  std::vector<PeerInfo> peers_;
  std::vector<bool> proxied_;
  std::vector<std::string> kinds_;  // transport per peer
  std::unique_ptr<ShmTransport> shm_;
  std::unique_ptr<TcpTransport> tcp_;
  std::unique_ptr<ib::IbTransport> ib_;
  std::vector<bool> peer_ib_;       // peer has an active RDMA port (from its descriptor)
  std::vector<bool> peer_proxies_;  // peer runs RESIDENT_PATH=proxy (from its descriptor)
  bool transport_failed_ = false;   // proxy thread only
  std::unique_ptr<PeerMonitor> monitor_;
  std::vector<PeerMonitor::Event> peer_events_;  // reused by checkPeers
  uint64_t next_peer_check_ns_ = 0;
  int dead_rank_ = -1;             // the peer found dead that failed this group, if one did
  bool dead_unreachable_ = false;  // that peer stopped answering over the network
  bool peers_told_ = false;        // this rank's state word went out
  // Proxy passes run under this lock, by the proxy thread or by a caller waiting on an op
  // (assistPass): with proxied peers a blocking op then needs no hand-off between threads, and on
  // a small machine the proxy stands by instead of contending with the caller for a core.
  std::atomic_flag pass_lock_ = ATOMIC_FLAG_INIT;
  bool passes_closed_ = false;  // under pass_lock_: set by shutdown
  bool assist_ = false;         // some peer is proxied: waiting callers run passes
  // The host's ranks, two threads each, outnumber its usable cpus: the proxy also stands by
  // while no op is in flight, and in a group without proxied peers while callers drive their
  // ops (proxyStandby).
  bool idle_standby_ = false;
  // The trigger FIFO's consumption at the proxy's last pass or sleep (proxyMark; proxy thread).
  uint64_t standby_fifo_consumed_ = ~uint64_t{0};
  static bool assistPass(void* self);
  static void waitersGone(void* self);
  bool ib_local_ = false;              // this rank has an active RDMA port
  std::string ib_why_;                 // why this rank has no usable ib, for errors and logs
  std::unique_ptr<Transport> routed_;  // when peers use different transports
  Transport* transport_ = nullptr;     // what the engine and the proxy use
  std::unique_ptr<TriggerFifo> fifo_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Proxy> proxy_;
  bool shut_down_ = false;
  std::atomic<bool> closed_healthy_{false};  // shut down before any failure (error())
  GpuLayout gpu_layout_;
  size_t gpu_region_offset_ = 0;
  std::atomic<ProxyHandler*> extra_poller_{nullptr};
  std::atomic<bool> extra_busy_{false};
  std::vector<unsigned char> monitored_scratch_;  // monitoredBarrier's message bytes
};

// Identifies this host and shared-memory domain: peers with equal keys can map each other's
// segments. hostname + boot id + mount namespace + network namespace (ranks in different
// network namespaces count as different hosts).
std::string localHostKey();

}  // namespace resident
