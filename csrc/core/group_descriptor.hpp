// What a rank tells every other rank of its group at creation (the store key "resident/desc"):
// where its inbox is, how its peers reach it, and the settings that every rank must share. Both
// ranks of a pair derive the pair's rings, protocol and rounds from their own settings, so a
// setting that differs would only show as ranks falling out of step; creation fails instead,
// naming the setting.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.hpp"

namespace resident {

struct GroupDescriptor {
  std::string inbox;         // its segment's name
  uint64_t inbox_bytes = 0;  // and size
  std::string tcp_endpoint;  // where its tcp listener is, or "-"
  bool ib = false;           // it has an active RDMA port
  std::string path;          // its RESIDENT_PATH (pathModeName): "proxy" makes every peer of
                             // it proxied
  // The settings every rank must share, as text.
  std::string slots;          // RESIDENT_SLOTS
  std::string slot_bytes;     // RESIDENT_SLOT_BYTES
  std::string transport;      // RESIDENT_TRANSPORT
  std::string gpu_protocol;   // the CUDA path's protocol rule: "ll" or "simple/<path>"
  std::string handoff_bytes;  // RESIDENT_HANDOFF_BYTES
  std::string gpu_rounds;     // the CUDA path's rounds: "<chunk>/<first round>"
};

// This rank's descriptor from its settings and its inbox.
GroupDescriptor localDescriptor(const Config& cfg, const std::string& inbox, uint64_t inbox_bytes,
                                const std::string& tcp_endpoint, bool ib);

// The text that travels through the store, and back; decodeDescriptor throws CommError naming
// `from_rank` for a text that is not a descriptor.
std::string encodeDescriptor(const GroupDescriptor& d);
GroupDescriptor decodeDescriptor(const std::string& text, int from_rank);

// Throws InvalidArgument naming the first shared setting in which `theirs` (rank their_rank)
// differs from `mine` (rank my_rank), with both values.
void checkSharedSettings(const GroupDescriptor& mine, int my_rank, const GroupDescriptor& theirs,
                         int their_rank);

}  // namespace resident
