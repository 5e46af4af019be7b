#include "core/transport/ib/ib_caps.hpp"

#include "core/first_line.hpp"
#include "core/log.hpp"
#include "core/transport/ib/verbs_loader.hpp"

namespace resident {
namespace ib {
namespace {

const char* portStateName(uint32_t state) {
  switch (state) {
    case abi::kPortNop:
      return "NOP";
    case abi::kPortDown:
      return "DOWN";
    case abi::kPortInit:
      return "INIT";
    case abi::kPortArmed:
      return "ARMED";
    case abi::kPortActive:
      return "ACTIVE";
    case abi::kPortActiveDefer:
      return "ACTIVE_DEFER";
    default:
      return "UNKNOWN";
  }
}

// Preference rank of a GID entry on an Ethernet port; lower is better, -1 never.
int roceRank(const GidEntry& e) {
  if (gidIsZero(e.gid)) return -1;
  if (e.type == GidType::kRoceV2) {
    if (gidIsIpv4Mapped(e.gid)) return 0;
    return gidIsLinkLocal(e.gid) ? 2 : 1;
  }
  return 3;  // RoCE v1 or unknown: reachable on the same L2 network only
}

LinkLayer linkLayerOf(uint8_t value) {
  switch (value) {
    case abi::kLinkEthernet:
      return LinkLayer::kEthernet;
    case abi::kLinkInfiniBand:
    case abi::kLinkUnspecified:  // providers from before RoCE report nothing: InfiniBand
      return LinkLayer::kInfiniBand;
    default:
      return LinkLayer::kUnspecified;
  }
}

}  // namespace

const char* linkLayerName(LinkLayer link) {
  switch (link) {
    case LinkLayer::kInfiniBand:
      return "InfiniBand";
    case LinkLayer::kEthernet:
      return "Ethernet";
    default:
      return "unspecified";
  }
}

GidType parseGidType(const std::string& text) {
  if (text.find("RoCE v2") != std::string::npos || text.find("RoCEv2") != std::string::npos)
    return GidType::kRoceV2;
  if (text.find("IB/RoCE v1") != std::string::npos || text.find("RoCE v1") != std::string::npos)
    return GidType::kIbOrRoceV1;
  return GidType::kUnknown;
}

bool gidIsZero(const abi::Gid& gid) {
  for (uint8_t b : gid.raw)
    if (b != 0) return false;
  return true;
}

bool gidIsIpv4Mapped(const abi::Gid& gid) {
  for (int i = 0; i < 10; ++i)
    if (gid.raw[i] != 0) return false;
  return gid.raw[10] == 0xff && gid.raw[11] == 0xff;
}

bool gidIsLinkLocal(const abi::Gid& gid) {
  return gid.raw[0] == 0xfe && (gid.raw[1] & 0xc0) == 0x80;
}

std::string gidToString(const abi::Gid& gid) {
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  s.reserve(32);
  for (uint8_t b : gid.raw) {
    s.push_back(kHex[b >> 4]);
    s.push_back(kHex[b & 15]);
  }
  return s;
}

uint32_t mtuBytes(uint32_t mtu_enum) {
  return mtu_enum >= abi::kMtu256 && mtu_enum <= abi::kMtu4096 ? 128u << mtu_enum : 0;
}

int chooseGidIndex(LinkLayer link, const std::vector<GidEntry>& table, std::string* why) {
  int best = -1, best_rank = 1 << 30;
  for (const GidEntry& e : table) {
    const int rank = link == LinkLayer::kEthernet ? roceRank(e) : (gidIsZero(e.gid) ? -1 : 0);
    if (rank < 0) continue;
    if (rank < best_rank || (rank == best_rank && e.index < best)) {
      best = e.index;
      best_rank = rank;
    }
  }
  if (best < 0 && why) {
    *why = table.empty() ? "empty GID table" : "no non-zero GID entry";
    if (link == LinkLayer::kEthernet) *why += " (RoCE needs an IP address on the port's netdev)";
  }
  return best;
}

bool PortInfo::usable(std::string* why) const {
  std::string reason;
  if (!active())
    reason = std::string("state ") + portStateName(state);
  else if (link == LinkLayer::kInfiniBand && lid == 0)
    reason = "InfiniBand port without a LID (no subnet manager?)";
  else if (link == LinkLayer::kEthernet && gid_index < 0)
    reason = "RoCE port without a usable GID: " + gid_note;
  else if (link == LinkLayer::kUnspecified)
    reason = "unknown link layer";
  if (!reason.empty() && why) *why = reason;
  return reason.empty();
}

bool selectPort(const std::vector<DeviceInfo>& devices, const std::string& want_device,
                int want_port, size_t* device_index, size_t* port_index, std::string* why) {
  std::string seen;
  for (size_t d = 0; d < devices.size(); ++d) {
    const DeviceInfo& dev = devices[d];
    if (!want_device.empty() && dev.name != want_device) continue;
    for (size_t p = 0; p < dev.ports.size(); ++p) {
      const PortInfo& port = dev.ports[p];
      if (want_port != 0 && port.port != want_port) continue;
      std::string reason;
      if (port.usable(&reason)) {
        *device_index = d;
        *port_index = p;
        return true;
      }
      if (!seen.empty()) seen += "; ";
      seen += dev.name + " port " + std::to_string(port.port) + ": " + reason;
    }
  }
  if (why) {
    if (!seen.empty())
      *why = "no usable RDMA port (" + seen + ")";
    else if (!want_device.empty() || want_port != 0)
      *why = "no RDMA port matches device '" + want_device + "' port " + std::to_string(want_port);
    else
      *why = "no RDMA devices";
  }
  return false;
}

std::vector<DeviceInfo> probeDevices(std::string* why) {
  std::vector<DeviceInfo> out;
  const VerbsApi* api = verbs(why);
  if (api == nullptr) return out;
  int n = 0;
  abi::Device** list = api->get_device_list(&n);
  if (list == nullptr || n <= 0) {
    if (why) *why = "no RDMA devices (libibverbs loaded, ibv_get_device_list found none)";
    if (list) api->free_device_list(list);
    return out;
  }
  for (int i = 0; i < n; ++i) {
    DeviceInfo dev;
    const char* name = api->get_device_name(list[i]);
    dev.name = name ? name : "?";
    abi::Context* ctx = api->open_device(list[i]);
    if (ctx == nullptr) {
      RLOG_DEBUG("ib: cannot open %s", dev.name.c_str());
      continue;
    }
    abi::DeviceAttr attr{};
    if (api->query_device(ctx, &attr) == 0) {
      dev.max_qp_wr = attr.max_qp_wr;
      dev.max_sge = attr.max_sge;
      dev.max_cqe = attr.max_cqe;
      for (int p = 1; p <= attr.phys_port_cnt; ++p) {
        abi::PortAttr pa{};
        if (api->query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
        PortInfo port;
        port.port = p;
        port.state = pa.state;
        port.link = linkLayerOf(pa.link_layer);
        port.active_mtu = pa.active_mtu;
        port.lid = pa.lid;
        port.gid_tbl_len = pa.gid_tbl_len;
        std::vector<GidEntry> table;
        const std::string types = "/sys/class/infiniband/" + dev.name + "/ports/" +
                                  std::to_string(p) + "/gid_attrs/types/";
        for (int g = 0; g < pa.gid_tbl_len && g < 1024; ++g) {
          GidEntry e;
          e.index = g;
          if (api->query_gid(ctx, static_cast<uint8_t>(p), g, &e.gid) != 0 || gidIsZero(e.gid))
            continue;
          e.type = port.link == LinkLayer::kEthernet
                       ? parseGidType(readFirstLine((types + std::to_string(g)).c_str()))
                       : GidType::kIbOrRoceV1;
          table.push_back(e);
        }
        port.gid_index = chooseGidIndex(port.link, table, &port.gid_note);
        for (const GidEntry& e : table)
          if (e.index == port.gid_index) port.gid = e.gid;
        RLOG_DEBUG("ib: %s port %d: %s, %s, mtu %u, lid %u, gid index %d", dev.name.c_str(), p,
                   portStateName(port.state), linkLayerName(port.link), mtuBytes(port.active_mtu),
                   port.lid, port.gid_index);
        dev.ports.push_back(port);
      }
    }
    api->close_device(ctx);
    out.push_back(std::move(dev));
  }
  api->free_device_list(list);
  if (out.empty() && why) *why = "no RDMA device could be opened";
  return out;
}

bool ibAvailable(std::string* why) {
  std::string reason;
  const std::vector<DeviceInfo> devices = probeDevices(&reason);
  size_t d = 0, p = 0;
  if (!devices.empty() && selectPort(devices, "", 0, &d, &p, &reason)) return true;
  if (why) *why = reason.empty() ? "no RDMA devices" : reason;
  return false;
}

}  // namespace ib
}  // namespace resident
