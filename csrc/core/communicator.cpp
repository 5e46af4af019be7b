#include "core/communicator.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/shm_transport.hpp"

namespace resident {
namespace {

constexpr uint32_t kFifoCapacity = 4096;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t pos; (pos = s.find(sep, start)) != std::string::npos; start = pos + 1)
    out.push_back(s.substr(start, pos - start));
  out.push_back(s.substr(start));
  return out;
}

}  // namespace

std::string localHostKey() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // No iostreams in the core: an extension's libstdc++ stream symbols can clash with the
  // host's (seen with torch 2.11 on the GPU machine).
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) boot = buf;
    std::fclose(f);
    while (!boot.empty() && (boot.back() == '\n' || boot.back() == '\r')) boot.pop_back();
  }
  struct stat st;
  const unsigned long mnt = stat("/proc/self/ns/mnt", &st) == 0 ? st.st_ino : 0;
  return std::string(host) + "/" + boot + "/" + std::to_string(mnt);
}

Communicator::Communicator(BootstrapStore& store, int rank, int nranks, const Config& cfg,
                           uint64_t timeout_ms)
    : rank_(rank),
      nranks_(nranks),
      cfg_(cfg),
      layout_(nranks, cfg.slots, cfg.slot_bytes),
      gpu_layout_(nranks, cfg.gpu_chunk_bytes) {
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
  proxy_ = std::make_unique<Proxy>(*this, cfg);
  proxy_->start();
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
  ShmSegment::removeStale();
  // The GPU region follows the CPU rings, page-aligned, when this process can use CUDA.
  gpu_region_offset_ = (layout_.totalBytes() + 4095) & ~size_t{4095};
  const size_t segment_bytes =
      cfg.gpu_region ? gpu_region_offset_ + gpu_layout_.totalBytes() : layout_.totalBytes();
  inbox_ = ShmSegment::create(segment_bytes);
  auto* header = static_cast<InboxHeader*>(inbox_.data());
  header->magic = kInboxMagic;
  header->nranks = static_cast<uint32_t>(nranks);
  header->slots = cfg.slots;
  header->slot_bytes = cfg.slot_bytes;
  header->owner_rank = static_cast<uint32_t>(rank);

  // One descriptor exchange: host key, pid, inbox name and size.
  const std::string host_key = localHostKey();
  const std::string desc = host_key + "|" + std::to_string(getpid()) + "|" + inbox_.name() + "|" +
                           std::to_string(segment_bytes) + "|" + std::to_string(cfg.slots) + "|" +
                           std::to_string(cfg.slot_bytes);
  const auto all = allGatherStrings(store, rank, nranks, "resident/desc", desc);

  peers_.resize(static_cast<size_t>(nranks));
  peer_inboxes_.resize(static_cast<size_t>(nranks));
  std::vector<unsigned char*> bases(static_cast<size_t>(nranks), nullptr);
  for (int p = 0; p < nranks; ++p) {
    const auto f = split(all[static_cast<size_t>(p)], '|');
    if (f.size() != 6)
      throw CommError("resident: malformed descriptor from rank " + std::to_string(p));
    PeerInfo& info = peers_[static_cast<size_t>(p)];
    info.host = f[0].substr(0, f[0].find('/'));
    info.pid = std::stoi(f[1]);
    info.same_host = f[0] == host_key;
    if (std::to_string(cfg.slots) != f[4] || std::to_string(cfg.slot_bytes) != f[5]) {
      throw InvalidArgument("resident: rank " + std::to_string(p) + " uses RESIDENT_SLOTS=" + f[4] +
                            " RESIDENT_SLOT_BYTES=" + f[5] + " but rank " + std::to_string(rank) +
                            " uses " + std::to_string(cfg.slots) + "/" +
                            std::to_string(cfg.slot_bytes) + "; all ranks must agree");
    }
    if (p == rank) continue;
    if (!info.same_host) {
      throw CommError("resident: rank " + std::to_string(p) + " runs on host " + info.host +
                      ", which does not share memory with rank " + std::to_string(rank) +
                      "; this build has the shm transport only (tcp and ib are not built yet)");
    }
    peer_inboxes_[static_cast<size_t>(p)] = ShmSegment::open(f[2], std::stoull(f[3]));
    bases[static_cast<size_t>(p)] =
        static_cast<unsigned char*>(peer_inboxes_[static_cast<size_t>(p)].data());
  }
  // Everyone has mapped everyone: names can go, so nothing outlives a crash in /dev/shm.
  allGatherStrings(store, rank, nranks, "resident/mapped", "1");
  inbox_.unlinkName();

  transport_ = std::make_unique<ShmTransport>(bases);
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
                                     static_cast<unsigned char*>(inbox_.data()), transport_.get(),
                                     peers_, proxied_, fifo_.get(), timeout_ms * 1000000ull);
}

Communicator::~Communicator() {
  shutdown();
}

void Communicator::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (proxy_) proxy_->stop();
  // The engine (and its op pool) stays until destruction: Works may still hold handles.
  // Poisoned, it never touches the transport or the segments again.
  if (engine_) engine_->poison("the process group was shut down");
  proxy_.reset();
  peer_inboxes_.clear();
  inbox_ = ShmSegment();
}

bool Communicator::proxyPoll() {
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
  transport_->poll();
  // Async ops nobody waits on are driven here, at the proxy's idle pace: a caller blocked
  // in wait() drives its own ops, and two spinning drivers would only contend for the core.
  if (engine_->hasActive() && !engine_->hasWaiters()) engine_->tryProgress();
  return moved;
}

void Communicator::setExtraPoller(ProxyHandler* poller) {
  extra_poller_.store(poller);
  if (poller == nullptr)
    while (extra_busy_.load()) cpuRelax();
}

int Communicator::localIndex() const {
  int index = 0;
  for (int p = 0; p < rank_; ++p) index += peers_[static_cast<size_t>(p)].same_host ? 1 : 0;
  return index;
}

std::string Communicator::transportFor(int peer) const {
  if (peer == rank_) return "self";
  return transport_ ? transport_->name() : "none";
}

std::string Communicator::pathFor(int peer) const {
  if (peer == rank_) return "self";
  return proxied_[static_cast<size_t>(peer)] ? "proxy" : "direct";
}

}  // namespace resident
