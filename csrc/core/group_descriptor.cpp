#include "core/group_descriptor.hpp"

#include <cstdlib>
#include <vector>

#include "core/error.hpp"

namespace resident {
namespace {

// The fields of the text, in order.
enum Field : size_t {
  kInbox,
  kInboxBytes,
  kSlots,
  kSlotBytes,
  kTransport,
  kEndpoint,
  kIb,
  kPath,
  kProtocol,
  kHandoff,
  kRounds,
  kFields
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t pos; (pos = s.find(sep, start)) != std::string::npos; start = pos + 1)
    out.push_back(s.substr(start, pos - start));
  out.push_back(s.substr(start));
  return out;
}

std::string describeProtocolKey(const std::string& key) {
  if (key.rfind("simple/", 0) == 0)
    return "RESIDENT_GPU_PROTOCOL=simple with RESIDENT_PATH=" + key.substr(7);
  return "RESIDENT_GPU_PROTOCOL=" + key;
}

std::string describeRoundsKey(const std::string& key) {
  const size_t slash = key.find('/');
  return "RESIDENT_GPU_CHUNK_BYTES=" + key.substr(0, slash) +
         " RESIDENT_GPU_FIRST_ROUND=" + (slash == std::string::npos ? "?" : key.substr(slash + 1));
}

// The simple protocol is chosen per pair on the device from its path, so both ranks of a pair
// must see the same rule.
std::string gpuProtocolKey(const Config& cfg) {
  return cfg.gpu_protocol == GpuProtocol::kSimple ? std::string("simple/") + pathModeName(cfg.path)
                                                  : "ll";
}

// Both ranks of a pair cut a message into rounds of the chunk and number them from the first.
std::string gpuRoundsKey(const Config& cfg) {
  return std::to_string(cfg.gpu_chunk_bytes) + "/" + std::to_string(cfg.gpu_first_round);
}

[[noreturn]] void differ(int their_rank, const std::string& theirs, int my_rank,
                         const std::string& mine) {
  throw InvalidArgument("resident: rank " + std::to_string(their_rank) + " uses " + theirs +
                        " but rank " + std::to_string(my_rank) + " uses " + mine +
                        "; all ranks must agree");
}

}  // namespace

GroupDescriptor localDescriptor(const Config& cfg, const std::string& inbox, uint64_t inbox_bytes,
                                const std::string& tcp_endpoint, bool ib) {
  GroupDescriptor d;
  d.inbox = inbox;
  d.inbox_bytes = inbox_bytes;
  d.tcp_endpoint = tcp_endpoint;
  d.ib = ib;
  d.path = pathModeName(cfg.path);
  d.slots = std::to_string(cfg.slots);
  d.slot_bytes = std::to_string(cfg.slot_bytes);
  d.transport = cfg.transport;
  d.gpu_protocol = gpuProtocolKey(cfg);
  d.handoff_bytes = std::to_string(cfg.handoff_bytes);
  d.gpu_rounds = gpuRoundsKey(cfg);
  return d;
}

std::string encodeDescriptor(const GroupDescriptor& d) {
  return d.inbox + "|" + std::to_string(d.inbox_bytes) + "|" + d.slots + "|" + d.slot_bytes + "|" +
         d.transport + "|" + d.tcp_endpoint + "|" + (d.ib ? "ib" : "-") + "|" + d.path + "|" +
         d.gpu_protocol + "|" + d.handoff_bytes + "|" + d.gpu_rounds;
}

GroupDescriptor decodeDescriptor(const std::string& text, int from_rank) {
  const auto f = split(text, '|');
  char* end = nullptr;
  const unsigned long long bytes =
      f.size() == kFields ? std::strtoull(f[kInboxBytes].c_str(), &end, 10) : 0;
  if (f.size() != kFields || f[kInboxBytes].empty() || *end != '\0')
    throw CommError("resident: malformed descriptor from rank " + std::to_string(from_rank));
  GroupDescriptor d;
  d.inbox = f[kInbox];
  d.inbox_bytes = bytes;
  d.slots = f[kSlots];
  d.slot_bytes = f[kSlotBytes];
  d.transport = f[kTransport];
  d.tcp_endpoint = f[kEndpoint];
  d.ib = f[kIb] == "ib";
  d.path = f[kPath];
  d.gpu_protocol = f[kProtocol];
  d.handoff_bytes = f[kHandoff];
  d.gpu_rounds = f[kRounds];
  return d;
}

void checkSharedSettings(const GroupDescriptor& mine, int my_rank, const GroupDescriptor& theirs,
                         int their_rank) {
  if (theirs.slots != mine.slots || theirs.slot_bytes != mine.slot_bytes) {
    differ(their_rank,
           "RESIDENT_SLOTS=" + theirs.slots + " RESIDENT_SLOT_BYTES=" + theirs.slot_bytes, my_rank,
           mine.slots + "/" + mine.slot_bytes);
  }
  if (theirs.transport != mine.transport)
    differ(their_rank, "RESIDENT_TRANSPORT=" + theirs.transport, my_rank, mine.transport);
  if (theirs.gpu_protocol != mine.gpu_protocol) {
    differ(their_rank, describeProtocolKey(theirs.gpu_protocol), my_rank,
           describeProtocolKey(mine.gpu_protocol));
  }
  // The hand-off's set-up (resident_pg/handoff.py) is one exchange that every rank joins, or
  // none: ranks that differ fail here, at once, instead of waiting for each other.
  if (theirs.handoff_bytes != mine.handoff_bytes)
    differ(their_rank, "RESIDENT_HANDOFF_BYTES=" + theirs.handoff_bytes, my_rank,
           mine.handoff_bytes);
  if (theirs.gpu_rounds != mine.gpu_rounds) {
    differ(their_rank, describeRoundsKey(theirs.gpu_rounds), my_rank,
           describeRoundsKey(mine.gpu_rounds));
  }
}

}  // namespace resident
