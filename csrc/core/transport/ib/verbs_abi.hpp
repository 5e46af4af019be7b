// The slice of the libibverbs user ABI the ib transport uses, declared here so that the
// extension builds without rdma-core's headers and loads libibverbs.so.1 only at run time.
//
// Which ABI: the libibverbs 1.1 user ABI (symbol version IBVERBS_1.1), whose public structures
// and the legacy ops table inside struct ibv_context have kept their layout since rdma-core's
// first releases (v13, 2017) because applications compiled against older headers must keep
// working; ibv_reg_dmabuf_mr is the one newer entry point (IBVERBS_1.12, rdma-core v34) and is
// optional. The declarations follow the documented layout of rdma-core v44 (the version Debian 12
// ships) and are written from the man pages and the ABI description, not copied from verbs.h.
// tests/cpp/test_ib_abi.cpp checks every size and offset below against <infiniband/verbs.h>
// wherever that header is installed, and against the documented numbers everywhere else.
//
// Rules of this file: x86-64 / aarch64 LP64 only (C enums are 4 bytes, pointers 8); structures
// the library allocates are declared only up to the last field we read (a prefix); structures
// we allocate and hand to the library are declared in full.
#pragma once

#include <cstddef>
#include <cstdint>

namespace resident {
namespace ib {
namespace abi {

static_assert(sizeof(void*) == 8, "the ib transport supports LP64 targets only");

// ---- Opaque objects (only ever handled through pointers) ----
struct Device;          // struct ibv_device
struct CompChannel;     // struct ibv_comp_channel
struct Srq;             // struct ibv_srq
struct Qp;              // forward
struct Cq;              // forward
struct SendWr;          // forward
struct RecvWr;          // forward
struct WorkCompletion;  // forward

// ---- Enumerations (C enums: 4-byte values) ----
// enum ibv_port_state
enum PortState : uint32_t {
  kPortNop = 0,
  kPortDown = 1,
  kPortInit = 2,
  kPortArmed = 3,
  kPortActive = 4,
  kPortActiveDefer = 5,
};
// IBV_LINK_LAYER_*
enum LinkLayerValue : uint8_t {
  kLinkUnspecified = 0,
  kLinkInfiniBand = 1,
  kLinkEthernet = 2,
};
// enum ibv_mtu: 1 = 256 bytes ... 5 = 4096 bytes.
enum Mtu : uint32_t { kMtu256 = 1, kMtu512 = 2, kMtu1024 = 3, kMtu2048 = 4, kMtu4096 = 5 };
// enum ibv_qp_type (RC only here).
enum QpType : uint32_t { kQpRc = 2 };
// enum ibv_qp_state
enum QpState : uint32_t {
  kQpsReset = 0,
  kQpsInit = 1,
  kQpsRtr = 2,
  kQpsRts = 3,
  kQpsSqd = 4,
  kQpsSqe = 5,
  kQpsErr = 6,
};
// enum ibv_access_flags (the ones used).
enum Access : int {
  kAccessLocalWrite = 1,
  kAccessRemoteWrite = 2,
  kAccessRemoteRead = 4,
  kAccessRelaxedOrdering = 1 << 20,
};
// enum ibv_qp_attr_mask (the ones used).
enum QpAttrMask : int {
  kAttrState = 1 << 0,
  kAttrAccessFlags = 1 << 3,
  kAttrPkeyIndex = 1 << 4,
  kAttrPort = 1 << 5,
  kAttrAv = 1 << 7,
  kAttrPathMtu = 1 << 8,
  kAttrTimeout = 1 << 9,
  kAttrRetryCnt = 1 << 10,
  kAttrRnrRetry = 1 << 11,
  kAttrRqPsn = 1 << 12,
  kAttrMaxQpRdAtomic = 1 << 13,
  kAttrMinRnrTimer = 1 << 15,
  kAttrSqPsn = 1 << 16,
  kAttrMaxDestRdAtomic = 1 << 17,
  kAttrDestQpn = 1 << 20,
};
// enum ibv_wr_opcode (the ones used).
enum WrOpcode : uint32_t { kWrRdmaWrite = 0, kWrRdmaWriteWithImm = 1 };
// enum ibv_send_flags
enum SendFlags : uint32_t {
  kSendFence = 1 << 0,
  kSendSignaled = 1 << 1,
  kSendSolicited = 1 << 2,
  kSendInline = 1 << 3,
};
// enum ibv_wc_status: 0 is success; everything else is an error (text via ibv_wc_status_str).
enum WcStatus : uint32_t { kWcSuccess = 0, kWcWrFlushErr = 5 };
// enum ibv_wc_opcode (the ones used). Receive completions have bit 7 set.
enum WcOpcode : uint32_t {
  kWcRdmaWrite = 1,
  kWcRecv = 1u << 7,
  kWcRecvRdmaWithImm = (1u << 7) + 1,
};
// enum ibv_wc_flags
enum WcFlags : uint32_t { kWcWithImm = 1u << 1 };

// ---- Plain data structures ----
// union ibv_gid: 16 raw bytes (or subnet prefix + interface id), 8-byte aligned.
struct alignas(8) Gid {
  uint8_t raw[16];
};

// struct ibv_sge: one piece of local memory.
struct Sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

// struct ibv_qp_cap
struct QpCap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

// struct ibv_global_route
struct GlobalRoute {
  Gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

// struct ibv_ah_attr
struct AhAttr {
  GlobalRoute grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

// struct ibv_qp_attr (we allocate it: full).
struct QpAttr {
  uint32_t qp_state;
  uint32_t cur_qp_state;
  uint32_t path_mtu;
  uint32_t path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  uint32_t qp_access_flags;
  QpCap cap;
  AhAttr ah_attr;
  AhAttr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

// struct ibv_qp_init_attr (we allocate it: full).
struct QpInitAttr {
  void* qp_context;
  Cq* send_cq;
  Cq* recv_cq;
  Srq* srq;
  QpCap cap;
  uint32_t qp_type;
  int sq_sig_all;
};

// struct ibv_port_attr (we allocate it). The exported ibv_query_port fills the part up to
// `flags` (its legacy size). Newer rdma-core releases append fields after port_cap_flags2
// (active_speed_ex); the reserved tail keeps this buffer at least as large as any of them.
struct PortAttr {
  uint32_t state;
  uint32_t max_mtu;
  uint32_t active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
  uint8_t reserved_tail_[30];
};

// struct ibv_device_attr (we allocate it: full).
struct DeviceAttr {
  char fw_ver[64];
  uint64_t node_guid;
  uint64_t sys_image_guid;
  uint64_t max_mr_size;
  uint64_t page_size_cap;
  uint32_t vendor_id;
  uint32_t vendor_part_id;
  uint32_t hw_ver;
  int max_qp;
  int max_qp_wr;
  uint32_t device_cap_flags;
  int max_sge;
  int max_sge_rd;
  int max_cq;
  int max_cqe;
  int max_mr;
  int max_pd;
  int max_qp_rd_atom;
  int max_ee_rd_atom;
  int max_res_rd_atom;
  int max_qp_init_rd_atom;
  int max_ee_init_rd_atom;
  uint32_t atomic_cap;
  int max_ee;
  int max_rdd;
  int max_mw;
  int max_raw_ipv6_qp;
  int max_raw_ethy_qp;
  int max_mcast_grp;
  int max_mcast_qp_attach;
  int max_total_mcast_qp_attach;
  int max_ah;
  int max_fmr;
  int max_map_per_fmr;
  int max_srq;
  int max_srq_wr;
  int max_srq_sge;
  uint16_t max_pkeys;
  uint8_t local_ca_ack_delay;
  uint8_t phys_port_cnt;
};

// struct ibv_send_wr (we allocate it: full, 128 bytes). Only RDMA writes are posted here; the
// atomic/UD/XRC/bind/TSO members of the library's unions are kept as sized filler.
struct SendWr {
  uint64_t wr_id;
  SendWr* next;
  Sge* sg_list;
  int num_sge;
  uint32_t opcode;
  uint32_t send_flags;
  uint32_t imm_data;  // network byte order
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    uint64_t largest_member_[4];  // the atomic form: address, compare, swap, rkey
  } wr;
  uint32_t xrc_remote_srqn;
  uint64_t bind_or_tso_[6];  // memory-window bind (48 bytes) / TSO header
};

// struct ibv_recv_wr (we allocate it: full).
struct RecvWr {
  uint64_t wr_id;
  RecvWr* next;
  Sge* sg_list;
  int num_sge;
};

// struct ibv_wc (we allocate arrays of it: full, 48 bytes).
struct WorkCompletion {
  uint64_t wr_id;
  uint32_t status;
  uint32_t opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;  // network byte order
  uint32_t qp_num;
  uint32_t src_qp;
  uint32_t wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

// ---- Library-owned objects (prefixes) ----
using PollCqFn = int (*)(Cq* cq, int num_entries, WorkCompletion* wc);
using PostSendFn = int (*)(Qp* qp, SendWr* wr, SendWr** bad_wr);
using PostRecvFn = int (*)(Qp* qp, RecvWr* wr, RecvWr** bad_wr);

// struct ibv_context_ops: 32 function pointers in a fixed order. verbs.h's static inline
// ibv_poll_cq / ibv_post_send / ibv_post_recv call slots 11, 25 and 26; the other slots are
// legacy entries we never call.
struct ContextOps {
  void* slots_0_10_[11];   // query_device ... create_cq
  PollCqFn poll_cq;        // 11
  void* slots_12_24_[13];  // req_notify_cq ... destroy_qp
  PostSendFn post_send;    // 25
  PostRecvFn post_recv;    // 26
  void* slots_27_31_[5];   // create_ah ... async_event
};

// struct ibv_context (prefix: the device and the ops table).
struct Context {
  Device* device;
  ContextOps ops;
};

// struct ibv_pd (prefix).
struct Pd {
  Context* context;
  uint32_t handle;
};

// struct ibv_mr (prefix up to the keys).
struct Mr {
  Context* context;
  Pd* pd;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

// struct ibv_cq (prefix).
struct Cq {
  Context* context;
  CompChannel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
};

// struct ibv_qp (prefix up to qp_type).
struct Qp {
  Context* context;
  void* qp_context;
  Pd* pd;
  Cq* send_cq;
  Cq* recv_cq;
  Srq* srq;
  uint32_t handle;
  uint32_t qp_num;
  uint32_t state;
  uint32_t qp_type;
};

// ---- Documented sizes and offsets (LP64), checked here and against verbs.h by the test ----
static_assert(sizeof(Gid) == 16, "ibv_gid");
static_assert(sizeof(Sge) == 16, "ibv_sge");
static_assert(sizeof(QpCap) == 20, "ibv_qp_cap");
static_assert(sizeof(GlobalRoute) == 24, "ibv_global_route");
static_assert(sizeof(AhAttr) == 32 && offsetof(AhAttr, port_num) == 30, "ibv_ah_attr");
static_assert(sizeof(QpAttr) == 144 && offsetof(QpAttr, ah_attr) == 56 &&
                  offsetof(QpAttr, pkey_index) == 120 && offsetof(QpAttr, min_rnr_timer) == 128 &&
                  offsetof(QpAttr, rnr_retry) == 132 && offsetof(QpAttr, rate_limit) == 136,
              "ibv_qp_attr");
static_assert(sizeof(QpInitAttr) == 64 && offsetof(QpInitAttr, cap) == 32 &&
                  offsetof(QpInitAttr, qp_type) == 52,
              "ibv_qp_init_attr");
static_assert(sizeof(PortAttr) == 80 && offsetof(PortAttr, lid) == 34 &&
                  offsetof(PortAttr, link_layer) == 46,
              "ibv_port_attr");
static_assert(sizeof(DeviceAttr) == 232 && offsetof(DeviceAttr, max_qp_wr) == 112 &&
                  offsetof(DeviceAttr, max_sge) == 120 && offsetof(DeviceAttr, max_cqe) == 132 &&
                  offsetof(DeviceAttr, phys_port_cnt) == 227,
              "ibv_device_attr");
static_assert(sizeof(SendWr) == 128 && offsetof(SendWr, imm_data) == 36 &&
                  offsetof(SendWr, wr) == 40 && offsetof(SendWr, xrc_remote_srqn) == 72,
              "ibv_send_wr");
static_assert(sizeof(RecvWr) == 32, "ibv_recv_wr");
static_assert(sizeof(WorkCompletion) == 48 && offsetof(WorkCompletion, imm_data) == 24 &&
                  offsetof(WorkCompletion, qp_num) == 28,
              "ibv_wc");
static_assert(sizeof(ContextOps) == size_t{32} * 8 &&
                  offsetof(ContextOps, poll_cq) == size_t{11} * 8 &&
                  offsetof(ContextOps, post_send) == size_t{25} * 8 &&
                  offsetof(ContextOps, post_recv) == size_t{26} * 8,
              "ibv_context_ops");
static_assert(offsetof(Context, ops) == 8, "ibv_context");
static_assert(offsetof(Mr, lkey) == 36 && offsetof(Mr, rkey) == 40, "ibv_mr");
static_assert(offsetof(Qp, qp_num) == 52, "ibv_qp");

}  // namespace abi
}  // namespace ib
}  // namespace resident
