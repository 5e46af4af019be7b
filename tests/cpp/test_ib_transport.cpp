// IbTransport end to end against a software NIC: a fake verbs table (installed with
// setVerbsForTesting) that keeps queue pairs, memory regions and completion queues in memory and
// executes posted RDMA writes lazily, at the next poll of any completion queue — so reading a
// staging buffer after the transport reused it, overflowing a send queue, writing outside a
// registered region, or sending an immediate without a posted receive (RNR) all show. Two
// transports in one process play two ranks on different hosts.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/error.hpp"
#include "core/transport/ib/ib_transport.hpp"
#include "core/transport/ib/verbs_loader.hpp"

using namespace resident;
using namespace resident::ib;

namespace fake {

struct Mr {
  abi::Mr base;
  int access;
};
struct Cq {
  abi::Cq base;
  std::deque<abi::WorkCompletion> q;
};
struct Wr {
  uint64_t wr_id;
  uint32_t opcode, flags, imm;
  uint64_t raddr;
  uint32_t rkey;
  std::vector<abi::Sge> sges;
  std::vector<uint8_t> inline_bytes;  // captured at post time, as an HCA does
};
struct Qp {
  abi::Qp base;
  Cq* scq;
  Cq* rcq;
  abi::QpCap cap;
  uint32_t dest_qpn = 0;
  std::deque<Wr> sq;                     // posted, not executed
  uint64_t occupied = 0;                 // posted, not retired by a polled completion
  uint64_t since_signaled = 0;           // executed since the last signalled one
  std::map<uint64_t, uint64_t> retires;  // signalled wr_id -> work requests it retires
  std::deque<uint64_t> rq;               // posted receives
};

struct State {
  uint32_t port_state = abi::kPortActive;
  uint8_t link = abi::kLinkInfiniBand;
  uint16_t lid = 1;
  uint32_t max_inline = 64;
  uint32_t fail_next_status = 0;  // the next executed write completes with this error status
  uint32_t next_id = 0x100;
  std::map<uint32_t, Mr*> keys;  // lkey == rkey
  std::map<uint32_t, Qp*> qps;
  int live = 0;  // objects not destroyed yet
  uint64_t writes = 0, inline_writes = 0, rnr_waits = 0, max_chain = 0;
  std::mt19937_64 rng{42};
} st;

char device_storage;
abi::Device* device_list[2] = {reinterpret_cast<abi::Device*>(&device_storage), nullptr};

abi::Gid portGid() {
  abi::Gid g{};
  g.raw[0] = 0xfe;
  g.raw[1] = 0x80;
  g.raw[15] = static_cast<uint8_t>(st.lid);
  return g;
}

Mr* findKey(uint32_t key) {
  auto it = st.keys.find(key);
  return it == st.keys.end() ? nullptr : it->second;
}

bool covers(const Mr* mr, uint64_t addr, uint64_t len) {
  const uint64_t base = reinterpret_cast<uintptr_t>(mr->base.addr);
  return addr >= base && addr + len <= base + mr->base.length;
}

void complete(Cq* cq, uint64_t wr_id, uint32_t status, uint32_t opcode, uint32_t qpn,
              uint32_t imm = 0, uint32_t flags = 0) {
  abi::WorkCompletion wc{};
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = opcode;
  wc.qp_num = qpn;
  wc.imm_data = imm;
  wc.wc_flags = flags;
  cq->q.push_back(wc);
}

// Executes a few queued work requests of every queue pair, in order per queue pair (the network:
// slow enough that completions of early requests come back while later ones still wait to read
// their staging bytes).
void progress() {
  for (auto& kv : st.qps) {
    Qp* qp = kv.second;
    for (uint64_t budget = st.rng() % 4; budget > 0 && !qp->sq.empty(); --budget) {
      Wr& w = qp->sq.front();
      Qp* dst = st.qps.count(qp->dest_qpn) ? st.qps[qp->dest_qpn] : nullptr;
      if (w.opcode == abi::kWrRdmaWriteWithImm && dst != nullptr && dst->rq.empty()) {
        ++st.rnr_waits;  // receiver not ready: the HCA retries later (rnr_retry 7)
        break;
      }
      std::vector<uint8_t> bytes = w.inline_bytes;
      if (!(w.flags & abi::kSendInline))
        for (const abi::Sge& s : w.sges) {
          const auto* from = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(s.addr));
          bytes.insert(bytes.end(), from, from + s.length);
        }
      uint32_t status = abi::kWcSuccess;
      Mr* mr = findKey(w.rkey);
      if (st.fail_next_status != 0) {
        status = st.fail_next_status;
        st.fail_next_status = 0;
      } else if (qp->base.state != abi::kQpsRts || dst == nullptr) {
        status = abi::kWcWrFlushErr;
      } else if (mr == nullptr || !(mr->access & abi::kAccessRemoteWrite) ||
                 !covers(mr, w.raddr, bytes.size())) {
        status = 10;  // remote access error
      }
      if (status == abi::kWcSuccess) {
        std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(w.raddr)), bytes.data(),
                    bytes.size());
        ++st.writes;
        if (w.flags & abi::kSendInline) ++st.inline_writes;
        if (w.opcode == abi::kWrRdmaWriteWithImm) {
          const uint64_t recv_id = dst->rq.front();
          dst->rq.pop_front();
          complete(dst->rcq, recv_id, abi::kWcSuccess, abi::kWcRecvRdmaWithImm, dst->base.qp_num,
                   w.imm, abi::kWcWithImm);
        }
      } else {
        qp->base.state = abi::kQpsErr;
      }
      ++qp->since_signaled;
      if ((w.flags & abi::kSendSignaled) || status != abi::kWcSuccess) {
        complete(qp->scq, w.wr_id, status, abi::kWcRdmaWrite, qp->base.qp_num);
        qp->retires[w.wr_id] = qp->since_signaled;
        qp->since_signaled = 0;
      }
      qp->sq.pop_front();
    }
  }
}

int pollCq(abi::Cq* cq, int n, abi::WorkCompletion* wc) {
  progress();
  Cq* c = reinterpret_cast<Cq*>(cq);
  int got = 0;
  while (got < n && !c->q.empty()) {
    wc[got] = c->q.front();
    c->q.pop_front();
    if (!(wc[got].opcode & abi::kWcRecv)) {
      Qp* qp = st.qps[wc[got].qp_num];
      qp->occupied -= qp->retires[wc[got].wr_id];  // the send queue slots come back
      qp->retires.erase(wc[got].wr_id);
    }
    ++got;
  }
  return got;
}

int postSend(abi::Qp* q, abi::SendWr* wr, abi::SendWr** bad) {
  Qp* qp = reinterpret_cast<Qp*>(q);
  uint64_t chain = 0;
  for (; wr != nullptr; wr = wr->next, ++chain) {
    *bad = wr;
    if (qp->base.state != abi::kQpsRts) return EINVAL;
    if (qp->occupied + 1 > qp->cap.max_send_wr) return ENOMEM;  // send queue overflow
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge) return EINVAL;
    if (wr->opcode != abi::kWrRdmaWrite && wr->opcode != abi::kWrRdmaWriteWithImm) return EINVAL;
    Wr w{wr->wr_id,
         wr->opcode,
         wr->send_flags,
         wr->imm_data,
         wr->wr.rdma.remote_addr,
         wr->wr.rdma.rkey,
         {},
         {}};
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; ++i) {
      const abi::Sge& s = wr->sg_list[i];
      total += s.length;
      if (wr->send_flags & abi::kSendInline) {
        const auto* from = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(s.addr));
        w.inline_bytes.insert(w.inline_bytes.end(), from, from + s.length);
      } else {
        const Mr* mr = findKey(s.lkey);
        if (mr == nullptr || !covers(mr, s.addr, s.length)) return EFAULT;  // local protection
        w.sges.push_back(s);
      }
    }
    if ((wr->send_flags & abi::kSendInline) && total > qp->cap.max_inline_data) return EINVAL;
    qp->sq.push_back(std::move(w));
    ++qp->occupied;
  }
  *bad = nullptr;
  if (chain > st.max_chain) st.max_chain = chain;
  return 0;
}

int postRecv(abi::Qp* q, abi::RecvWr* wr, abi::RecvWr** bad) {
  Qp* qp = reinterpret_cast<Qp*>(q);
  for (; wr != nullptr; wr = wr->next) {
    if (qp->rq.size() >= qp->cap.max_recv_wr) {
      *bad = wr;
      return ENOMEM;
    }
    qp->rq.push_back(wr->wr_id);
  }
  return 0;
}

VerbsApi makeApi() {
  VerbsApi a;
  a.get_device_list = [](int* n) {
    *n = 1;
    return device_list;
  };
  a.free_device_list = [](abi::Device**) {};
  a.get_device_name = [](abi::Device*) { return "fake0"; };
  a.open_device = [](abi::Device*) {
    auto* c = new abi::Context{};
    c->device = device_list[0];
    c->ops.poll_cq = pollCq;
    c->ops.post_send = postSend;
    c->ops.post_recv = postRecv;
    ++st.live;
    return c;
  };
  a.close_device = [](abi::Context* c) {
    delete c;
    --st.live;
    return 0;
  };
  a.query_device = [](abi::Context*, abi::DeviceAttr* d) {
    *d = abi::DeviceAttr{};
    d->max_qp_wr = 1024;
    d->max_sge = 4;
    d->max_cqe = 1 << 16;
    d->phys_port_cnt = 1;
    return 0;
  };
  a.query_port = [](abi::Context*, uint8_t, abi::PortAttr* p) {
    *p = abi::PortAttr{};
    p->state = st.port_state;
    p->link_layer = st.link;
    p->lid = st.link == abi::kLinkInfiniBand ? st.lid : 0;
    p->active_mtu = abi::kMtu4096;
    p->gid_tbl_len = 2;
    return 0;
  };
  a.query_gid = [](abi::Context*, uint8_t, int index, abi::Gid* g) {
    *g = index == 0 ? portGid() : abi::Gid{};
    return 0;
  };
  a.alloc_pd = [](abi::Context* c) {
    ++st.live;
    return new abi::Pd{c, 0};
  };
  a.dealloc_pd = [](abi::Pd* pd) {
    delete pd;
    --st.live;
    return 0;
  };
  a.reg_mr = [](abi::Pd* pd, void* addr, size_t len, int access) {
    auto* m = new Mr{};
    m->base.context = pd->context;
    m->base.pd = pd;
    m->base.addr = addr;
    m->base.length = len;
    m->base.lkey = m->base.rkey = st.next_id++;
    m->access = access;
    st.keys[m->base.lkey] = m;
    ++st.live;
    return &m->base;
  };
  a.dereg_mr = [](abi::Mr* mr) {
    st.keys.erase(mr->lkey);
    delete reinterpret_cast<Mr*>(mr);
    --st.live;
    return 0;
  };
  a.create_cq = [](abi::Context* c, int cqe, void*, abi::CompChannel*, int) {
    auto* q = new Cq{};
    q->base.context = c;
    q->base.cqe = cqe;
    ++st.live;
    return &q->base;
  };
  a.destroy_cq = [](abi::Cq* cq) {
    delete reinterpret_cast<Cq*>(cq);
    --st.live;
    return 0;
  };
  a.create_qp = [](abi::Pd* pd, abi::QpInitAttr* init) -> abi::Qp* {
    if (init->qp_type != abi::kQpRc || init->cap.max_inline_data > st.max_inline) {
      errno = EINVAL;  // refuses large inline sizes: the transport must retry smaller
      return nullptr;
    }
    auto* q = new Qp{};
    q->base.context = pd->context;
    q->base.pd = pd;
    q->base.qp_num = st.next_id++;
    q->base.state = abi::kQpsReset;
    q->scq = reinterpret_cast<Cq*>(init->send_cq);
    q->rcq = reinterpret_cast<Cq*>(init->recv_cq);
    q->cap = init->cap;
    st.qps[q->base.qp_num] = q;
    ++st.live;
    return &q->base;
  };
  a.modify_qp = [](abi::Qp* q, abi::QpAttr* attr, int mask) {
    Qp* qp = reinterpret_cast<Qp*>(q);
    if (!(mask & abi::kAttrState)) return EINVAL;
    if (attr->qp_state == abi::kQpsRtr) {
      const int need = abi::kAttrAv | abi::kAttrPathMtu | abi::kAttrDestQpn | abi::kAttrRqPsn;
      if ((mask & need) != need || qp->base.state != abi::kQpsInit) return EINVAL;
      const bool eth = st.link == abi::kLinkEthernet;
      if (eth && (!attr->ah_attr.is_global ||
                  std::memcmp(attr->ah_attr.grh.dgid.raw, portGid().raw, 16) != 0))
        return EINVAL;  // RoCE needs the GRH with the peer's GID
      if (!eth && attr->ah_attr.dlid != st.lid) return EINVAL;
      qp->dest_qpn = attr->dest_qp_num;
    } else if (attr->qp_state == abi::kQpsRts) {
      if (qp->base.state != abi::kQpsRtr || !(mask & abi::kAttrSqPsn)) return EINVAL;
    } else if (attr->qp_state != abi::kQpsInit || !(mask & abi::kAttrPort)) {
      return EINVAL;
    }
    qp->base.state = attr->qp_state;
    return 0;
  };
  a.destroy_qp = [](abi::Qp* q) {
    st.qps.erase(q->qp_num);
    delete reinterpret_cast<Qp*>(q);
    --st.live;
    return 0;
  };
  a.wc_status_str = [](int) { return "fake status"; };
  a.library = "fake";
  return a;
}

}  // namespace fake

namespace {

constexpr size_t kInbox = 1 << 16;

struct Pair {
  std::vector<uint8_t> inbox[2];
  std::unique_ptr<IbTransport> t[2];

  explicit Pair(const IbOptions& opts) {
    for (int r = 0; r < 2; ++r) {
      inbox[r].assign(kInbox, 0);
      std::string why;
      std::vector<bool> remote = {r != 0, r != 1};
      t[r] = IbTransport::create(opts, r, 2, remote, inbox[r].data(), kInbox, &why);
      if (!t[r]) std::fprintf(stderr, "create: %s\n", why.c_str());
      CHECK(t[r] != nullptr);
    }
    const std::string d01 = t[0]->localDescriptor(1), d10 = t[1]->localDescriptor(0);
    t[0]->connect(1, d10);
    t[1]->connect(0, d01);
    CHECK(t[0]->connected(1) && t[1]->connected(0));
  }
  uint64_t flag(int r, size_t off) {
    uint64_t v;
    std::memcpy(&v, &inbox[r][off], 8);
    return v;
  }
  // Both proxies run until `pred` holds (the network moves on any poll).
  template <typename Pred>
  void until(Pred pred) {
    for (int i = 0; i < 100000 && !pred(); ++i) {
      t[0]->poll();
      t[1]->poll();
    }
    CHECK(pred());
  }
};

// Messages both ways through `slots` slots per direction, the engine's way: payload, then a
// flag after it (mode permitting in the same write), sizes across staging pieces.
void traffic(CompletionMode mode, uint64_t seed) {
  IbOptions o;
  o.completion = mode;
  o.sq_depth = 8;
  o.signal_every = 4;
  o.staging_bytes = 4096;  // pieces of 1 KiB: large messages wrap the ring many times
  o.imm_slots = 4;
  o.max_inline = 256;  // the fake grants 64 only
  o.stall_timeout_ms = 2000;
  Pair pr(o);
  CHECK(pr.t[0]->maxInline() == 64);
  CHECK(pr.t[0]->describe().find("fake0 port 1") != std::string::npos);
  std::mt19937_64 rng(seed);
  constexpr int kSlots = 3;
  constexpr size_t kSlotBytes = 8192;  // [flag line (64)][payload]
  uint64_t sent[2] = {0, 0};
  for (int round = 0; round < 60; ++round) {
    std::vector<uint8_t> payload[2][kSlots];
    for (int s = 0; s < kSlots; ++s) {
      for (int r = 0; r < 2; ++r) {
        const size_t n = 1 + rng() % (kSlotBytes - 128);
        payload[r][s].resize(n);
        for (auto& b : payload[r][s]) b = static_cast<uint8_t>(rng());
        const size_t base = 64 + s * kSlotBytes;
        // LL-like in flag-in-line mode (the flag directly after the payload's 8-aligned end),
        // the slot header's flag word otherwise.
        const size_t data_off = base + 64;
        pr.t[r]->write(1 - r, data_off, payload[r][s].data(), n);
        ++sent[r];
        pr.t[r]->signal(1 - r, base, sent[r]);
      }
    }
    for (int r = 0; r < 2; ++r)
      for (int s = 0; s < kSlots; ++s) {
        const size_t base = 64 + s * kSlotBytes;
        const uint64_t want = sent[1 - r] - (kSlots - 1 - s);
        pr.until([&] { return pr.flag(r, base) == want; });
        CHECK(std::memcmp(&pr.inbox[r][base + 64], payload[1 - r][s].data(),
                          payload[1 - r][s].size()) == 0);
      }
  }
  // An LL-style message: the flag is the continuation of the payload: one write in-line mode.
  const uint64_t before = fake::st.writes;
  std::vector<uint8_t> line(56, 0xab);
  pr.t[0]->write(1, 40000, line.data(), line.size());
  pr.t[0]->signal(1, 40056, 777);
  pr.until([&] { return pr.flag(1, 40056) == 777; });
  CHECK(std::memcmp(&pr.inbox[1][40000], line.data(), line.size()) == 0);
  const uint64_t used = fake::st.writes - before;
  CHECK(mode == CompletionMode::kFlagInLine ? used == 1 : used == 2);
}

// A registered source region is posted in place, unregistered memory is staged: the software
// NIC reads SGEs when it executes a write, so bytes changed after write() returned arrive only
// from a registered region (the contract: its owner keeps them until the peer consumed them, as
// the GPU outbox does), while a staged write carries the bytes of the moment of the call.
void testRegisteredSource() {
  IbOptions o;
  o.staging_bytes = 4096;  // staged pieces of 1 KiB
  o.stall_timeout_ms = 2000;
  Pair pr(o);
  std::vector<uint8_t> outbox(32768), other(16384);
  std::mt19937_64 rng(7);
  for (auto& b : outbox) b = static_cast<uint8_t>(rng());
  for (auto& b : other) b = static_cast<uint8_t>(rng());
  const size_t registered = outbox.size() - 1024;  // the last KiB is left out
  CHECK(pr.t[0]->registerSource(outbox.data(), registered));
  CHECK(!pr.t[0]->registerSource(outbox.data(), 0));

  // In place: a message many staging pieces long, in one write (+ the flag's).
  uint64_t before = fake::st.writes;
  pr.t[0]->write(1, 64, outbox.data() + 64, 16384);
  for (size_t k = 64; k < 64 + 16384; ++k) outbox[k] ^= 0x5a;  // after write(), before the NIC
  pr.t[0]->signal(1, 0, 1);
  pr.until([&] { return pr.flag(1, 0) == 1; });
  CHECK(std::memcmp(&pr.inbox[1][64], outbox.data() + 64, 16384) == 0);
  CHECK(fake::st.writes - before <= 2);

  // Staged: the bytes of the call, whatever happens to the buffer afterwards.
  const std::vector<uint8_t> sent = other;
  pr.t[0]->write(1, 20000, other.data(), other.size());
  for (auto& b : other) b ^= 0x5a;
  pr.t[0]->signal(1, 8, 2);
  pr.until([&] { return pr.flag(1, 8) == 2; });
  CHECK(std::memcmp(&pr.inbox[1][20000], sent.data(), sent.size()) == 0);

  // Straddling the region's end: not inside it, so staged (the bytes of the call).
  const size_t from = registered - 50;
  const std::vector<uint8_t> tail(outbox.begin() + from, outbox.begin() + from + 100);
  pr.t[0]->write(1, 40000, outbox.data() + from, 100);
  for (size_t k = from; k < from + 100; ++k) outbox[k] ^= 0x5a;
  pr.t[0]->signal(1, 16, 3);
  pr.until([&] { return pr.flag(1, 16) == 3; });
  CHECK(std::memcmp(&pr.inbox[1][40000], tail.data(), tail.size()) == 0);
}

void testRnrFlowControl() {
  // More immediate signals than posted receives: the excess waits (RNR) until the receiver's
  // proxy consumed a landing record and reposted; all arrive, in order.
  IbOptions o;
  o.completion = CompletionMode::kWriteWithImm;
  o.imm_slots = 2;
  o.sq_depth = 16;
  Pair pr(o);
  const uint64_t waits = fake::st.rnr_waits;
  for (uint64_t i = 1; i <= 7; ++i) pr.t[0]->signal(1, 8 * i, i);
  for (int i = 0; i < 100; ++i) pr.t[0]->poll();  // the receiver's proxy is not polling yet
  CHECK(fake::st.rnr_waits > waits);
  pr.until([&] { return pr.flag(1, 56) == 7; });
  for (uint64_t i = 1; i <= 7; ++i) CHECK(pr.flag(1, 8 * i) == i);
}

void testFaults() {
  IbOptions o;
  Pair pr(o);
  // A completion with an error status fails the transport, naming the peer and the status.
  fake::st.fail_next_status = 12;
  pr.t[0]->signal(1, 0, 1);
  bool threw = false;
  try {
    for (int i = 0; i < 10; ++i) pr.t[0]->poll();
  } catch (const CommError& e) {
    threw = true;
    CHECK(std::string(e.what()).find("RDMA write to rank 1 failed: fake status") !=
          std::string::npos);
  }
  CHECK(threw);
  CHECK_THROWS(pr.t[0]->write(1, 0, "x", 1));  // stays failed
  CHECK_THROWS(pr.t[0]->poll());
  // Bad arguments and descriptors.
  CHECK_THROWS(pr.t[1]->write(0, kInbox - 4, "12345678", 8));  // past the peer's inbox
  CHECK_THROWS(pr.t[1]->signal(0, 3, 1));                      // unaligned flag
  CHECK_THROWS(pr.t[1]->localDescriptor(1));                   // self
  CHECK_THROWS(pr.t[1]->connect(0, "rib1 qpn=1"));             // malformed
}

void testUnavailableAndMismatch() {
  std::vector<uint8_t> inbox(4096);
  std::string why;
  fake::st.port_state = abi::kPortDown;
  CHECK(!ibAvailable(&why) && why.find("fake0 port 1: state DOWN") != std::string::npos);
  CHECK(IbTransport::create(IbOptions{}, 0, 2, {false, true}, inbox.data(), inbox.size(), &why) ==
        nullptr);
  CHECK(why.find("state DOWN") != std::string::npos);
  fake::st.port_state = abi::kPortActive;
  CHECK(ibAvailable(&why));
  IbOptions other;
  other.device = "mlx5_7";
  CHECK(IbTransport::create(other, 0, 2, {false, true}, inbox.data(), inbox.size(), &why) ==
        nullptr);
  CHECK(why.find("mlx5_7") != std::string::npos);
  // Peers on different link layers or completion modes refuse to connect.
  IbOptions imm;
  imm.completion = CompletionMode::kWriteWithImm;
  auto a = IbTransport::create(IbOptions{}, 0, 2, {false, true}, inbox.data(), inbox.size(), &why);
  std::vector<uint8_t> inbox2(4096);
  auto b = IbTransport::create(imm, 1, 2, {true, false}, inbox2.data(), inbox2.size(), &why);
  CHECK(a && b);
  CHECK_THROWS(a->connect(1, b->localDescriptor(0)));
  std::string eth = a->localDescriptor(1);
  eth.replace(eth.find("link=ib"), 7, "link=eth");
  CHECK_THROWS(b->connect(0, eth));
  CHECK_THROWS(a->write(1, 0, "x", 1));  // not connected
}

}  // namespace

int main() {
  static const VerbsApi api = fake::makeApi();
  setVerbsForTesting(&api);
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    traffic(CompletionMode::kFlagInLine, seed);
    traffic(CompletionMode::kFlagWrite, seed);
    traffic(CompletionMode::kWriteWithImm, seed);
  }
  fake::st.link = abi::kLinkEthernet;  // RoCE: GID routing (no sysfs here: the v1/unknown rank)
  traffic(CompletionMode::kFlagInLine, 9);
  fake::st.link = abi::kLinkInfiniBand;
  testRegisteredSource();
  testRnrFlowControl();
  testFaults();
  testUnavailableAndMismatch();
  CHECK(fake::st.live == 0);  // every QP, MR, CQ, PD and context released
  CHECK(fake::st.inline_writes > 0 && fake::st.max_chain > 1);
  std::printf("software NIC: %llu writes (%llu inline), longest chain %llu, %llu RNR waits\n",
              static_cast<unsigned long long>(fake::st.writes),
              static_cast<unsigned long long>(fake::st.inline_writes),
              static_cast<unsigned long long>(fake::st.max_chain),
              static_cast<unsigned long long>(fake::st.rnr_waits));
  setVerbsForTesting(nullptr);
  std::puts("test_ib_transport: ok");
  return 0;
}
