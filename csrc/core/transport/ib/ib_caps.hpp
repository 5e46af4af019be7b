// What RDMA hardware this machine has: devices, ports, their state and link layer (InfiniBand or
// Ethernet, i.e. RoCE), and which GID a RoCE v2 connection should use. The choices are pure
// functions over plain descriptions (unit-tested without hardware); probeDevices() fills those
// descriptions through the run-time loaded verbs, and ibAvailable() is the one question the
// transport choice asks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/transport/ib/verbs_abi.hpp"

namespace resident {
namespace ib {

enum class LinkLayer : uint8_t { kUnspecified = 0, kInfiniBand = 1, kEthernet = 2 };
const char* linkLayerName(LinkLayer link);

// How a GID table entry may be used (sysfs gid_attrs/types: "IB/RoCE v1" or "RoCE v2").
enum class GidType : uint8_t { kUnknown, kIbOrRoceV1, kRoceV2 };
GidType parseGidType(const std::string& sysfs_text);

struct GidEntry {
  int index = 0;
  abi::Gid gid{};
  GidType type = GidType::kUnknown;
};

// The GID index a connection on a port of this link layer should use, or -1 with *why.
// InfiniBand: the first non-zero entry (connections route by LID; the GID is only carried).
// Ethernet (RoCE): a RoCE v2 entry (routable UDP/IP) in this order of preference: IPv4-mapped
// address, global IPv6, link-local IPv6; then, when no v2 entry exists, a RoCE v1 / unknown one.
// Empty (all-zero) entries never qualify; ties go to the lowest index.
int chooseGidIndex(LinkLayer link, const std::vector<GidEntry>& table, std::string* why);

bool gidIsZero(const abi::Gid& gid);
bool gidIsIpv4Mapped(const abi::Gid& gid);
bool gidIsLinkLocal(const abi::Gid& gid);
std::string gidToString(const abi::Gid& gid);  // 32 lowercase hex digits

// Bytes of an ibv_mtu value (1..5 -> 256..4096), 0 for anything else.
uint32_t mtuBytes(uint32_t mtu_enum);

struct PortInfo {
  int port = 0;
  uint32_t state = 0;  // abi::PortState
  LinkLayer link = LinkLayer::kUnspecified;
  uint32_t active_mtu = 0;  // abi::Mtu
  uint16_t lid = 0;
  int gid_tbl_len = 0;
  int gid_index = -1;    // chooseGidIndex's answer
  abi::Gid gid{};        // the entry at gid_index
  std::string gid_note;  // why no GID qualified, when gid_index < 0

  bool active() const { return state == abi::kPortActive; }
  // Active, and addressable: InfiniBand with a LID, or Ethernet with a chosen GID.
  bool usable(std::string* why) const;
};

struct DeviceInfo {
  std::string name;
  int max_qp_wr = 0;
  int max_sge = 0;
  int max_cqe = 0;
  std::vector<PortInfo> ports;
};

// Picks a usable (device, port): the first in listing order, restricted to `want_device` /
// `want_port` when those are non-empty / non-zero. False with a reason that lists every port
// looked at and why it was passed over.
bool selectPort(const std::vector<DeviceInfo>& devices, const std::string& want_device,
                int want_port, size_t* device_index, size_t* port_index, std::string* why);

// Lists the devices and ports through libibverbs (opening and closing each device). Empty with
// *why when libibverbs is missing or lists no device.
std::vector<DeviceInfo> probeDevices(std::string* why);

// Does this machine have an active, addressable RDMA port? False with the reason otherwise
// ("cannot load libibverbs.so.1: ...", "no RDMA devices", "mlx5_0 port 1: state DOWN", ...).
bool ibAvailable(std::string* why);

}  // namespace ib
}  // namespace resident
