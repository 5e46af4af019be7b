#include "core/transport/ib/verbs_loader.hpp"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "core/log.hpp"

namespace resident {
namespace ib {
namespace {

// dlsym into a typed function pointer (POSIX guarantees the object/function pointer round trip).
template <typename Fn>
bool resolve(void* handle, const char* name, Fn* out, bool required, std::string* why) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    if (required && why != nullptr && why->empty())
      *why = std::string("libibverbs lacks ") + name + " (rdma-core too old or not libibverbs)";
    *out = nullptr;
    return !required;
  }
  *out = reinterpret_cast<Fn>(sym);
  return true;
}

}  // namespace

std::string VerbsApi::statusText(uint32_t status) const {
  const char* text = wc_status_str ? wc_status_str(static_cast<int>(status)) : nullptr;
  return (text ? std::string(text) + " " : std::string()) + "(status " + std::to_string(status) +
         ")";
}

bool loadVerbsFrom(const char* library, VerbsApi* api, std::string* why) {
  std::string reason;
  *api = VerbsApi();
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    reason = std::string("cannot load ") + library + ": " + (err ? err : "unknown dlopen error");
    if (why) *why = reason;
    RLOG_DEBUG("ib: %s", reason.c_str());
    return false;
  }
  bool ok = true;
  ok &= resolve(handle, "ibv_get_device_list", &api->get_device_list, true, &reason);
  ok &= resolve(handle, "ibv_free_device_list", &api->free_device_list, true, &reason);
  ok &= resolve(handle, "ibv_get_device_name", &api->get_device_name, true, &reason);
  ok &= resolve(handle, "ibv_open_device", &api->open_device, true, &reason);
  ok &= resolve(handle, "ibv_close_device", &api->close_device, true, &reason);
  ok &= resolve(handle, "ibv_query_device", &api->query_device, true, &reason);
  ok &= resolve(handle, "ibv_query_port", &api->query_port, true, &reason);
  ok &= resolve(handle, "ibv_query_gid", &api->query_gid, true, &reason);
  ok &= resolve(handle, "ibv_alloc_pd", &api->alloc_pd, true, &reason);
  ok &= resolve(handle, "ibv_dealloc_pd", &api->dealloc_pd, true, &reason);
  ok &= resolve(handle, "ibv_reg_mr", &api->reg_mr, true, &reason);
  ok &= resolve(handle, "ibv_dereg_mr", &api->dereg_mr, true, &reason);
  ok &= resolve(handle, "ibv_create_cq", &api->create_cq, true, &reason);
  ok &= resolve(handle, "ibv_destroy_cq", &api->destroy_cq, true, &reason);
  ok &= resolve(handle, "ibv_create_qp", &api->create_qp, true, &reason);
  ok &= resolve(handle, "ibv_modify_qp", &api->modify_qp, true, &reason);
  ok &= resolve(handle, "ibv_destroy_qp", &api->destroy_qp, true, &reason);
  resolve(handle, "ibv_reg_dmabuf_mr", &api->reg_dmabuf_mr, false, &reason);
  resolve(handle, "ibv_wc_status_str", &api->wc_status_str, false, &reason);
  if (!ok) {
    dlclose(handle);
    *api = VerbsApi();
    if (why) *why = reason;
    RLOG_DEBUG("ib: %s: %s", library, reason.c_str());
    return false;
  }
  api->handle = handle;
  api->library = library;
  RLOG_DEBUG("ib: loaded %s (dma-buf registration %s)", library,
             api->hasDmabuf() ? "available" : "unavailable");
  return true;
}

namespace {
std::atomic<const VerbsApi*> g_testing_api{nullptr};
}  // namespace

void setVerbsForTesting(const VerbsApi* api) {
  g_testing_api.store(api);
}

const VerbsApi* verbs(std::string* why) {
  if (const VerbsApi* fake = g_testing_api.load()) return fake;
  static std::once_flag once;
  static VerbsApi api;
  static bool ok = false;
  static std::string reason;
  std::call_once(once, [] { ok = loadVerbsFrom("libibverbs.so.1", &api, &reason); });
  if (!ok) {
    if (why) *why = reason;
    return nullptr;
  }
  return &api;
}

}  // namespace ib
}  // namespace resident
