// How a buffer can be registered with the NIC. The caller classifies the pointer (on the CUDA side
// with cudaPointerGetAttributes().type, never by "which device owns it") and reports what the
// machine supports; the choice itself is a pure function, so the core stays torch- and CUDA-free.
//
//   host memory (pageable or pinned)  -> ibv_reg_mr          (works without GPUDirect RDMA)
//   device memory, dma-buf supported  -> ibv_reg_dmabuf_mr   (GPUDirect RDMA via dma-buf)
//   device memory, nvidia_peermem     -> ibv_reg_mr on the device pointer (legacy peer memory)
//   device memory otherwise, unknown  -> not registrable: stage through registered host memory
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace resident {
namespace ib {

struct VerbsApi;
namespace abi {
struct Pd;
struct Mr;
}  // namespace abi

// cudaMemoryTypeUnregistered / cudaMemoryTypeHost -> kHostMemory; cudaMemoryTypeDevice ->
// kDeviceMemory; managed memory or a failed query -> kUnknown.
enum class MemoryKind : uint8_t { kHostMemory, kDeviceMemory, kUnknown };

enum class RegMethod : uint8_t { kRegMr, kRegDmabufMr, kPeerMemRegMr, kStageThroughHost };
const char* regMethodName(RegMethod method);

struct RegCapabilities {
  // The GPU and driver export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) *and* libibverbs
  // has ibv_reg_dmabuf_mr (VerbsApi::hasDmabuf()).
  bool dmabuf_supported = false;
  // The nvidia_peermem (or older nv_peer_mem) kernel module is loaded: nvidiaPeermemLoaded().
  bool peermem_loaded = false;
};

struct RegDecision {
  RegMethod method = RegMethod::kStageThroughHost;
  std::string reason;  // one line, for logs and describe()
  bool registrable() const { return method != RegMethod::kStageThroughHost; }
};

RegDecision chooseRegistration(MemoryKind kind, const RegCapabilities& caps);

// /sys/module/nvidia_peermem or /sys/module/nv_peer_mem exists.
bool nvidiaPeermemLoaded();

// Performs `decision` (anything but kStageThroughHost) for [addr, addr + bytes) with `access`
// flags. dmabuf_fd / dmabuf_offset are used by kRegDmabufMr only (the fd of the exported
// allocation and addr's offset in it). nullptr with *why on failure (errno text included).
abi::Mr* registerMemory(const VerbsApi& api, abi::Pd* pd, const RegDecision& decision, void* addr,
                        size_t bytes, int access, int dmabuf_fd, uint64_t dmabuf_offset,
                        std::string* why);

}  // namespace ib
}  // namespace resident
