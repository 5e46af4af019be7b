#include "core/communicator.hpp"

#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cstdlib>

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/first_line.hpp"
#include "core/group_descriptor.hpp"
#include "core/host_cpus.hpp"
#include "core/log.hpp"
#include "core/peer_monitor.hpp"
#include "core/process_state.hpp"
#include "core/transport/ib/ib_caps.hpp"
#include "core/transport/ib/ib_transport.hpp"
#include "core/transport/routed_transport.hpp"
#include "core/transport/shm_transport.hpp"

namespace resident {
namespace {

constexpr uint32_t kFifoCapacity = 4096;
// How often the proxy looks for peers that are gone (a poll() over pidfds, a load per peer).
constexpr uint64_t kPeerCheckPeriodNs = 5ull * 1000 * 1000;

}  // namespace

std::string localHostKey() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::string boot = readFirstLine("/proc/sys/kernel/random/boot_id");
  struct stat st;
  const unsigned long mnt = stat("/proc/self/ns/mnt", &st) == 0 ? st.st_ino : 0;
  const unsigned long net = stat("/proc/self/ns/net", &st) == 0 ? st.st_ino : 0;
  return std::string(host) + "/" + boot + "/" + std::to_string(mnt) + "/" + std::to_string(net);
}

Communicator::Communicator(BootstrapStore& store, int rank, int nranks, const Config& cfg,
                           uint64_t timeout_ms, std::vector<int> global_ranks)
    : rank_(rank),
      nranks_(nranks),
      cfg_(cfg),
      global_ranks_(global_ranks.size() == static_cast<size_t>(nranks) ? std::move(global_ranks)
                                                                       : std::vector<int>{}),
      layout_(nranks, cfg.slots, cfg.slot_bytes) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw InvalidArgument("resident: invalid rank " + std::to_string(rank) + " of " +
                          std::to_string(nranks));
  }
  try {
    install(store, timeout_ms);
  } catch (...) {
    // A peer killed during set-up may have left its segment's name behind: remove names of
    // dead creators now rather than at the next group creation.
    inbox_ = ShmSegment();
    ShmSegment::removeStale();
    throw;
  }
  for (int p = 0; p < nranks; ++p) assist_ = assist_ || proxied_[static_cast<size_t>(p)];
  if (assist_) engine_->setAssist(&Communicator::assistPass, this);
  int local_ranks = 0;
  for (int p = 0; p < nranks; ++p) local_ranks += sameHost(p) ? 1 : 0;
  const int cpus = usableCpus();
  idle_standby_ = 2 * local_ranks > cpus;
  // More ranks than cores: a waiting caller's peer may be off its core, and a hot poll only
  // keeps it off longer; the waiter yields at once instead (2 cores, 8 B all_reduce: 3 ranks
  // over shm 11-13 us per op against 63-65 us with the 50 us poll, 4 ranks 20-28 against 65-79;
  // docs/decisions.md).
  if (local_ranks > cpus && !cfg.spin_us_given) {
    engine_->setWaitSpinUs(0);
    RLOG_INFO("%d ranks on this host, %d usable cpus: a thread waiting on an op yields at once",
              local_ranks, cpus);
  }
  if (idle_standby_)
    RLOG_INFO(
        "%d ranks on this host, %d usable cpus: the proxy stands by while no op of this "
        "group is in flight%s",
        local_ranks, cpus, assist_ ? "" : " or callers drive theirs");
  proxy_ = std::make_unique<Proxy>(*this, cfg);
  proxy_->start();
  if (assist_) engine_->setWaitersGone(&Communicator::waitersGone, this);
  for (int p = 0; p < nranks; ++p) {
    if (p != rank)
      RLOG_INFO("rank %d -> rank %d: transport %s, path %s", rank, p, transportFor(p).c_str(),
                pathFor(p).c_str());
  }
  RLOG_INFO("communicator rank %d/%d ready: %s", rank, nranks, cfg.describe().c_str());
}

void Communicator::install(BootstrapStore& store, uint64_t timeout_ms) {
  const int rank = rank_;
  const int nranks = nranks_;
  const Config& cfg = cfg_;
  const std::string host_key = localHostKey();
  ShmSegment::removeStale();
  // The GPU region follows the CPU rings, page-aligned, when this process can use CUDA.
  gpu_region_offset_ = (layout_.totalBytes() + 4095) & ~size_t{4095};
  auto segmentBytes = [&](uint32_t chunk) {
    return cfg.gpu_region ? gpu_region_offset_ + GpuLayout(nranks, chunk).totalBytes()
                          : layout_.totalBytes();
  };
  // The automatic chunk (gpu_chunk_bytes 0) depends on whether a pair of the group talks over a
  // network, which the ranks' hosts tell. The segment is made first for the host chunk, and made
  // again at the chunk resolved if that changes its size (no peer knows its name yet). Every
  // rank takes part in the exchange whatever its settings, so that ranks that differ fail at the
  // descriptor check below, which names the setting.
  inbox_ = ShmSegment::create(
      segmentBytes(cfg.gpu_chunk_bytes ? cfg.gpu_chunk_bytes : GpuLayout::kHostChunk));
  // Each rank's host key and pid, before its descriptor: the pids let the descriptor exchange
  // notice a same-host peer that dies before it has posted its descriptor.
  const auto hosts = allGatherStrings(store, rank, nranks, "resident/hosts",
                                      host_key + "|" + std::to_string(getpid()));
  peers_.resize(static_cast<size_t>(nranks));
  const std::string key0 = hosts[0].substr(0, hosts[0].rfind('|'));
  bool spans_hosts = false;
  for (int p = 0; p < nranks; ++p) {
    const std::string& h = hosts[static_cast<size_t>(p)];
    const size_t bar = h.rfind('|');  // host key|pid
    const std::string key = h.substr(0, bar);
    PeerInfo& info = peers_[static_cast<size_t>(p)];
    info.host = key.substr(0, key.find('/'));
    info.pid = std::atoi(h.c_str() + bar + 1);
    info.same_host = key == host_key;
    info.name =
        resident::rankName(p, global_ranks_.empty() ? -1 : global_ranks_[static_cast<size_t>(p)]);
    spans_hosts = spans_hosts || key != key0;
  }
  auto exitedDuringCreation = [&](int p) {
    const PeerInfo& info = peers_[static_cast<size_t>(p)];
    return CommError("resident: " + info.name + " (pid " + std::to_string(info.pid) + " on " +
                     info.host +
                     ") exited during process group creation (it crashed or was killed); rank " +
                     std::to_string(rank) + " stopped waiting for it");
  };
  auto exitedBeforeItsDescriptor = [&](int p) {
    const PeerInfo& info = peers_[static_cast<size_t>(p)];
    if (info.same_host && processHasExited(info.pid)) throw exitedDuringCreation(p);
  };
  if (cfg.gpu_chunk_bytes == 0) {
    const bool network =
        cfg.transport == "tcp" || cfg.transport == "ib" || (cfg.transport == "auto" && spans_hosts);
    cfg_.gpu_chunk_bytes = GpuLayout::automaticChunk(network, nranks);
  }
  gpu_layout_ = GpuLayout(nranks, cfg.gpu_chunk_bytes);
  const size_t segment_bytes = segmentBytes(cfg.gpu_chunk_bytes);
  if (segment_bytes != inbox_.size()) inbox_ = ShmSegment::create(segment_bytes);
  auto* header = static_cast<InboxHeader*>(inbox_.data());
  header->magic = kInboxMagic;
  header->nranks = static_cast<uint32_t>(nranks);
  header->slots = cfg.slots;
  header->slot_bytes = cfg.slot_bytes;
  header->owner_rank = static_cast<uint32_t>(rank);
  // Listen before the exchange so that the endpoint travels in the descriptor; the listener
  // goes again at once if no peer needs tcp.
  if (cfg.transport != "shm") {
    TcpOptions opts;
    opts.bind_addr = cfg.tcp_addr;
    opts.rendezvous_host = store.rendezvousHost();
    opts.stall_timeout_ns = timeout_ms * 1000000ull;
    opts.unreachable_timeout_ns = std::min(opts.stall_timeout_ns, opts.unreachable_timeout_ns);
    opts.trace_prefix = cfg.gpu_proxy_trace;
    tcp_ = std::make_unique<TcpTransport>(rank, nranks, static_cast<unsigned char*>(inbox_.data()),
                                          segment_bytes, opts);
  }

  // An active RDMA port here? (libibverbs is loaded at run time; none on most machines.)
  ib_local_ = (cfg.transport == "auto" || cfg.transport == "ib") && ib::ibAvailable(&ib_why_);
  if (!ib_local_ && ib_why_.empty()) ib_why_ = "RESIDENT_TRANSPORT=" + cfg.transport;
  peer_ib_.assign(static_cast<size_t>(nranks), false);
  peer_proxies_.assign(static_cast<size_t>(nranks), false);

  // One descriptor exchange: where each rank's inbox is, how to reach it, and the settings
  // every rank must share (core/group_descriptor.hpp).
  const GroupDescriptor mine = localDescriptor(
      cfg, inbox_.name(), segment_bytes, tcp_ ? tcp_->endpoint() : std::string("-"), ib_local_);
  const auto all = allGatherStrings(store, rank, nranks, "resident/desc", encodeDescriptor(mine),
                                    timeout_ms * 1000000ull, exitedBeforeItsDescriptor);

  peer_inboxes_.resize(static_cast<size_t>(nranks));
  std::vector<GroupDescriptor> descs(static_cast<size_t>(nranks));
  std::vector<std::string> endpoints(static_cast<size_t>(nranks));
  const bool group_tcp = cfg.transport == "tcp" || spans_hosts;  // a pair talks over tcp?
  for (int p = 0; p < nranks; ++p) {
    GroupDescriptor& d = descs[static_cast<size_t>(p)];
    d = decodeDescriptor(all[static_cast<size_t>(p)], p);
    checkSharedSettings(mine, rank, d, p);
    endpoints[static_cast<size_t>(p)] = d.tcp_endpoint;
    peer_ib_[static_cast<size_t>(p)] = d.ib;
    peer_proxies_[static_cast<size_t>(p)] = d.path == pathModeName(PathMode::kProxy);
  }
  chooseTransports();
  if (tcp_) {
    std::vector<std::string> names;
    for (const PeerInfo& info : peers_) names.push_back(info.name);
    tcp_->setRankNames(std::move(names));
  }
  // From here on a same-host peer that dies is noticed, before this rank maps its segment or
  // waits for it.
  monitor_ = std::make_unique<PeerMonitor>(
      rank, peers_, static_cast<const unsigned char*>(inbox_.data()), layout_);
  auto alive = [&](int p) {
    if (monitor_->exited(p)) throw exitedDuringCreation(p);
  };
  for (int p = 0; p < nranks; ++p)
    if (p != rank) alive(p);
  std::vector<unsigned char*> bases(static_cast<size_t>(nranks), nullptr);
  for (int p = 0; p < nranks; ++p) {
    if (kinds_[static_cast<size_t>(p)] != "shm") continue;
    const GroupDescriptor& d = descs[static_cast<size_t>(p)];
    try {
      peer_inboxes_[static_cast<size_t>(p)] = ShmSegment::open(d.inbox, d.inbox_bytes);
    } catch (const CommError& e) {
      const PeerInfo& info = peers_[static_cast<size_t>(p)];
      throw CommError(std::string(e.what()) + " (the inbox of " + info.name + ", pid " +
                      std::to_string(info.pid) +
                      (processHasExited(info.pid) ? ", which has exited: it crashed or was killed "
                                                    "during process group creation)"
                                                  : ")"));
    }
    bases[static_cast<size_t>(p)] =
        static_cast<unsigned char*>(peer_inboxes_[static_cast<size_t>(p)].data());
  }
  // Everyone has mapped everyone: names can go, so nothing outlives a crash in /dev/shm.
  allGatherStrings(store, rank, nranks, "resident/mapped", "1", timeout_ms * 1000000ull, alive);
  inbox_.unlinkName();
  shm_ = std::make_unique<ShmTransport>(bases);
  connectTcp(store, endpoints, group_tcp, timeout_ms);
  connectIb(store);

  selectEngineTransport();
  proxied_.assign(static_cast<size_t>(nranks), false);
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    const bool direct_ok = transport_->directCapable(p);
    if (cfg.path == PathMode::kDirect && !direct_ok) {
      throw InvalidArgument("resident: RESIDENT_PATH=direct but rank " + std::to_string(p) +
                            " is not reachable by direct stores");
    }
    proxied_[static_cast<size_t>(p)] = cfg.path == PathMode::kProxy || !direct_ok;
  }
  fifo_ = std::make_unique<TriggerFifo>(kFifoCapacity);
  engine_ = std::make_unique<Engine>(rank, nranks, cfg, layout_,
                                     static_cast<unsigned char*>(inbox_.data()), transport_, peers_,
                                     proxied_, fifo_.get(), timeout_ms * 1000000ull);
}

// One transport for the engine: the only kind in use, or a router when kinds mix.
void Communicator::selectEngineTransport() {
  const int nranks = nranks_;
  std::vector<Transport*> by_peer(static_cast<size_t>(nranks), nullptr);
  bool any_shm = false, any_tcp = false, any_ib = false;
  for (int p = 0; p < nranks; ++p) {
    const std::string& kind = kinds_[static_cast<size_t>(p)];
    if (kind == "shm") {
      by_peer[static_cast<size_t>(p)] = shm_.get();
      any_shm = true;
    } else if (kind == "tcp") {
      by_peer[static_cast<size_t>(p)] = tcp_.get();
      any_tcp = true;
    } else if (kind == "ib") {
      by_peer[static_cast<size_t>(p)] = ib_.get();
      any_ib = true;
    } else if (kind != "self") {
      throw CommError("resident: rank " + std::to_string(p) + " needs the " + kind +
                      " transport, which this build does not have");
    }
  }
  std::vector<Transport*> polled;
  if (any_tcp) polled.push_back(tcp_.get());
  if (any_ib) polled.push_back(ib_.get());
  if (static_cast<int>(any_shm) + static_cast<int>(any_tcp) + static_cast<int>(any_ib) > 1) {
    routed_ = std::make_unique<RoutedTransport>(by_peer, polled);
    transport_ = routed_.get();
  } else if (any_tcp) {
    transport_ = tcp_.get();
  } else if (any_ib) {
    transport_ = ib_.get();
  } else {
    transport_ = shm_.get();
  }
}

void Communicator::chooseTransports() {
  kinds_.assign(static_cast<size_t>(nranks_), "self");
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    const PeerInfo& info = peers_[static_cast<size_t>(p)];
    std::string& kind = kinds_[static_cast<size_t>(p)];
    const bool both_ib = ib_local_ && peer_ib_[static_cast<size_t>(p)];
    if (cfg_.transport == "tcp") {
      kind = "tcp";  // forced, even on one host (tests, or to measure the network path)
    } else if (cfg_.transport == "ib") {
      // Forced, even on one host; needs an active RDMA port on both ends (every rank sees
      // the same descriptors, so a refusal happens on both ends of the pair).
      if (!both_ib) {
        throw InvalidArgument("resident: RESIDENT_TRANSPORT=ib but " +
                              (ib_local_ ? "rank " + std::to_string(p) + " has no usable RDMA port"
                                         : "this rank has none: " + ib_why_));
      }
      kind = "ib";
    } else if (info.same_host) {
      kind = "shm";
    } else if (cfg_.transport == "shm") {
      throw CommError("resident: rank " + std::to_string(p) + " runs on host " + info.host +
                      ", which does not share memory with rank " + std::to_string(rank_) +
                      "; RESIDENT_TRANSPORT=shm serves same-host peers only (auto picks ib or "
                      "tcp for the others)");
    } else {
      kind = both_ib ? "ib" : "tcp";  // ib when both ends have an active RDMA port
    }
  }
}

void Communicator::connectTcp(BootstrapStore& store, const std::vector<std::string>& endpoints,
                              bool group_tcp, uint64_t timeout_ms) {
  constexpr const char* kSecretKey = "resident/tcp_secret";
  std::vector<bool> tcp_peer(static_cast<size_t>(nranks_), false);
  bool any = false;
  for (int p = 0; p < nranks_; ++p) {
    tcp_peer[static_cast<size_t>(p)] = kinds_[static_cast<size_t>(p)] == "tcp";
    any = any || tcp_peer[static_cast<size_t>(p)];
  }
  // Rank 0 makes the group's secret whenever some pair of ranks talks over tcp.
  tcp::Secret secret;
  if (rank_ == 0 && group_tcp && tcp_) {
    secret = tcp::Secret::random();
    store.set(kSecretKey, secret.hex());
  }
  if (!any) {
    tcp_.reset();  // nobody to talk to: no listener for the group's life
    return;
  }
  if (rank_ != 0) secret = tcp::Secret::fromHex(store.get(kSecretKey));
  tcp_->establish(endpoints, tcp_peer, secret, timeout_ms * 1000000ull);
}

void Communicator::deliverTcpEvents() {
  // A peer's state word (its group failed) travels before its goodbye on the same connection:
  // read the state words first, so that a failed peer is not taken for one that left in order.
  checkPeers();
  for (const auto& e : tcp_->takeEvents()) {
    if (e.fatal) {
      peerFailed(e.peer, e.reason, e.unreachable);  // what it wrote may be torn: the group stops
    } else {
      if (!e.goodbye) noteDead(e.peer, e.unreachable);
      peerLost(e.peer, e.reason, !e.goodbye);
    }
  }
}

void Communicator::noteDead(int dead, bool unreachable) {
  if (dead_rank_ >= 0) return;  // the first one found is what the peers are told
  dead_rank_ = dead;
  dead_unreachable_ = unreachable;
}

void Communicator::peerFailed(int dead, const std::string& reason, bool unreachable) {
  if (!engine_->poisoned()) noteDead(dead, unreachable);
  engine_->markPeerLost(dead, reason, true);  // a remote failure (error(): kRemote)
  engine_->poison(reason);
}

void Communicator::checkPeers() {
  peer_events_.clear();
  monitor_->poll(peer_events_);
  for (const auto& e : peer_events_) {
    if (e.failed && e.dead >= 0) noteDead(e.dead, e.unreachable);
    peerLost(e.peer, e.reason, e.failed);
  }
}

void Communicator::peerLost(int peer, const std::string& why, bool failed) {
  engine_->markPeerLost(peer, why, failed);
  // A failed peer aborts the kernels instead.
  if (failed || !cfg_.gpu_region || peer >= GpuLayout::kPeersLeftBits) return;
  auto* left =
      reinterpret_cast<uint64_t*>(segmentBase() + gpu_region_offset_ + GpuLayout::kPeersLeftWord);
  __atomic_fetch_or(left, uint64_t{1} << peer, __ATOMIC_RELEASE);
}

void Communicator::tellPeers(uint64_t state) {
  peers_told_ = true;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    try {
      transport_->signal(p, layout_.peerStateOffset(rank_), state);
    } catch (const CommError& e) {
      RLOG_INFO("rank %d: could not tell rank %d that this group stopped: %s", rank_, p, e.what());
    }
  }
}

Communicator::~Communicator() {
  shutdown();
}

void Communicator::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (tcp_) tcp_->abort();  // a proxy waiting for a peer to take data gives up
  if (proxy_) proxy_->stop();
  // No pass runs after this one (a waiting caller may be inside one): the transports are ours.
  while (pass_lock_.test_and_set(std::memory_order_acquire)) cpuRelax();
  passes_closed_ = true;
  pass_lock_.clear(std::memory_order_release);
  // The peers learn at once that this group is gone: orderly (destroy) or failed. With the
  // proxy stopped, this thread is the only one using the transport.
  if (engine_ && transport_ && !peers_told_ && !transport_failed_) {
    tellPeers(engine_->poisoned() ? failedState() : kPeerStateLeft);
    if (tcp_) tcp_->poll();
  }
  // The engine (and its op pool) stays until destruction: Works may still hold handles.
  // Poisoned, it never touches the transport or the segments again.
  if (engine_) {
    closed_healthy_.store(!engine_->poisoned() && !engine_->anyPeerFailed());
    engine_->poison("the process group was shut down");
  }
  // The stopped proxy object stays until destruction: a late waiter may still wake it (a no-op).
  if (tcp_) tcp_->shutdown();  // goodbyes to the peers, every socket closed
  ib_.reset();                 // queue pairs, registrations and the verbs context
  peer_inboxes_.clear();
  inbox_ = ShmSegment();
}

GroupError Communicator::error() const {
  if (!engine_ || closed_healthy_.load()) return GroupError::kNone;
  // A timeout of this rank is its own; a peer that failed is the cause of any later failure.
  if (engine_->poisonKind() == ErrorKind::kTimeout) return GroupError::kTimeout;
  if (engine_->anyPeerFailed()) return GroupError::kRemote;
  return engine_->poisoned() ? GroupError::kComm : GroupError::kNone;
}

bool Communicator::proxyPoll() {
  // One thread at a time: the proxy thread, or a caller waiting on its op (assist).
  if (pass_lock_.test_and_set(std::memory_order_acquire)) return false;
  bool moved = false;
  // A network transport that fails (a post or completion error) throws CommError: the group
  // is then unusable, and its ops fail with the reason instead of the process terminating.
  try {
    if (!passes_closed_) moved = proxyPass();
  } catch (const std::exception& e) {
    // CommError, or anything else a pass throws: thrown on, it would leave pass_lock_ set and
    // no pass would run again.
    if (!transport_failed_) RLOG_ERROR("%s", e.what());
    transport_failed_ = true;  // the transport stays failed: stop polling it
    engine_->poison(dynamic_cast<const CommError*>(&e) != nullptr
                        ? std::string(e.what())
                        : std::string("resident: internal error in a proxy pass: ") + e.what());
  }
  pass_lock_.clear(std::memory_order_release);
  return moved;
}

bool Communicator::proxyStandby() const {
  if (assist_ && engine_->hasWaiters()) return true;  // they run the passes
  // Otherwise only where the host's ranks have fewer cores than callers and proxies, and no GPU
  // path polls through this proxy: a wake-up takes the core of a caller.
  if (!idle_standby_ || extra_poller_.load(std::memory_order_acquire) != nullptr) return false;
  // No proxied peer: the proxy checks the peers and drives the ops nobody waits on, here after
  // each standby sleep (standbyTick) rather than every 200 us while callers drive their ops or
  // none is in flight (2 ranks on 2 cores, 8 B all_reduce over shm: ~3600 wake-ups a second per
  // proxy without this, and 0.8% of ops over 12 us, ~20% of a loop's time).
  if (!assist_) return engine_->hasWaiters() || !engine_->hasActive();
  // Proxied peers, no op in flight: a pass could only take in a peer's next data early.
  if (engine_->hasActive()) return false;
  // Triggers may wait: the last op's final pass (run by this thread, or by a caller's test or
  // last wait) queues the credits of the chunks it took, which the next op's first pass sends
  // with that op's data, one message. They are left to it while callers consume the FIFO; once
  // it stood still since this thread's last pass or through a whole sleep, this thread sends
  // them: a peer's next send can be waiting for them while this rank waits on that peer in
  // another group.
  return !(fifo_->pending() && fifo_->consumed() == standby_fifo_consumed_);
}

void Communicator::proxyMark() {
  standby_fifo_consumed_ = fifo_->consumed();
}

void Communicator::standbyTick() {
  // Waiting callers run the passes where some peer is proxied, the peer checks among them; with
  // none, or no caller waiting (between ops), nobody else does: one pass per sleep keeps a dead
  // peer found within a sleep or two (getError() reports it between ops).
  if (!assist_ || !engine_->hasWaiters()) proxyPoll();
}

void Communicator::waitersGone(void* self) {
  // The proxy may sleep in standby for up to Proxy::kStandbyLastNs. It is woken where what the
  // waiters drove is its job again at once: a GPU path's triggers, or ops still in flight on a host
  // with a core to spare for it. Where cores are scarce, ops left in flight wait for its next look
  // (at most one standby sleep): a wake-up there takes the core of a caller (CPU tensors over
  // tcp, 2 ranks on 2 cores: an async all_reduce waited on at once took 32-39 us per op with it,
  // 10-11 us without).
  auto* c = static_cast<Communicator*>(self);
  if (c->extra_poller_.load(std::memory_order_acquire) != nullptr ||
      (!c->idle_standby_ && c->engine_->hasActive()))
    c->proxy_->wake();
}

bool Communicator::assistPass(void* self) {
  return static_cast<Communicator*>(self)->proxyPoll();
}

bool Communicator::proxyPass() {
  bool moved = false;
  Trigger t;
  for (int n = 0; n < 64 && fifo_->tryPop(t); ++n) {
    engine_->handleTrigger(t);
    moved = true;
  }
  // seq_cst pair with setExtraPoller: either the remover sees busy, or this load sees null.
  extra_busy_.store(true);
  if (ProxyHandler* extra = extra_poller_.load()) moved |= extra->proxyPoll();
  extra_busy_.store(false);
  if (!transport_failed_) transport_->poll();
  if (tcp_) {
    moved |= tcp_->takeActivity();
    if (tcp_->hasEvents()) deliverTcpEvents();
  }
  // Async ops nobody waits on are driven here, at the proxy's idle pace: a caller blocked
  // in wait() drives its own ops, and two spinning drivers would only contend for the core.
  if (engine_->hasActive() && !engine_->hasWaiters()) engine_->tryProgress();
  const uint64_t now = nowNs();
  if (now >= next_peer_check_ns_) {
    next_peer_check_ns_ = now + kPeerCheckPeriodNs;
    checkPeers();
    if (tcp_ && !transport_failed_) tcp_->serviceListener();
  }
  // A failed group tells its peers, so that they stop now instead of at their timeout.
  if (!peers_told_ && engine_->poisoned() && !transport_failed_) {
    tellPeers(failedState());
    moved = true;
  }
  return moved;
}

uint64_t Communicator::failedState() const {
  const int left = engine_->leftPeerNeeded();
  if (dead_rank_ < 0 && left >= 0)
    return kPeerStateFailed | (static_cast<uint64_t>(left + 1) << 8) | kPeerStateCauseLeft;
  return kPeerStateFailed | (static_cast<uint64_t>(dead_rank_ + 1) << 8) |
         (dead_unreachable_ ? kPeerStateUnreachable : 0);
}

void Communicator::setExtraPoller(ProxyHandler* poller) {
  extra_poller_.store(poller);
  if (poller != nullptr && proxy_) proxy_->wake();  // it polls through the proxy from now on
  if (poller == nullptr)
    while (extra_busy_.load()) cpuRelax();
}

void Communicator::releaseSource() {
  while (pass_lock_.test_and_set(std::memory_order_acquire)) cpuRelax();
  if (!passes_closed_ && !transport_failed_) transport_->releaseSource();
  pass_lock_.clear(std::memory_order_release);
}

int Communicator::localIndex() const {
  int index = 0;
  for (int p = 0; p < rank_; ++p) index += peers_[static_cast<size_t>(p)].same_host ? 1 : 0;
  return index;
}

std::string Communicator::tcpEndpoint() const {
  return tcp_ ? tcp_->endpoint() : std::string();
}

std::string Communicator::transportFor(int peer) const {
  if (peer == rank_) return "self";
  return kinds_.empty() ? "none" : kinds_[static_cast<size_t>(peer)];
}

std::string Communicator::pathFor(int peer) const {
  if (peer == rank_) return "self";
  return proxied_[static_cast<size_t>(peer)] ? "proxy" : "direct";
}

}  // namespace resident
