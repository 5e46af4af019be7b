// The ib transport: RDMA writes into peers' registered inboxes over RC queue pairs (rdma-core
// verbs, loaded at run time). Installed once per communicator: one protection domain, one
// completion queue, one RC queue pair per remote peer, the inbox registered once, and two small
// registered areas of its own — a staging ring per peer (writes are copied there, so the caller's
// buffer is free when write() returns) and, in write-with-immediate mode, a landing ring per peer.
// Writes from a region the owner registered with registerSource() (the GPU path's outbox, which
// stays unchanged until the peer consumed it) are posted in place, without that copy.
//
// Use (the communicator's part, csrc/core/transport/ib/ib_connect.cpp):
//   auto t = IbTransport::create(opts, rank, nranks, remote, inbox, inbox_bytes, &why);
//   store.set(key(rank, p), t->localDescriptor(p));          for every remote peer p
//   t->connect(p, store.get(key(p, rank)));                  for every remote peer p
// then write()/signal() queue RDMA writes and poll() posts them (one chained post per peer) and
// drains the completion queue. Only the thread running a proxy pass may call write/signal/poll
// (the communicator's pass lock: the proxy thread, or a caller waiting on its op); poll() runs at
// the end of every pass, which is what turns a pass's triggers into one post per peer.
// Faults (a failed post, a completion with an error status, a peer that stops draining) throw
// CommError; the transport stays failed afterwards.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/transport/ib/ib_caps.hpp"
#include "core/transport/ib/post_planner.hpp"
#include "core/transport/ib/qp_desc.hpp"
#include "core/transport/ib/verbs_abi.hpp"
#include "core/transport/transport.hpp"

namespace resident {
namespace ib {

struct VerbsApi;

struct IbOptions {
  std::string device;  // "" picks the first usable device
  int port = 0;        // 0 picks the first usable port
  int gid_index = -1;  // -1: chooseGidIndex's answer
  uint32_t sq_depth = 256;
  uint32_t signal_every = 32;
  uint32_t max_sge = 4;
  uint32_t max_inline = 256;  // asked for; the device may grant less (create_qp is retried lower)
  CompletionMode completion = CompletionMode::kFlagInLine;
  bool fence_flag_writes = true;
  uint32_t imm_slots = 128;         // landing ring entries and posted receives per peer (imm mode)
  size_t staging_bytes = 1u << 20;  // per peer
  uint8_t service_level = 0;
  uint8_t traffic_class = 0;
  uint8_t timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;              // 7: retry forever (imm mode's flow control)
  uint64_t stall_timeout_ms = 30000;  // a peer that frees no send-queue/staging space this long
};

class IbTransport : public Transport {
 public:
  // `remote[p]`: p is reached through this transport (false for self and same-host peers).
  // `inbox`: this rank's inbox, host memory, registered for remote writes. nullptr with *why when
  // libibverbs, a usable port or any resource is missing.
  static std::unique_ptr<IbTransport> create(const IbOptions& opts, int rank, int nranks,
                                             const std::vector<bool>& remote, void* inbox,
                                             size_t inbox_bytes, std::string* why);
  ~IbTransport() override;
  IbTransport(const IbTransport&) = delete;
  IbTransport& operator=(const IbTransport&) = delete;

  // The descriptor of this rank's queue pair towards `peer`, for the store exchange.
  std::string localDescriptor(int peer) const;
  // Moves the queue pair towards `peer` to RTS with the peer's descriptor. Throws CommError.
  void connect(int peer, const std::string& remote_descriptor);
  bool connected(int peer) const;

  const char* name() const override { return "ib"; }
  void write(int peer, size_t offset, const void* src, size_t bytes) override;
  void signal(int peer, size_t offset, uint64_t value) override;
  bool directCapable(int /*peer*/) const override { return false; }
  void poll() override;
  // Registers [base, base + bytes) once: writes from inside it are posted from where they are
  // (no copy into the staging ring). Any thread; at most kMaxSources regions.
  bool registerSource(const void* base, size_t bytes) override;

  // Posts everything queued (one chained post per peer); signal_last asks for completions.
  void flush(bool signal_last = false);
  // "mlx5_0 port 1, Ethernet, gid 3, mtu 4096, inline 220, sq 256, signal 1/32, flag-in-line".
  std::string describe() const;
  uint32_t maxInline() const { return planner_ ? planner_->config().max_inline : 0; }

 private:
  struct Staging {
    unsigned char* base = nullptr;
    uint64_t size = 0;
    uint64_t head = 0;  // positions only grow; tail: everything before it is reusable
    uint64_t tail = 0;
  };
  // A registered source region; published entries never change (write() reads them without a
  // lock, on the proxy thread, while another thread may be adding one).
  struct Source {
    uintptr_t begin = 0, end = 0;
    uint32_t lkey = 0;
    abi::Mr* mr = nullptr;
  };
  static constexpr size_t kMaxSources = 4;
  const Source* sourceOf(const void* src, size_t bytes) const;

  struct Peer {
    abi::Qp* qp = nullptr;
    uint32_t psn = 0;
    bool remote = false;
    bool connected = false;
    QpDescriptor desc;  // the peer's
    Staging staging;
  };

  IbTransport(const IbOptions& opts, int rank, int nranks);
  bool setUp(const std::vector<bool>& remote, void* inbox, size_t inbox_bytes, std::string* why);
  bool openDevice(std::string* why);
  bool createQp(int peer, const PlannerConfig& pc, uint32_t* granted_inline, std::string* why);
  void postRecv(int peer, uint32_t slot);
  Peer& checkedPeer(int peer);
  // Copies `bytes` into the peer's staging ring; waits (flushing, polling) for space.
  uint64_t stage(int peer, const void* src, uint32_t bytes, uint64_t* tag);
  void drainCq();
  void post(PeerBatch& batch);
  [[noreturn]] void fail(const std::string& reason);

  const IbOptions opts_;
  const int rank_, nranks_;
  const VerbsApi* api_ = nullptr;
  abi::Context* ctx_ = nullptr;
  abi::Pd* pd_ = nullptr;
  abi::Cq* cq_ = nullptr;
  abi::Mr* inbox_mr_ = nullptr;
  abi::Mr* staging_mr_ = nullptr;
  abi::Mr* landing_mr_ = nullptr;
  unsigned char* inbox_ = nullptr;
  size_t inbox_bytes_ = 0;
  void* staging_mem_ = nullptr;
  size_t staging_mem_bytes_ = 0;
  void* landing_mem_ = nullptr;
  size_t landing_mem_bytes_ = 0;
  std::string device_name_;
  PortInfo port_;
  std::vector<Peer> peers_;
  std::array<Source, kMaxSources> sources_{};
  std::atomic<size_t> nsources_{0};
  std::mutex sources_mu_;  // registerSource callers
  std::unique_ptr<PostPlanner> planner_;
  std::vector<WriteReq> pending_, deferred_;
  std::vector<abi::SendWr> wrs_;
  std::vector<abi::WorkCompletion> wcs_;
  std::string failed_;
};

}  // namespace ib
}  // namespace resident
