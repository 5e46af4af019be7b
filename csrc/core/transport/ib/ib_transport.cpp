#include "core/transport/ib/ib_transport.hpp"

#include <arpa/inet.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/transport/ib/registration.hpp"
#include "core/transport/ib/verbs_loader.hpp"

namespace resident {
namespace ib {
namespace {

void* mapAnonymous(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

uint64_t roundUp8(uint64_t n) {
  return (n + 7) & ~7ull;
}

}  // namespace

IbTransport::IbTransport(const IbOptions& opts, int rank, int nranks)
    : opts_(opts), rank_(rank), nranks_(nranks) {}

std::unique_ptr<IbTransport> IbTransport::create(const IbOptions& opts, int rank, int nranks,
                                                 const std::vector<bool>& remote, void* inbox,
                                                 size_t inbox_bytes, std::string* why) {
  std::string reason;
  std::unique_ptr<IbTransport> t(new IbTransport(opts, rank, nranks));
  if (!t->setUp(remote, inbox, inbox_bytes, &reason)) {
    RLOG_INFO("ib transport unavailable: %s", reason.c_str());
    if (why) *why = reason;
    return nullptr;  // the destructor releases what was set up
  }
  RLOG_INFO("ib transport: %s", t->describe().c_str());
  return t;
}

bool IbTransport::openDevice(std::string* why) {
  api_ = verbs(why);
  if (api_ == nullptr) return false;
  const std::vector<DeviceInfo> devices = probeDevices(why);
  size_t d = 0, p = 0;
  if (devices.empty() || !selectPort(devices, opts_.device, opts_.port, &d, &p, why)) return false;
  device_name_ = devices[d].name;
  port_ = devices[d].ports[p];
  int n = 0;
  abi::Device** list = api_->get_device_list(&n);
  for (int i = 0; list != nullptr && i < n && ctx_ == nullptr; ++i) {
    const char* name = api_->get_device_name(list[i]);
    if (name != nullptr && device_name_ == name) ctx_ = api_->open_device(list[i]);
  }
  if (list != nullptr) api_->free_device_list(list);
  if (ctx_ == nullptr) {
    *why = "cannot open RDMA device " + device_name_;
    return false;
  }
  if (opts_.gid_index >= 0) {
    abi::Gid gid{};
    if (api_->query_gid(ctx_, static_cast<uint8_t>(port_.port), opts_.gid_index, &gid) != 0 ||
        gidIsZero(gid)) {
      *why = "GID index " + std::to_string(opts_.gid_index) + " of " + device_name_ + " port " +
             std::to_string(port_.port) + " is empty";
      return false;
    }
    port_.gid_index = opts_.gid_index;
    port_.gid = gid;
  }
  return true;
}

bool IbTransport::setUp(const std::vector<bool>& remote, void* inbox, size_t inbox_bytes,
                        std::string* why) {
  if (remote.size() != static_cast<size_t>(nranks_)) {
    *why = "remote peer mask has the wrong size";
    return false;
  }
  if (!openDevice(why)) return false;
  abi::DeviceAttr attr{};
  if (api_->query_device(ctx_, &attr) != 0) {
    *why = "ibv_query_device failed on " + device_name_;
    return false;
  }
  PlannerConfig pc;
  pc.sq_depth = std::min<uint32_t>(opts_.sq_depth, static_cast<uint32_t>(attr.max_qp_wr));
  pc.max_sge = std::max<uint32_t>(1, std::min<uint32_t>(opts_.max_sge, attr.max_sge));
  pc.signal_every = std::max<uint32_t>(1, std::min(opts_.signal_every, pc.sq_depth));
  pc.mode = opts_.completion;
  pc.fence_flag_writes = opts_.fence_flag_writes;
  pc.imm_slots = opts_.completion == CompletionMode::kWriteWithImm ? opts_.imm_slots : 0;
  // Staging space comes back only with completions: unsignalled requests may hold less than a
  // quarter of a peer's ring (tags are staging positions) and a piece is at most a quarter, so
  // once the signalled requests complete, any piece fits.
  pc.signal_tag_span = roundUp8(opts_.staging_bytes) / 4;
  if (pc.sq_depth == 0 || (pc.mode == CompletionMode::kWriteWithImm && pc.imm_slots == 0)) {
    *why = "send queue depth or landing slots are zero";
    return false;
  }

  size_t nremote = 0;
  for (int p = 0; p < nranks_; ++p) nremote += remote[static_cast<size_t>(p)] && p != rank_;
  const uint64_t cqe = std::max<uint64_t>(1, nremote * (pc.sq_depth + pc.imm_slots));
  if (cqe > static_cast<uint64_t>(attr.max_cqe)) {
    *why = "completion queue of " + std::to_string(cqe) + " entries exceeds the device's " +
           std::to_string(attr.max_cqe) + "; lower the send queue depth";
    return false;
  }
  pd_ = api_->alloc_pd(ctx_);
  if (pd_ == nullptr) {
    *why = "ibv_alloc_pd failed on " + device_name_;
    return false;
  }
  cq_ = api_->create_cq(ctx_, static_cast<int>(cqe), nullptr, nullptr, 0);
  if (cq_ == nullptr) {
    *why = "ibv_create_cq(" + std::to_string(cqe) + ") failed on " + device_name_;
    return false;
  }

  // The inbox is host memory (a shared segment): plain ibv_reg_mr, no GPUDirect needed.
  const RegDecision host = chooseRegistration(MemoryKind::kHostMemory, RegCapabilities{});
  inbox_ = static_cast<unsigned char*>(inbox);
  inbox_bytes_ = inbox_bytes;
  inbox_mr_ = registerMemory(*api_, pd_, host, inbox, inbox_bytes,
                             abi::kAccessLocalWrite | abi::kAccessRemoteWrite, -1, 0, why);
  if (inbox_mr_ == nullptr) return false;
  staging_mem_bytes_ = std::max<size_t>(nremote, 1) * roundUp8(opts_.staging_bytes);
  staging_mem_ = mapAnonymous(staging_mem_bytes_);
  if (staging_mem_ == nullptr || opts_.staging_bytes < 256) {
    *why = "cannot allocate the staging area";
    return false;
  }
  staging_mr_ = registerMemory(*api_, pd_, host, staging_mem_, staging_mem_bytes_,
                               abi::kAccessLocalWrite, -1, 0, why);
  if (staging_mr_ == nullptr) return false;
  if (pc.imm_slots > 0) {
    landing_mem_bytes_ = static_cast<size_t>(nranks_) * pc.imm_slots * kLandingRecordBytes;
    landing_mem_ = mapAnonymous(landing_mem_bytes_);
    if (landing_mem_ == nullptr) {
      *why = "cannot allocate the landing rings";
      return false;
    }
    landing_mr_ = registerMemory(*api_, pd_, host, landing_mem_, landing_mem_bytes_,
                                 abi::kAccessLocalWrite | abi::kAccessRemoteWrite, -1, 0, why);
    if (landing_mr_ == nullptr) return false;
  }

  peers_.resize(static_cast<size_t>(nranks_));
  std::random_device rd;
  std::mt19937 rng(rd());
  uint32_t granted_inline = opts_.max_inline;
  size_t staged = 0;
  for (int p = 0; p < nranks_; ++p) {
    Peer& peer = peers_[static_cast<size_t>(p)];
    peer.remote = remote[static_cast<size_t>(p)] && p != rank_;
    if (!peer.remote) continue;
    peer.staging.base = static_cast<unsigned char*>(staging_mem_) + staged;
    peer.staging.size = roundUp8(opts_.staging_bytes);
    staged += peer.staging.size;
    peer.psn = rng() & 0xffffff;
    if (!createQp(p, pc, &granted_inline, why)) return false;
  }
  pc.max_inline = granted_inline;
  planner_ = std::make_unique<PostPlanner>(nranks_, pc);
  wrs_.resize(pc.sq_depth);
  wcs_.resize(64);
  pending_.reserve(size_t{4} * pc.sq_depth);
  deferred_.reserve(size_t{4} * pc.sq_depth);
  // Receives for write-with-immediate: one per landing slot, posted before the peer can send.
  for (int p = 0; p < nranks_ && pc.imm_slots > 0; ++p)
    if (peers_[static_cast<size_t>(p)].remote)
      for (uint32_t s = 0; s < pc.imm_slots; ++s) postRecv(p, s);
  return true;
}

bool IbTransport::createQp(int p, const PlannerConfig& pc, uint32_t* granted_inline,
                           std::string* why) {
  Peer& peer = peers_[static_cast<size_t>(p)];
  // Ask for the inline size wanted; some devices refuse large ones: retry smaller.
  for (uint32_t inline_bytes : {opts_.max_inline, std::min<uint32_t>(opts_.max_inline, 64), 0u}) {
    abi::QpInitAttr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.cap.max_send_wr = pc.sq_depth;
    init.cap.max_recv_wr = std::max<uint32_t>(1, pc.imm_slots);
    init.cap.max_send_sge = pc.max_sge;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = inline_bytes;
    init.qp_type = abi::kQpRc;
    init.sq_sig_all = 0;
    peer.qp = api_->create_qp(pd_, &init);
    if (peer.qp == nullptr) continue;
    *granted_inline = std::min(*granted_inline, init.cap.max_inline_data);
    break;
  }
  if (peer.qp == nullptr) {
    *why = "ibv_create_qp failed on " + device_name_ + ": " + std::strerror(errno);
    return false;
  }
  abi::QpAttr a{};
  a.qp_state = abi::kQpsInit;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(port_.port);
  a.qp_access_flags = abi::kAccessLocalWrite | abi::kAccessRemoteWrite;
  const int rc = api_->modify_qp(
      peer.qp, &a, abi::kAttrState | abi::kAttrPkeyIndex | abi::kAttrPort | abi::kAttrAccessFlags);
  if (rc != 0) {
    *why = "queue pair to rank " + std::to_string(p) + ": INIT failed: " + std::strerror(rc);
    return false;
  }
  return true;
}

IbTransport::~IbTransport() {
  if (api_ == nullptr) return;
  for (Peer& p : peers_)
    if (p.qp != nullptr && api_->destroy_qp(p.qp) != 0) RLOG_WARN("ib: ibv_destroy_qp failed");
  for (abi::Mr* mr : {inbox_mr_, staging_mr_, landing_mr_})
    if (mr != nullptr && api_->dereg_mr(mr) != 0) RLOG_WARN("ib: ibv_dereg_mr failed");
  for (size_t i = 0; i < nsources_.load(); ++i)
    if (api_->dereg_mr(sources_[i].mr) != 0) RLOG_WARN("ib: ibv_dereg_mr failed");
  if (cq_ != nullptr && api_->destroy_cq(cq_) != 0) RLOG_WARN("ib: ibv_destroy_cq failed");
  if (pd_ != nullptr && api_->dealloc_pd(pd_) != 0) RLOG_WARN("ib: ibv_dealloc_pd failed");
  if (ctx_ != nullptr) api_->close_device(ctx_);
  if (staging_mem_ != nullptr) ::munmap(staging_mem_, staging_mem_bytes_);
  if (landing_mem_ != nullptr) ::munmap(landing_mem_, landing_mem_bytes_);
}

std::string IbTransport::localDescriptor(int p) const {
  const Peer& peer = peers_.at(static_cast<size_t>(p));
  if (!peer.remote) throw InvalidArgument("ib: rank " + std::to_string(p) + " is not remote");
  QpDescriptor d;
  d.qpn = peer.qp->qp_num;
  d.psn = peer.psn;
  d.lid = port_.lid;
  d.gid = port_.gid;
  d.mtu = port_.active_mtu;
  d.link = port_.link;
  d.inbox_addr = reinterpret_cast<uintptr_t>(inbox_);
  d.inbox_rkey = inbox_mr_->rkey;
  d.inbox_bytes = inbox_bytes_;
  const uint32_t slots = planner_->config().imm_slots;
  if (slots > 0) {
    // The ring *this* rank receives p's immediate signals in.
    d.landing_addr = reinterpret_cast<uintptr_t>(landing_mem_) +
                     static_cast<uint64_t>(p) * slots * kLandingRecordBytes;
    d.landing_rkey = landing_mr_->rkey;
    d.landing_slots = slots;
  }
  return serializeDescriptor(d);
}

void IbTransport::connect(int p, const std::string& text) {
  Peer& peer = peers_.at(static_cast<size_t>(p));
  if (!peer.remote) throw InvalidArgument("ib: rank " + std::to_string(p) + " is not remote");
  QpDescriptor d;
  std::string why;
  if (!parseDescriptor(text, &d, &why))
    throw CommError("ib: rank " + std::to_string(p) + ": " + why);
  if (d.link != port_.link)
    throw CommError(std::string("ib: rank ") + std::to_string(p) + " is on " +
                    linkLayerName(d.link) + ", this rank on " + linkLayerName(port_.link));
  if (d.landing_slots != planner_->config().imm_slots)
    throw CommError("ib: rank " + std::to_string(p) + " uses another completion mode");
  abi::QpAttr a{};
  a.qp_state = abi::kQpsRtr;
  const uint32_t path_mtu = std::min(d.mtu, port_.active_mtu);
  a.path_mtu = path_mtu;
  a.dest_qp_num = d.qpn;
  a.rq_psn = d.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;  // 0.64 ms
  a.ah_attr.port_num = static_cast<uint8_t>(port_.port);
  a.ah_attr.sl = opts_.service_level;
  a.ah_attr.dlid = d.lid;
  if (port_.link == LinkLayer::kEthernet) {
    a.ah_attr.is_global = 1;  // RoCE always routes by GID
    a.ah_attr.grh.dgid = d.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(port_.gid_index);
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.traffic_class = opts_.traffic_class;
  }
  int rc = api_->modify_qp(peer.qp, &a,
                           abi::kAttrState | abi::kAttrAv | abi::kAttrPathMtu | abi::kAttrDestQpn |
                               abi::kAttrRqPsn | abi::kAttrMaxDestRdAtomic | abi::kAttrMinRnrTimer);
  if (rc != 0)
    throw CommError("ib: queue pair to rank " + std::to_string(p) +
                    ": RTR failed: " + std::strerror(rc));
  a = abi::QpAttr{};
  a.qp_state = abi::kQpsRts;
  a.sq_psn = peer.psn;
  a.timeout = opts_.timeout;
  a.retry_cnt = opts_.retry_cnt;
  a.rnr_retry = opts_.rnr_retry;
  a.max_rd_atomic = 1;
  rc = api_->modify_qp(peer.qp, &a,
                       abi::kAttrState | abi::kAttrTimeout | abi::kAttrRetryCnt |
                           abi::kAttrRnrRetry | abi::kAttrSqPsn | abi::kAttrMaxQpRdAtomic);
  if (rc != 0)
    throw CommError("ib: queue pair to rank " + std::to_string(p) +
                    ": RTS failed: " + std::strerror(rc));
  peer.desc = d;
  peer.connected = true;
  RLOG_DEBUG("ib: rank %d -> rank %d connected (qpn %u -> %u, mtu %u)", rank_, p, peer.qp->qp_num,
             d.qpn, mtuBytes(path_mtu));
}

bool IbTransport::connected(int p) const {
  return peers_.at(static_cast<size_t>(p)).connected;
}

IbTransport::Peer& IbTransport::checkedPeer(int p) {
  if (!failed_.empty()) throw CommError(failed_);
  Peer& peer = peers_.at(static_cast<size_t>(p));
  if (!peer.connected) throw CommError("ib: rank " + std::to_string(p) + " is not connected");
  return peer;
}

void IbTransport::fail(const std::string& reason) {
  if (failed_.empty()) failed_ = reason;
  RLOG_ERROR("%s", reason.c_str());
  throw CommError(failed_);
}

uint64_t IbTransport::stage(int p, const void* src, uint32_t bytes, uint64_t* tag) {
  Staging& s = peers_[static_cast<size_t>(p)].staging;
  const uint64_t n = roundUp8(bytes);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.stall_timeout_ms);
  while (true) {
    const uint64_t pos = s.head % s.size;
    const uint64_t skip = pos + n > s.size ? s.size - pos : 0;  // never wrap inside a piece
    if (s.head + skip + n - s.tail <= s.size) {
      const uint64_t start = s.head + skip;
      s.head = start + n;
      unsigned char* dst = s.base + start % s.size;
      std::memcpy(dst, src, bytes);
      *tag = s.head;
      return reinterpret_cast<uintptr_t>(dst);
    }
    // Full: post what is queued, asking for completions, and reap them.
    flush(true);
    drainCq();
    if (std::chrono::steady_clock::now() > deadline)
      fail("ib: rank " + std::to_string(p) + " freed no staging space for " +
           std::to_string(opts_.stall_timeout_ms) + " ms (peer stalled or network down)");
  }
}

bool IbTransport::registerSource(const void* base, size_t bytes) {
  std::lock_guard<std::mutex> lock(sources_mu_);
  const size_t n = nsources_.load(std::memory_order_relaxed);
  if (pd_ == nullptr || bytes == 0 || n == kMaxSources) return false;
  std::string why;
  const RegDecision host = chooseRegistration(MemoryKind::kHostMemory, RegCapabilities{});
  abi::Mr* mr = registerMemory(*api_, pd_, host, const_cast<void*>(base), bytes,
                               abi::kAccessLocalWrite, -1, 0, &why);
  if (mr == nullptr) {
    RLOG_WARN("ib: source region not registered (%s); writes from it are copied", why.c_str());
    return false;
  }
  const auto begin = reinterpret_cast<uintptr_t>(base);
  sources_[n] = Source{begin, begin + bytes, mr->lkey, mr};
  nsources_.store(n + 1, std::memory_order_release);  // publishes the entry
  return true;
}

const IbTransport::Source* IbTransport::sourceOf(const void* src, size_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(src);
  const size_t n = nsources_.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i)
    if (a >= sources_[i].begin && a + bytes <= sources_[i].end) return &sources_[i];
  return nullptr;
}

void IbTransport::write(int p, size_t offset, const void* src, size_t bytes) {
  Peer& peer = checkedPeer(p);
  if (offset + bytes > peer.desc.inbox_bytes)
    throw InvalidArgument("ib: write past rank " + std::to_string(p) + "'s inbox");
  const auto* from = static_cast<const unsigned char*>(src);
  if (const Source* s = sourceOf(src, bytes)) {
    // Registered and left unchanged until the peer consumed it: posted from where it is, in
    // pieces an SGE can carry; it holds no staging (its tag is the ring's current position).
    constexpr size_t kSgeMax = size_t{1} << 30;
    while (bytes > 0) {
      WriteReq r;
      r.peer = p;
      r.offset = offset;
      r.bytes = static_cast<uint32_t>(std::min(bytes, kSgeMax));
      r.local_addr = reinterpret_cast<uintptr_t>(from);
      r.lkey = s->lkey;
      r.tag = peer.staging.head;
      pending_.push_back(r);
      from += r.bytes;
      offset += r.bytes;
      bytes -= r.bytes;
    }
    return;
  }
  const size_t piece_max = std::max<size_t>(8, (peer.staging.size / 4) & ~size_t{7});  // see setUp
  while (bytes > 0) {
    const uint32_t n = static_cast<uint32_t>(std::min(bytes, piece_max));
    WriteReq r;
    r.peer = p;
    r.offset = offset;
    r.bytes = n;
    r.local_addr = stage(p, from, n, &r.tag);
    r.lkey = staging_mr_->lkey;
    pending_.push_back(r);
    from += n;
    offset += n;
    bytes -= n;
  }
}

void IbTransport::signal(int p, size_t offset, uint64_t value) {
  Peer& peer = checkedPeer(p);
  if (offset % 8 != 0 || offset + 8 > peer.desc.inbox_bytes)
    throw InvalidArgument("ib: bad flag offset for rank " + std::to_string(p));
  WriteReq r;
  r.peer = p;
  r.offset = offset;
  r.is_signal = true;
  if (planner_->config().mode == CompletionMode::kWriteWithImm) {
    const LandingRecord rec{offset, value};
    r.bytes = kLandingRecordBytes;
    r.local_addr = stage(p, &rec, r.bytes, &r.tag);
  } else {
    r.bytes = kFlagBytes;
    r.local_addr = stage(p, &value, r.bytes, &r.tag);
  }
  r.lkey = staging_mr_->lkey;
  pending_.push_back(r);
}

void IbTransport::flush(bool signal_last) {
  if (pending_.empty()) return;
  deferred_.clear();
  planner_->plan(pending_.data(), pending_.size(), &deferred_, signal_last);
  for (int p : planner_->plannedPeers()) post(planner_->batch(p));
  pending_.swap(deferred_);
  deferred_.clear();
}

void IbTransport::post(PeerBatch& batch) {
  const Peer& peer = peers_[static_cast<size_t>(batch.peer)];
  const size_t n = batch.wrs.size();
  for (size_t i = 0; i < n; ++i) {
    const PlannedWr& pw = batch.wrs[i];
    abi::SendWr& w = wrs_[i];
    w = abi::SendWr{};
    w.wr_id = pw.wr_id;
    w.next = i + 1 < n ? &wrs_[i + 1] : nullptr;
    w.sg_list = &batch.sges[pw.first_sge];
    w.num_sge = static_cast<int>(pw.num_sge);
    w.opcode = pw.with_imm ? abi::kWrRdmaWriteWithImm : abi::kWrRdmaWrite;
    w.send_flags = (pw.signaled ? abi::kSendSignaled : 0u) |
                   (pw.inline_data ? abi::kSendInline : 0u) | (pw.fence ? abi::kSendFence : 0u);
    w.imm_data = htonl(pw.imm);
    if (pw.target == WrTarget::kLanding) {
      w.wr.rdma.remote_addr = peer.desc.landing_addr + pw.remote_offset;
      w.wr.rdma.rkey = peer.desc.landing_rkey;
    } else {
      w.wr.rdma.remote_addr = peer.desc.inbox_addr + pw.remote_offset;
      w.wr.rdma.rkey = peer.desc.inbox_rkey;
    }
  }
  abi::SendWr* bad = nullptr;
  const int rc = postSend(peer.qp, wrs_.data(), &bad);
  if (rc != 0)
    fail("ib: ibv_post_send of " + std::to_string(n) + " work requests to rank " +
         std::to_string(batch.peer) + " failed: " + std::strerror(rc));
  RLOG_TRACE("ib: posted %zu work requests to rank %d", n, batch.peer);
}

void IbTransport::postRecv(int p, uint32_t slot) {
  abi::RecvWr r{};
  r.wr_id = PostPlanner::makeWrId(p, slot, /*recv=*/true);
  r.sg_list = nullptr;  // write-with-immediate places its bytes by address: no receive buffer
  r.num_sge = 0;
  abi::RecvWr* bad = nullptr;
  const int rc = ib::postRecv(peers_[static_cast<size_t>(p)].qp, &r, &bad);
  if (rc != 0)
    fail("ib: ibv_post_recv for rank " + std::to_string(p) + " failed: " + std::strerror(rc));
}

void IbTransport::drainCq() {
  while (true) {
    const int n = pollCq(cq_, static_cast<int>(wcs_.size()), wcs_.data());
    if (n < 0) fail("ib: ibv_poll_cq failed on " + device_name_);
    for (int i = 0; i < n; ++i) {
      const abi::WorkCompletion& wc = wcs_[static_cast<size_t>(i)];
      const int p = PostPlanner::wrPeer(wc.wr_id);
      const bool recv = PostPlanner::wrIsRecv(wc.wr_id);
      if (wc.status != abi::kWcSuccess) {
        char vendor[16];
        std::snprintf(vendor, sizeof(vendor), "0x%x", wc.vendor_err);
        fail(std::string("ib: ") + (recv ? "receive from" : "RDMA write to") + " rank " +
             std::to_string(p) + " failed: " + api_->statusText(wc.status) + ", vendor error " +
             vendor);
      }
      if (!recv) {
        int peer = 0;
        uint64_t tag = 0;
        try {
          tag = planner_->complete(wc.wr_id, &peer);
        } catch (const CommError& e) {
          fail(e.what());
        }
        Staging& s = peers_[static_cast<size_t>(peer)].staging;
        s.tail = std::max(s.tail, tag);
        continue;
      }
      // An immediate signal: everything p wrote before it has landed; store the flag here.
      const uint32_t slots = planner_->config().imm_slots;
      const uint32_t slot = ntohl(wc.imm_data);
      if (slot >= slots || static_cast<size_t>(p) >= peers_.size())
        fail("ib: immediate signal with slot " + std::to_string(slot) + " from rank " +
             std::to_string(p));
      std::atomic_thread_fence(std::memory_order_acquire);
      LandingRecord rec;
      std::memcpy(&rec,
                  static_cast<unsigned char*>(landing_mem_) +
                      (static_cast<size_t>(p) * slots + slot) * kLandingRecordBytes,
                  sizeof(rec));
      if (rec.offset % 8 != 0 || rec.offset + 8 > inbox_bytes_)
        fail("ib: immediate signal from rank " + std::to_string(p) + " outside the inbox");
      reinterpret_cast<std::atomic<uint64_t>*>(inbox_ + rec.offset)
          ->store(rec.value, std::memory_order_release);
      postRecv(p, slot);
    }
    if (n < static_cast<int>(wcs_.size())) return;
  }
}

void IbTransport::poll() {
  if (!failed_.empty()) throw CommError(failed_);
  flush(false);
  drainCq();
}

std::string IbTransport::describe() const {
  if (!planner_) return "ib (not set up)";
  const PlannerConfig& c = planner_->config();
  return device_name_ + " port " + std::to_string(port_.port) + ", " + linkLayerName(port_.link) +
         ", gid " + std::to_string(port_.gid_index) + ", mtu " +
         std::to_string(mtuBytes(port_.active_mtu)) + ", inline " + std::to_string(c.max_inline) +
         ", sq " + std::to_string(c.sq_depth) + ", signal 1/" + std::to_string(c.signal_every) +
         ", " + completionModeName(c.mode);
}

}  // namespace ib
}  // namespace resident
