// The connection plan of the ib transport and the descriptor two ranks swap to connect.
//
// Plan: per proxy (one per communicator) one protection domain and one completion queue shared by
// every queue pair; per remote peer one RC queue pair. Every rank registers its inbox (the
// segment peers write into) once; the descriptor carries the address and rkey of that region so
// the peer can RDMA-write into it by (offset) alone, plus the landing ring used by the
// write-with-immediate completion mode. Descriptors are exchanged as strings through the c10d
// store: rank r publishes, for each peer p, the descriptor of its queue pair towards p.
#pragma once

#include <cstdint>
#include <string>

#include "core/transport/ib/ib_caps.hpp"
#include "core/transport/ib/verbs_abi.hpp"

namespace resident {
namespace ib {

struct QpDescriptor {
  uint32_t qpn = 0;  // 24 bits
  uint32_t psn = 0;  // 24 bits: the first packet sequence number this side sends
  uint16_t lid = 0;  // InfiniBand: destination LID
  abi::Gid gid{};    // RoCE (or a global IB route): the GID of the chosen index
  uint32_t mtu = 0;  // abi::Mtu, the port's active MTU; the pair uses the smaller of the two
  LinkLayer link = LinkLayer::kUnspecified;
  uint64_t inbox_addr = 0;  // the peer's inbox MR: where offsets are relative to
  uint32_t inbox_rkey = 0;
  uint64_t inbox_bytes = 0;
  uint64_t landing_addr = 0;  // the ring this side receives immediate-signal records in
  uint32_t landing_rkey = 0;
  uint32_t landing_slots = 0;  // 0 when the write-with-immediate mode is off
};

// One line of "key=value" fields after a version tag, numbers in lowercase hex:
//   "rib1 qpn=1a2 psn=3f0c1 lid=5 gid=fe80...(32 digits) mtu=5 link=ib addr=7f00.. rkey=.. ..."
std::string serializeDescriptor(const QpDescriptor& d);

// Strict inverse: the version tag first, every key exactly once, no unknown keys, hex digits only,
// values in range (qpn/psn < 2^24, mtu 1..5, link ib|eth, a 32-digit gid, inbox_bytes > 0).
// False with a reason on anything else; *out is untouched then.
bool parseDescriptor(const std::string& text, QpDescriptor* out, std::string* why);

}  // namespace ib
}  // namespace resident
