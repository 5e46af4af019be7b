#include "core/config.hpp"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "core/error.hpp"

namespace resident {
namespace {

uint64_t parseUnsigned(const std::string& key, const std::string& value, uint64_t min,
                       uint64_t max) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0 || v < min || v > max) {
    throw InvalidArgument("resident: invalid value '" + value + "' for " + key +
                          " (expected an integer in [" + std::to_string(min) + ", " +
                          std::to_string(max) + "])");
  }
  return v;
}

// A byte limit that can also be "off" (then `off_value`), as limitName prints it back.
uint64_t parseLimit(const std::string& key, const std::string& value, uint64_t max,
                    uint64_t off_value) {
  if (value == "off") return off_value;
  try {
    return parseUnsigned(key, value, 0, max);
  } catch (const InvalidArgument&) {
    std::string var = "RESIDENT_" + key;
    for (char& ch : var) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    throw InvalidArgument("resident: " + var + " must be off or a byte count in [0, " +
                          std::to_string(max) + "], got '" + value + "'");
  }
}

void apply(Config& c, const std::string& key, const std::string& value) {
  if (key == "path") {
    if (value == "auto")
      c.path = PathMode::kAuto;
    else if (value == "direct")
      c.path = PathMode::kDirect;
    else if (value == "proxy")
      c.path = PathMode::kProxy;
    else
      throw InvalidArgument("resident: RESIDENT_PATH must be auto, direct or proxy, got '" + value +
                            "'");
  } else if (key == "slot_bytes") {
    // Multiple of 64 so that every element type stays aligned inside a slot.
    c.slot_bytes = static_cast<uint32_t>(parseUnsigned(key, value, 64, 64u << 20)) & ~63u;
  } else if (key == "slots") {
    c.slots = static_cast<uint32_t>(parseUnsigned(key, value, 2, 1024));
  } else if (key == "max_inflight") {
    c.max_inflight = static_cast<uint32_t>(parseUnsigned(key, value, 4, 1u << 16));
  } else if (key == "spin_us") {
    c.spin_us = parseUnsigned(key, value, 0, 60000000);
  } else if (key == "yield_us") {
    c.yield_us = parseUnsigned(key, value, 0, 60000000);
  } else if (key == "max_sleep_us") {
    c.max_sleep_us = parseUnsigned(key, value, 1, 1000000);
  } else if (key == "proxy_spin_us") {
    c.proxy_spin_us = parseUnsigned(key, value, 0, 60000000);
  } else if (key == "proxy_cpu") {
    c.proxy_cpu = value == "-1" ? -1 : static_cast<int>(parseUnsigned(key, value, 0, 65535));
  } else if (key == "transport") {
    if (value != "auto" && value != "shm" && value != "tcp" && value != "ib")
      throw InvalidArgument("resident: RESIDENT_TRANSPORT must be auto, shm, tcp or ib, got '" +
                            value + "'");
    c.transport = value;
  } else if (key == "gpu_proxy_trace") {
    c.gpu_proxy_trace = value;  // a path prefix; opened when the group is destroyed
  } else if (key == "tcp_addr") {
    c.tcp_addr = value;  // checked when the tcp transport listens
  } else if (key == "gpu_chunk_bytes") {
    // A multiple of the 2 KiB part a thread block moves per round.
    c.gpu_chunk_bytes = static_cast<uint32_t>(parseUnsigned(key, value, 2048, 1u << 20)) & ~2047u;
  } else if (key == "gpu_max_blocks") {
    c.gpu_max_blocks = static_cast<uint32_t>(parseUnsigned(key, value, 0, 64));
  } else if (key == "gpu_proxy_spin_us") {
    c.gpu_proxy_spin_us = parseUnsigned(key, value, 0, 600000000);
  } else if (key == "gpu_prefetch") {
    c.gpu_prefetch = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_one_round") {
    c.gpu_one_round = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_trigger_fence") {
    c.gpu_trigger_fence = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_trigger_fence_from") {
    c.gpu_trigger_fence_from = parseLimit(key, value, uint64_t{1} << 32, UINT64_MAX);
  } else if (key == "gpu_proxy_prefetch_bytes") {
    c.gpu_proxy_prefetch_bytes = static_cast<uint32_t>(parseUnsigned(key, value, 0, 1u << 16));
  } else if (key == "gpu_proxy_fused_check") {
    c.gpu_proxy_fused_check = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_proxy_streaming") {
    c.gpu_proxy_streaming = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_pdl") {
    c.gpu_pdl = parseUnsigned(key, value, 0, 1) == 1;
  } else if (key == "gpu_p2p_stream") {
    if (value != "auto" && value != "own")
      throw InvalidArgument("resident: RESIDENT_GPU_P2P_STREAM must be auto or own, got '" + value +
                            "'");
    c.gpu_p2p_lazy = value == "auto";
  } else if (key == "gpu_protocol") {
    if (value != "ll" && value != "simple")
      throw InvalidArgument("resident: RESIDENT_GPU_PROTOCOL must be ll or simple, got '" + value +
                            "'");
    c.gpu_protocol_simple = value == "simple";
  } else if (key == "gpu_proxy_simple_above") {
    c.gpu_proxy_simple_above =
        static_cast<uint32_t>(parseLimit(key, value, 1u << 20, kGpuSimpleNever));
  } else if (key == "debug") {
    // Handled by the logger (RESIDENT_DEBUG); accepted here so that it is not an error.
  } else {
    throw InvalidArgument("resident: unknown option '" + key + "'");
  }
}

const char* kKeys[] = {"path",
                       "slot_bytes",
                       "slots",
                       "max_inflight",
                       "spin_us",
                       "yield_us",
                       "max_sleep_us",
                       "proxy_spin_us",
                       "proxy_cpu",
                       "transport",
                       "gpu_chunk_bytes",
                       "gpu_max_blocks",
                       "gpu_proxy_spin_us",
                       "gpu_pdl",
                       "gpu_prefetch",
                       "gpu_one_round",
                       "gpu_trigger_fence",
                       "gpu_trigger_fence_from",
                       "gpu_proxy_prefetch_bytes",
                       "gpu_proxy_fused_check",
                       "gpu_proxy_streaming",
                       "gpu_p2p_stream",
                       "gpu_protocol",
                       "gpu_proxy_simple_above",
                       "gpu_proxy_trace",
                       "tcp_addr"};

// The persistent-kernel mode's names. The backend has no such mode (a kernel per op was
// measured faster, docs/decisions.md); setting one fails the group's creation rather than
// being ignored, so that a script written for the mode does not silently measure another one.
const char* kRemovedKeys[] = {"gpu_persistent", "gpu_persistent_blocks", "gpu_persistent_idle_us",
                              "gpu_persistent_slots", "gpu_persistent_graphs"};

std::string variableName(const char* key) {
  std::string var = "RESIDENT_";
  for (const char* p = key; *p; ++p) var += static_cast<char>(std::toupper(*p));
  return var;
}

void rejectRemoved(const std::string& name, const char* remedy) {
  throw InvalidArgument("resident: " + name +
                        " is not supported: the persistent-kernel mode was removed from "
                        "resident_pg because a kernel per op was measured faster (see "
                        "docs/decisions.md); " +
                        remedy);
}

}  // namespace

Config Config::fromEnvironment(const std::map<std::string, std::string>& options) {
  for (const char* key : kRemovedKeys) {
    const std::string var = variableName(key);
    if (std::getenv(var.c_str()) != nullptr) rejectRemoved(var, "unset it");
  }
  for (const auto& kv : options)
    for (const char* key : kRemovedKeys)
      if (kv.first == key)
        rejectRemoved("option '" + kv.first + "' (" + variableName(key) + ")",
                      "leave it out of pg_options");
  Config c;
  for (const char* key : kKeys) {
    std::string var = "RESIDENT_";
    for (const char* p = key; *p; ++p) var += static_cast<char>(std::toupper(*p));
    if (const char* v = std::getenv(var.c_str())) apply(c, key, v);
  }
  for (const auto& kv : options) apply(c, kv.first, kv.second);
  return c;
}

std::string Config::describe() const {
  return std::string("path=") + pathModeName(path) + " slot_bytes=" + std::to_string(slot_bytes) +
         " slots=" + std::to_string(slots) + " max_inflight=" + std::to_string(max_inflight) +
         " spin_us=" + std::to_string(spin_us) + " yield_us=" + std::to_string(yield_us) +
         " max_sleep_us=" + std::to_string(max_sleep_us) +
         " proxy_spin_us=" + std::to_string(proxy_spin_us) +
         " proxy_cpu=" + std::to_string(proxy_cpu) + " transport=" + transport +
         (tcp_addr.empty() ? "" : " tcp_addr=" + tcp_addr) +
         " gpu_chunk_bytes=" + std::to_string(gpu_chunk_bytes) +
         " gpu_max_blocks=" + std::to_string(gpu_max_blocks) +
         " gpu_proxy_spin_us=" + std::to_string(gpu_proxy_spin_us) +
         " gpu_pdl=" + (gpu_pdl ? "1" : "0") + " gpu_prefetch=" + (gpu_prefetch ? "1" : "0") +
         " gpu_one_round=" + (gpu_one_round ? "1" : "0") +
         " gpu_trigger_fence=" + (gpu_trigger_fence ? "1" : "0") +
         " gpu_trigger_fence_from=" + limitName(gpu_trigger_fence_from, UINT64_MAX) +
         " gpu_proxy_prefetch_bytes=" + std::to_string(gpu_proxy_prefetch_bytes) +
         " gpu_proxy_fused_check=" + (gpu_proxy_fused_check ? "1" : "0") +
         " gpu_proxy_streaming=" + (gpu_proxy_streaming ? "1" : "0") +
         " gpu_p2p_stream=" + (gpu_p2p_lazy ? "auto" : "own") +
         " gpu_protocol=" + (gpu_protocol_simple ? "simple" : "ll") +
         " gpu_proxy_simple_above=" + limitName(gpu_proxy_simple_above, kGpuSimpleNever) +
         (gpu_proxy_trace.empty() ? "" : " gpu_proxy_trace=" + gpu_proxy_trace);
}

std::string limitName(uint64_t value, uint64_t off_value) {
  return value == off_value ? std::string("off") : std::to_string(value);
}

const char* pathModeName(PathMode mode) {
  switch (mode) {
    case PathMode::kAuto:
      return "auto";
    case PathMode::kDirect:
      return "direct";
    case PathMode::kProxy:
      return "proxy";
  }
  return "?";
}

}  // namespace resident
