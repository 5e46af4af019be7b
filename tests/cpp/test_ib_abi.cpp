// Self-check of csrc/core/transport/ib/verbs_abi.hpp. The header already static_asserts the
// documented LP64 sizes and offsets; where rdma-core's <infiniband/verbs.h> is installed (the GPU
// machine), this test also compares every declared structure, offset and constant with the real
// header at compile time. Without the header only the documented numbers are checked (and the
// test says so).
#include <cstdio>

#include "check.hpp"
#include "core/transport/ib/verbs_abi.hpp"

namespace abi = resident::ib::abi;

#if defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define RESIDENT_HAVE_VERBS_H 1
#endif
#endif

#ifdef RESIDENT_HAVE_VERBS_H
#include <infiniband/verbs.h>

#define SAME_SIZE(ours, theirs) \
  static_assert(sizeof(abi::ours) == sizeof(struct theirs), #ours " size differs from " #theirs)
#define SAME_OFFSET(ours, f1, theirs, f2)                               \
  static_assert(offsetof(abi::ours, f1) == offsetof(struct theirs, f2), \
                #ours "." #f1 " offset differs from " #theirs "." #f2)
#define SAME_VALUE(ours, theirs) \
  static_assert(static_cast<long>(ours) == static_cast<long>(theirs), #ours " != " #theirs)

// Structures we allocate: whole size and every field used.
static_assert(sizeof(abi::Gid) == sizeof(union ibv_gid), "Gid size differs from ibv_gid");
SAME_SIZE(Sge, ibv_sge);
SAME_OFFSET(Sge, lkey, ibv_sge, lkey);
SAME_SIZE(QpCap, ibv_qp_cap);
SAME_OFFSET(QpCap, max_inline_data, ibv_qp_cap, max_inline_data);
SAME_SIZE(GlobalRoute, ibv_global_route);
SAME_OFFSET(GlobalRoute, sgid_index, ibv_global_route, sgid_index);
SAME_OFFSET(GlobalRoute, hop_limit, ibv_global_route, hop_limit);
SAME_OFFSET(GlobalRoute, traffic_class, ibv_global_route, traffic_class);
SAME_SIZE(AhAttr, ibv_ah_attr);
SAME_OFFSET(AhAttr, dlid, ibv_ah_attr, dlid);
SAME_OFFSET(AhAttr, sl, ibv_ah_attr, sl);
SAME_OFFSET(AhAttr, is_global, ibv_ah_attr, is_global);
SAME_OFFSET(AhAttr, port_num, ibv_ah_attr, port_num);
SAME_SIZE(QpAttr, ibv_qp_attr);
SAME_OFFSET(QpAttr, path_mtu, ibv_qp_attr, path_mtu);
SAME_OFFSET(QpAttr, rq_psn, ibv_qp_attr, rq_psn);
SAME_OFFSET(QpAttr, sq_psn, ibv_qp_attr, sq_psn);
SAME_OFFSET(QpAttr, dest_qp_num, ibv_qp_attr, dest_qp_num);
SAME_OFFSET(QpAttr, qp_access_flags, ibv_qp_attr, qp_access_flags);
SAME_OFFSET(QpAttr, ah_attr, ibv_qp_attr, ah_attr);
SAME_OFFSET(QpAttr, pkey_index, ibv_qp_attr, pkey_index);
SAME_OFFSET(QpAttr, max_rd_atomic, ibv_qp_attr, max_rd_atomic);
SAME_OFFSET(QpAttr, max_dest_rd_atomic, ibv_qp_attr, max_dest_rd_atomic);
SAME_OFFSET(QpAttr, min_rnr_timer, ibv_qp_attr, min_rnr_timer);
SAME_OFFSET(QpAttr, port_num, ibv_qp_attr, port_num);
SAME_OFFSET(QpAttr, timeout, ibv_qp_attr, timeout);
SAME_OFFSET(QpAttr, retry_cnt, ibv_qp_attr, retry_cnt);
SAME_OFFSET(QpAttr, rnr_retry, ibv_qp_attr, rnr_retry);
SAME_OFFSET(QpAttr, rate_limit, ibv_qp_attr, rate_limit);
SAME_SIZE(QpInitAttr, ibv_qp_init_attr);
SAME_OFFSET(QpInitAttr, send_cq, ibv_qp_init_attr, send_cq);
SAME_OFFSET(QpInitAttr, recv_cq, ibv_qp_init_attr, recv_cq);
SAME_OFFSET(QpInitAttr, cap, ibv_qp_init_attr, cap);
SAME_OFFSET(QpInitAttr, qp_type, ibv_qp_init_attr, qp_type);
SAME_OFFSET(QpInitAttr, sq_sig_all, ibv_qp_init_attr, sq_sig_all);
// The library appends fields to ibv_port_attr over releases; ours must only be large enough.
static_assert(sizeof(abi::PortAttr) >= sizeof(struct ibv_port_attr), "PortAttr too small");
SAME_OFFSET(PortAttr, port_cap_flags2, ibv_port_attr, port_cap_flags2);
SAME_OFFSET(PortAttr, state, ibv_port_attr, state);
SAME_OFFSET(PortAttr, active_mtu, ibv_port_attr, active_mtu);
SAME_OFFSET(PortAttr, gid_tbl_len, ibv_port_attr, gid_tbl_len);
SAME_OFFSET(PortAttr, lid, ibv_port_attr, lid);
SAME_OFFSET(PortAttr, link_layer, ibv_port_attr, link_layer);
SAME_OFFSET(PortAttr, flags, ibv_port_attr, flags);
SAME_SIZE(DeviceAttr, ibv_device_attr);
SAME_OFFSET(DeviceAttr, max_qp_wr, ibv_device_attr, max_qp_wr);
SAME_OFFSET(DeviceAttr, max_sge, ibv_device_attr, max_sge);
SAME_OFFSET(DeviceAttr, max_cqe, ibv_device_attr, max_cqe);
SAME_OFFSET(DeviceAttr, phys_port_cnt, ibv_device_attr, phys_port_cnt);
SAME_SIZE(SendWr, ibv_send_wr);
SAME_OFFSET(SendWr, next, ibv_send_wr, next);
SAME_OFFSET(SendWr, sg_list, ibv_send_wr, sg_list);
SAME_OFFSET(SendWr, num_sge, ibv_send_wr, num_sge);
SAME_OFFSET(SendWr, opcode, ibv_send_wr, opcode);
SAME_OFFSET(SendWr, send_flags, ibv_send_wr, send_flags);
SAME_OFFSET(SendWr, imm_data, ibv_send_wr, imm_data);
SAME_OFFSET(SendWr, wr.rdma.remote_addr, ibv_send_wr, wr.rdma.remote_addr);
SAME_OFFSET(SendWr, wr.rdma.rkey, ibv_send_wr, wr.rdma.rkey);
SAME_OFFSET(SendWr, xrc_remote_srqn, ibv_send_wr, qp_type.xrc.remote_srqn);
SAME_OFFSET(SendWr, bind_or_tso_, ibv_send_wr, bind_mw);
SAME_SIZE(RecvWr, ibv_recv_wr);
SAME_OFFSET(RecvWr, num_sge, ibv_recv_wr, num_sge);
SAME_SIZE(WorkCompletion, ibv_wc);
SAME_OFFSET(WorkCompletion, status, ibv_wc, status);
SAME_OFFSET(WorkCompletion, opcode, ibv_wc, opcode);
SAME_OFFSET(WorkCompletion, byte_len, ibv_wc, byte_len);
SAME_OFFSET(WorkCompletion, imm_data, ibv_wc, imm_data);
SAME_OFFSET(WorkCompletion, qp_num, ibv_wc, qp_num);
SAME_OFFSET(WorkCompletion, wc_flags, ibv_wc, wc_flags);

// Library-owned structures: the prefix we read.
SAME_OFFSET(Context, device, ibv_context, device);
SAME_OFFSET(Context, ops, ibv_context, ops);
SAME_SIZE(ContextOps, ibv_context_ops);
SAME_OFFSET(ContextOps, poll_cq, ibv_context_ops, poll_cq);
SAME_OFFSET(ContextOps, post_send, ibv_context_ops, post_send);
SAME_OFFSET(ContextOps, post_recv, ibv_context_ops, post_recv);
SAME_OFFSET(Pd, context, ibv_pd, context);
SAME_OFFSET(Mr, addr, ibv_mr, addr);
SAME_OFFSET(Mr, length, ibv_mr, length);
SAME_OFFSET(Mr, lkey, ibv_mr, lkey);
SAME_OFFSET(Mr, rkey, ibv_mr, rkey);
SAME_OFFSET(Cq, context, ibv_cq, context);
SAME_OFFSET(Cq, cqe, ibv_cq, cqe);
SAME_OFFSET(Qp, context, ibv_qp, context);
SAME_OFFSET(Qp, qp_num, ibv_qp, qp_num);
SAME_OFFSET(Qp, state, ibv_qp, state);
SAME_OFFSET(Qp, qp_type, ibv_qp, qp_type);

// Constants.
SAME_VALUE(abi::kPortActive, IBV_PORT_ACTIVE);
SAME_VALUE(abi::kPortDown, IBV_PORT_DOWN);
SAME_VALUE(abi::kLinkInfiniBand, IBV_LINK_LAYER_INFINIBAND);
SAME_VALUE(abi::kLinkEthernet, IBV_LINK_LAYER_ETHERNET);
SAME_VALUE(abi::kMtu256, IBV_MTU_256);
SAME_VALUE(abi::kMtu4096, IBV_MTU_4096);
SAME_VALUE(abi::kQpRc, IBV_QPT_RC);
SAME_VALUE(abi::kQpsInit, IBV_QPS_INIT);
SAME_VALUE(abi::kQpsRtr, IBV_QPS_RTR);
SAME_VALUE(abi::kQpsRts, IBV_QPS_RTS);
SAME_VALUE(abi::kQpsErr, IBV_QPS_ERR);
SAME_VALUE(abi::kAccessLocalWrite, IBV_ACCESS_LOCAL_WRITE);
SAME_VALUE(abi::kAccessRemoteWrite, IBV_ACCESS_REMOTE_WRITE);
SAME_VALUE(abi::kAccessRemoteRead, IBV_ACCESS_REMOTE_READ);
SAME_VALUE(abi::kAccessRelaxedOrdering, IBV_ACCESS_RELAXED_ORDERING);
SAME_VALUE(abi::kAttrState, IBV_QP_STATE);
SAME_VALUE(abi::kAttrAccessFlags, IBV_QP_ACCESS_FLAGS);
SAME_VALUE(abi::kAttrPkeyIndex, IBV_QP_PKEY_INDEX);
SAME_VALUE(abi::kAttrPort, IBV_QP_PORT);
SAME_VALUE(abi::kAttrAv, IBV_QP_AV);
SAME_VALUE(abi::kAttrPathMtu, IBV_QP_PATH_MTU);
SAME_VALUE(abi::kAttrTimeout, IBV_QP_TIMEOUT);
SAME_VALUE(abi::kAttrRetryCnt, IBV_QP_RETRY_CNT);
SAME_VALUE(abi::kAttrRnrRetry, IBV_QP_RNR_RETRY);
SAME_VALUE(abi::kAttrRqPsn, IBV_QP_RQ_PSN);
SAME_VALUE(abi::kAttrMaxQpRdAtomic, IBV_QP_MAX_QP_RD_ATOMIC);
SAME_VALUE(abi::kAttrMinRnrTimer, IBV_QP_MIN_RNR_TIMER);
SAME_VALUE(abi::kAttrSqPsn, IBV_QP_SQ_PSN);
SAME_VALUE(abi::kAttrMaxDestRdAtomic, IBV_QP_MAX_DEST_RD_ATOMIC);
SAME_VALUE(abi::kAttrDestQpn, IBV_QP_DEST_QPN);
SAME_VALUE(abi::kWrRdmaWrite, IBV_WR_RDMA_WRITE);
SAME_VALUE(abi::kWrRdmaWriteWithImm, IBV_WR_RDMA_WRITE_WITH_IMM);
SAME_VALUE(abi::kSendFence, IBV_SEND_FENCE);
SAME_VALUE(abi::kSendSignaled, IBV_SEND_SIGNALED);
SAME_VALUE(abi::kSendSolicited, IBV_SEND_SOLICITED);
SAME_VALUE(abi::kSendInline, IBV_SEND_INLINE);
SAME_VALUE(abi::kWcSuccess, IBV_WC_SUCCESS);
SAME_VALUE(abi::kWcWrFlushErr, IBV_WC_WR_FLUSH_ERR);
SAME_VALUE(abi::kWcRdmaWrite, IBV_WC_RDMA_WRITE);
SAME_VALUE(abi::kWcRecv, IBV_WC_RECV);
SAME_VALUE(abi::kWcRecvRdmaWithImm, IBV_WC_RECV_RDMA_WITH_IMM);
SAME_VALUE(abi::kWcWithImm, IBV_WC_WITH_IMM);

// The function types we call through the ops table match the header's slots.
static_assert(sizeof(abi::PollCqFn) == sizeof(((struct ibv_context_ops*)nullptr)->poll_cq), "");
static_assert(sizeof(abi::PostSendFn) == sizeof(((struct ibv_context_ops*)nullptr)->post_send), "");
#endif

int main() {
  // Run-time echo of the documented numbers (the header's static_asserts already hold them).
  CHECK(sizeof(abi::SendWr) == 128);
  CHECK(sizeof(abi::WorkCompletion) == 48);
  CHECK(sizeof(abi::QpAttr) == 144);
  CHECK(offsetof(abi::ContextOps, post_send) == 200);
#ifdef RESIDENT_HAVE_VERBS_H
  std::puts("test_ib_abi: ok (layouts match <infiniband/verbs.h>)");
#else
  std::puts("test_ib_abi: ok (<infiniband/verbs.h> absent: checked documented layouts only)");
#endif
  return 0;
}
