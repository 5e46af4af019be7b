#include "core/transport/ib/registration.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "core/log.hpp"
#include "core/transport/ib/verbs_loader.hpp"

namespace resident {
namespace ib {

const char* regMethodName(RegMethod method) {
  switch (method) {
    case RegMethod::kRegMr:
      return "ibv_reg_mr";
    case RegMethod::kRegDmabufMr:
      return "ibv_reg_dmabuf_mr";
    case RegMethod::kPeerMemRegMr:
      return "ibv_reg_mr (nvidia_peermem)";
    case RegMethod::kStageThroughHost:
      return "stage through host memory";
  }
  return "?";
}

RegDecision chooseRegistration(MemoryKind kind, const RegCapabilities& caps) {
  RegDecision d;
  switch (kind) {
    case MemoryKind::kHostMemory:
      d.method = RegMethod::kRegMr;
      d.reason = "host memory: ibv_reg_mr (no GPUDirect RDMA needed)";
      break;
    case MemoryKind::kDeviceMemory:
      if (caps.dmabuf_supported) {
        d.method = RegMethod::kRegDmabufMr;
        d.reason = "device memory: dma-buf registration (GPUDirect RDMA)";
      } else if (caps.peermem_loaded) {
        d.method = RegMethod::kPeerMemRegMr;
        d.reason = "device memory: peer-memory registration through nvidia_peermem";
      } else {
        d.method = RegMethod::kStageThroughHost;
        d.reason =
            "device memory not registrable (no dma-buf support, nvidia_peermem not loaded): "
            "stage through host memory";
      }
      break;
    case MemoryKind::kUnknown:
      d.method = RegMethod::kStageThroughHost;
      d.reason = "memory of unknown kind: not registered, stage through host memory";
      break;
  }
  return d;
}

bool nvidiaPeermemLoaded() {
  struct stat st;
  return ::stat("/sys/module/nvidia_peermem", &st) == 0 ||
         ::stat("/sys/module/nv_peer_mem", &st) == 0;
}

abi::Mr* registerMemory(const VerbsApi& api, abi::Pd* pd, const RegDecision& decision, void* addr,
                        size_t bytes, int access, int dmabuf_fd, uint64_t dmabuf_offset,
                        std::string* why) {
  abi::Mr* mr = nullptr;
  errno = 0;
  switch (decision.method) {
    case RegMethod::kRegMr:
    case RegMethod::kPeerMemRegMr:
      mr = api.reg_mr(pd, addr, bytes, access);
      break;
    case RegMethod::kRegDmabufMr:
      if (api.reg_dmabuf_mr == nullptr) {
        if (why) *why = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than v34)";
        return nullptr;
      }
      mr = api.reg_dmabuf_mr(pd, dmabuf_offset, bytes, reinterpret_cast<uintptr_t>(addr), dmabuf_fd,
                             access);
      break;
    case RegMethod::kStageThroughHost:
      if (why) *why = decision.reason;
      return nullptr;
  }
  if (mr == nullptr) {
    const int err = errno;
    if (why)
      *why = std::string(regMethodName(decision.method)) + " of " + std::to_string(bytes) +
             " bytes failed: " + (err ? std::strerror(err) : "unknown error");
    return nullptr;
  }
  RLOG_DEBUG("ib: registered %zu bytes at %p with %s (lkey 0x%x rkey 0x%x)", bytes, addr,
             regMethodName(decision.method), mr->lkey, mr->rkey);
  return mr;
}

}  // namespace ib
}  // namespace resident
