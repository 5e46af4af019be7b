// libibverbs, loaded at run time. The extension never links against rdma-core: where
// libibverbs.so.1 (or one of the entry points below) is missing, ib is unavailable and the
// reason says why; nothing else changes. The hot-path calls (post_send, post_recv, poll_cq) are
// static inlines in verbs.h that jump through the context's ops table; postSend / postRecv /
// pollCq below do the same, so they cost one indirect call, as in a program built with verbs.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/transport/ib/verbs_abi.hpp"

namespace resident {
namespace ib {

// The exported entry points used (all IBVERBS_1.1 unless noted).
struct VerbsApi {
  abi::Device** (*get_device_list)(int* num) = nullptr;
  void (*free_device_list)(abi::Device** list) = nullptr;
  const char* (*get_device_name)(abi::Device* dev) = nullptr;
  abi::Context* (*open_device)(abi::Device* dev) = nullptr;
  int (*close_device)(abi::Context* ctx) = nullptr;
  int (*query_device)(abi::Context* ctx, abi::DeviceAttr* attr) = nullptr;
  int (*query_port)(abi::Context* ctx, uint8_t port, abi::PortAttr* attr) = nullptr;
  int (*query_gid)(abi::Context* ctx, uint8_t port, int index, abi::Gid* gid) = nullptr;
  abi::Pd* (*alloc_pd)(abi::Context* ctx) = nullptr;
  int (*dealloc_pd)(abi::Pd* pd) = nullptr;
  abi::Mr* (*reg_mr)(abi::Pd* pd, void* addr, size_t length, int access) = nullptr;
  int (*dereg_mr)(abi::Mr* mr) = nullptr;
  abi::Cq* (*create_cq)(abi::Context* ctx, int cqe, void* cq_context, abi::CompChannel* channel,
                        int comp_vector) = nullptr;
  int (*destroy_cq)(abi::Cq* cq) = nullptr;
  abi::Qp* (*create_qp)(abi::Pd* pd, abi::QpInitAttr* attr) = nullptr;
  int (*modify_qp)(abi::Qp* qp, abi::QpAttr* attr, int mask) = nullptr;
  int (*destroy_qp)(abi::Qp* qp) = nullptr;
  // Optional: dma-buf registration (IBVERBS_1.12, rdma-core v34+) and status text.
  abi::Mr* (*reg_dmabuf_mr)(abi::Pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                            int access) = nullptr;
  const char* (*wc_status_str)(int status) = nullptr;

  void* handle = nullptr;  // dlopen handle; never closed (providers keep references)
  std::string library;     // what was opened

  bool hasDmabuf() const { return reg_dmabuf_mr != nullptr; }
  // Text of a completion status ("status 12" without the optional symbol).
  std::string statusText(uint32_t status) const;
};

// Opens `library` and resolves every required entry point into *api. On failure returns false
// with a one-line reason in *why (the dlerror text, or the missing symbol) and closes the
// library again. Used by the process-wide loader below and by tests with other names.
bool loadVerbsFrom(const char* library, VerbsApi* api, std::string* why);

// The process-wide table: tries "libibverbs.so.1" once (thread-safe) and caches the outcome.
// Returns nullptr when unavailable; *why (if given) receives the cached reason.
const VerbsApi* verbs(std::string* why = nullptr);

// Tests only: verbs() returns `api` from now on (a software NIC), nullptr restores the loader's
// answer. Call it while no transport exists.
void setVerbsForTesting(const VerbsApi* api);

// The verbs.h inlines, through the ops table of the object's context.
inline int postSend(abi::Qp* qp, abi::SendWr* wr, abi::SendWr** bad) {
  return qp->context->ops.post_send(qp, wr, bad);
}
inline int postRecv(abi::Qp* qp, abi::RecvWr* wr, abi::RecvWr** bad) {
  return qp->context->ops.post_recv(qp, wr, bad);
}
inline int pollCq(abi::Cq* cq, int n, abi::WorkCompletion* wc) {
  return cq->context->ops.poll_cq(cq, n, wc);
}

}  // namespace ib
}  // namespace resident
