#include "core/op.hpp"

namespace resident {

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kGather:
      return "gather";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
  }
  return "unknown-op";
}

std::string describeSignature(uint32_t signature) {
  const auto kind = static_cast<OpKind>(signature >> 16);
  const auto dtype = static_cast<DType>((signature >> 8) & 0xff);
  const auto redop = static_cast<RedOp>(signature & 0xff);
  std::string s = opKindName(kind);
  if (dtype != DType::kBytes) s += std::string(" ") + dtypeName(dtype);
  if (redop != RedOp::kNone) s += std::string(" ") + redOpName(redop);
  return s;
}

std::string Op::describe() const {
  std::string s = describeSignature(signature());
  if (kind == OpKind::kSend || kind == OpKind::kRecv) {
    s += std::string(" (") + (kind == OpKind::kSend ? "to" : "from") +
         (peer < 0 ? std::string(" any rank") : " rank " + std::to_string(peer)) + ", tag " +
         std::to_string(seq) + ", " + std::to_string(bytes) + " bytes)";
  } else {
    s += " (op #" + std::to_string(seq) + ", " + std::to_string(bytes) + " bytes)";
  }
  return s;
}

}  // namespace resident
