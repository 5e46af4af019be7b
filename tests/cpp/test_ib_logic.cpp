// The ib transport's hardware-free logic: the run-time loader (unavailable here without a crash,
// with a reason), capability choices (GID index for RoCE v2, port selection), memory
// registration classification, and the connection descriptor's round trip and strict parsing.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/transport/ib/ib_caps.hpp"
#include "core/transport/ib/ib_transport.hpp"
#include "core/transport/ib/qp_desc.hpp"
#include "core/transport/ib/registration.hpp"
#include "core/transport/ib/verbs_loader.hpp"

using namespace resident::ib;

namespace {

bool contains(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

abi::Gid gidOf(std::initializer_list<int> bytes) {
  abi::Gid g{};
  size_t i = 0;
  for (int b : bytes) g.raw[i++] = static_cast<uint8_t>(b);
  return g;
}

abi::Gid ipv4Mapped(int a, int b, int c, int d) {
  return gidOf({0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d});
}

GidEntry entry(int index, abi::Gid gid, GidType type) {
  GidEntry e;
  e.index = index;
  e.gid = gid;
  e.type = type;
  return e;
}

void testLoader() {
  VerbsApi api;
  std::string why;
  CHECK(!loadVerbsFrom("libresident-no-such-library.so.7", &api, &why));
  CHECK(contains(why, "cannot load libresident-no-such-library.so.7"));
  CHECK(api.handle == nullptr && api.get_device_list == nullptr);

  // A library that exists but is not libibverbs: the first missing entry point is named.
  why.clear();
  CHECK(!loadVerbsFrom("libc.so.6", &api, &why));
  CHECK(contains(why, "lacks ibv_get_device_list"));
  CHECK(api.handle == nullptr);

  // The real one: absent on the CPU machines, present (without devices) on the GPU machine.
  std::string reason;
  const VerbsApi* real = verbs(&reason);
  if (real == nullptr) {
    CHECK(!reason.empty());
    CHECK(contains(reason, "libibverbs.so.1"));
    std::string again;
    CHECK(verbs(&again) == nullptr && again == reason);  // cached, same answer
  } else {
    CHECK(real->get_device_list != nullptr && real->create_qp != nullptr &&
          real->handle != nullptr);
  }
  std::string avail_why;
  const bool avail = ibAvailable(&avail_why);
  if (!avail) {
    CHECK(!avail_why.empty());
    if (real == nullptr) CHECK(avail_why == reason);
    // With nothing to open, the transport declines cleanly too.
    std::vector<unsigned char> inbox(4096);
    std::string t_why;
    auto t =
        IbTransport::create(IbOptions{}, 0, 2, {false, true}, inbox.data(), inbox.size(), &t_why);
    CHECK(t == nullptr);
    CHECK(!t_why.empty());
    std::printf("ib unavailable here, as expected without RDMA hardware: %s\n", avail_why.c_str());
  } else {
    std::printf("ib available on this machine\n");
  }
  if (real == nullptr) {
    std::string probe_why;
    CHECK(probeDevices(&probe_why).empty() && probe_why == reason);
  }
}

void testGidChoice() {
  std::string why;
  // RoCE: IPv4-mapped RoCE v2 beats link-local v2 and any v1, whatever the order.
  std::vector<GidEntry> t = {
      entry(0, gidOf({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}), GidType::kIbOrRoceV1),
      entry(1, gidOf({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}), GidType::kRoceV2),
      entry(2, ipv4Mapped(10, 0, 0, 1), GidType::kIbOrRoceV1),
      entry(3, ipv4Mapped(10, 0, 0, 1), GidType::kRoceV2),
      entry(4, gidOf({0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}),
            GidType::kRoceV2),
  };
  CHECK(chooseGidIndex(LinkLayer::kEthernet, t, &why) == 3);
  // Without the IPv4 one: global IPv6 v2, then link-local v2, then v1.
  t.erase(t.begin() + 3);
  CHECK(chooseGidIndex(LinkLayer::kEthernet, t, &why) == 4);
  t.pop_back();
  CHECK(chooseGidIndex(LinkLayer::kEthernet, t, &why) == 1);
  t.erase(t.begin() + 1);
  CHECK(chooseGidIndex(LinkLayer::kEthernet, t, &why) == 0);  // lowest-index v1
  // Zero entries never qualify; an empty table says why.
  std::vector<GidEntry> zeros = {entry(0, abi::Gid{}, GidType::kRoceV2)};
  why.clear();
  CHECK(chooseGidIndex(LinkLayer::kEthernet, zeros, &why) == -1);
  CHECK(contains(why, "no non-zero GID") && contains(why, "RoCE"));
  why.clear();
  CHECK(chooseGidIndex(LinkLayer::kInfiniBand, {}, &why) == -1 && contains(why, "empty"));
  // InfiniBand: the first non-zero entry, types do not matter.
  std::vector<GidEntry> ibt = {
      entry(0, abi::Gid{}, GidType::kUnknown),
      entry(1, gidOf({0xfe, 0x80, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9}), GidType::kUnknown),
      entry(2, ipv4Mapped(1, 2, 3, 4), GidType::kRoceV2)};
  CHECK(chooseGidIndex(LinkLayer::kInfiniBand, ibt, &why) == 1);

  CHECK(parseGidType("RoCE v2") == GidType::kRoceV2);
  CHECK(parseGidType("IB/RoCE v1") == GidType::kIbOrRoceV1);
  CHECK(parseGidType("") == GidType::kUnknown);
  CHECK(gidIsIpv4Mapped(ipv4Mapped(192, 168, 1, 1)) && !gidIsIpv4Mapped(abi::Gid{}));
  CHECK(gidIsLinkLocal(gidOf({0xfe, 0x80})) && !gidIsLinkLocal(ipv4Mapped(1, 1, 1, 1)));
  CHECK(gidToString(ipv4Mapped(10, 0, 0, 255)) == "00000000000000000000ffff0a0000ff");
  CHECK(mtuBytes(abi::kMtu256) == 256 && mtuBytes(abi::kMtu4096) == 4096 && mtuBytes(0) == 0 &&
        mtuBytes(6) == 0);
}

PortInfo port(int num, uint32_t state, LinkLayer link, uint16_t lid, int gid_index) {
  PortInfo p;
  p.port = num;
  p.state = state;
  p.link = link;
  p.lid = lid;
  p.gid_index = gid_index;
  p.gid_note = "no non-zero GID entry";
  return p;
}

void testPortSelection() {
  std::vector<DeviceInfo> devs(3);
  devs[0].name = "mlx5_0";
  devs[0].ports = {port(1, abi::kPortDown, LinkLayer::kInfiniBand, 0, 0)};
  devs[1].name = "mlx5_1";
  devs[1].ports = {port(1, abi::kPortActive, LinkLayer::kEthernet, 0, -1),
                   port(2, abi::kPortActive, LinkLayer::kInfiniBand, 0, 0)};
  devs[2].name = "mlx5_2";
  devs[2].ports = {port(1, abi::kPortActive, LinkLayer::kEthernet, 0, 3)};
  size_t d = 9, p = 9;
  std::string why;
  CHECK(selectPort(devs, "", 0, &d, &p, &why));
  CHECK(d == 2 && p == 0);
  // Restricted to a device with nothing usable: every port and its reason is listed.
  CHECK(!selectPort(devs, "mlx5_1", 0, &d, &p, &why));
  CHECK(contains(why, "mlx5_1 port 1: RoCE port without a usable GID"));
  CHECK(contains(why, "mlx5_1 port 2: InfiniBand port without a LID"));
  CHECK(!selectPort(devs, "mlx5_0", 0, &d, &p, &why) && contains(why, "state DOWN"));
  CHECK(!selectPort(devs, "mlx5_9", 0, &d, &p, &why) && contains(why, "mlx5_9"));
  CHECK(!selectPort(devs, "mlx5_2", 2, &d, &p, &why) && contains(why, "port 2"));
  CHECK(!selectPort({}, "", 0, &d, &p, &why) && why == "no RDMA devices");
  devs[1].ports[1].lid = 7;  // a subnet manager gave it a LID
  CHECK(selectPort(devs, "", 0, &d, &p, &why) && d == 1 && p == 1);
}

void testRegistration() {
  RegCapabilities none, dmabuf, peermem, both;
  dmabuf.dmabuf_supported = true;
  peermem.peermem_loaded = true;
  both.dmabuf_supported = both.peermem_loaded = true;
  // Host memory registers plainly whatever the GPU side supports.
  for (const RegCapabilities& c : {none, dmabuf, peermem, both}) {
    const RegDecision d = chooseRegistration(MemoryKind::kHostMemory, c);
    CHECK(d.method == RegMethod::kRegMr && d.registrable());
  }
  CHECK(chooseRegistration(MemoryKind::kDeviceMemory, dmabuf).method == RegMethod::kRegDmabufMr);
  CHECK(chooseRegistration(MemoryKind::kDeviceMemory, both).method == RegMethod::kRegDmabufMr);
  CHECK(chooseRegistration(MemoryKind::kDeviceMemory, peermem).method == RegMethod::kPeerMemRegMr);
  const RegDecision no = chooseRegistration(MemoryKind::kDeviceMemory, none);
  CHECK(no.method == RegMethod::kStageThroughHost && !no.registrable());
  CHECK(contains(no.reason, "stage through host memory"));
  for (const RegCapabilities& c : {none, dmabuf, peermem, both})
    CHECK(chooseRegistration(MemoryKind::kUnknown, c).method == RegMethod::kStageThroughHost);
  CHECK(std::strcmp(regMethodName(RegMethod::kRegDmabufMr), "ibv_reg_dmabuf_mr") == 0);
  (void)nvidiaPeermemLoaded();  // a sysfs probe; false on these machines, must not crash
}

QpDescriptor sampleDescriptor() {
  QpDescriptor d;
  d.qpn = 0xabcdef;
  d.psn = 0x123456;
  d.lid = 0xbeef;
  d.gid = ipv4Mapped(10, 1, 2, 3);
  d.mtu = abi::kMtu4096;
  d.link = LinkLayer::kEthernet;
  d.inbox_addr = 0x7f1234567000ull;
  d.inbox_rkey = 0xdeadbeef;
  d.inbox_bytes = 0x100040;
  d.landing_addr = 0x7f0000001000ull;
  d.landing_rkey = 0x1;
  d.landing_slots = 128;
  return d;
}

bool sameDescriptor(const QpDescriptor& a, const QpDescriptor& b) {
  return a.qpn == b.qpn && a.psn == b.psn && a.lid == b.lid &&
         std::memcmp(a.gid.raw, b.gid.raw, 16) == 0 && a.mtu == b.mtu && a.link == b.link &&
         a.inbox_addr == b.inbox_addr && a.inbox_rkey == b.inbox_rkey &&
         a.inbox_bytes == b.inbox_bytes && a.landing_addr == b.landing_addr &&
         a.landing_rkey == b.landing_rkey && a.landing_slots == b.landing_slots;
}

void testDescriptor() {
  const QpDescriptor d = sampleDescriptor();
  const std::string s = serializeDescriptor(d);
  CHECK(s.rfind("rib1 ", 0) == 0);
  QpDescriptor back;
  std::string why;
  CHECK(parseDescriptor(s, &back, &why));
  CHECK(sameDescriptor(d, back));
  // InfiniBand, zero fields, no landing ring.
  QpDescriptor ibd;
  ibd.mtu = abi::kMtu256;
  ibd.link = LinkLayer::kInfiniBand;
  ibd.inbox_bytes = 1;
  CHECK(parseDescriptor(serializeDescriptor(ibd), &back, &why) && sameDescriptor(ibd, back));
  // Fields in another order parse the same.
  const std::string reordered =
      "rib1 lslots=80 lrkey=1 laddr=7f0000001000 bytes=100040 rkey=deadbeef "
      "addr=7f1234567000 link=eth mtu=5 gid=00000000000000000000ffff0a010203 lid=beef "
      "psn=123456 qpn=abcdef";
  CHECK(parseDescriptor(reordered, &back, &why) && sameDescriptor(d, back));

  auto rejects = [&](const std::string& text, const char* expect) {
    QpDescriptor untouched = sampleDescriptor();
    std::string reason;
    const bool ok = parseDescriptor(text, &untouched, &reason);
    if (ok || !contains(reason, expect) || !sameDescriptor(untouched, sampleDescriptor())) {
      std::fprintf(stderr, "descriptor '%s' -> ok=%d reason '%s' (wanted '%s')\n", text.c_str(), ok,
                   reason.c_str(), expect);
      std::exit(1);
    }
  };
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string t = s;
    const size_t at = t.find(from);
    CHECK(at != std::string::npos);
    return t.replace(at, from.size(), to);
  };
  rejects("", "version");
  rejects("rib2" + s.substr(4), "version");
  rejects(s + " ", "token");
  rejects(" " + s, "version");
  rejects(replace(" psn=", "  psn="), "token");
  rejects(s + " qpn=1", "duplicate key 'qpn'");
  rejects(s + " extra=1", "unknown key 'extra'");
  rejects(replace(" lid=beef", ""), "missing key 'lid'");
  rejects(replace("qpn=abcdef", "qpn=1000000"), "qpn");  // 25 bits
  rejects(replace("psn=123456", "psn="), "psn");
  rejects(replace("psn=123456", "psn=-1"), "psn");
  rejects(replace("psn=123456", "psn=12g456"), "psn");
  rejects(replace("rkey=deadbeef", "rkey=DEADBEEF"), "rkey");  // upper case is never produced
  rejects(replace("rkey=deadbeef", "rkey=1deadbeef"), "rkey");
  rejects(replace("lid=beef", "lid=10000"), "lid");
  rejects(replace("mtu=5", "mtu=0"), "mtu");
  rejects(replace("mtu=5", "mtu=6"), "mtu");
  rejects(replace("link=eth", "link=roce"), "link");
  rejects(replace("gid=00000000000000000000ffff0a010203", "gid=0a010203"), "32 hex digits");
  rejects(replace("gid=00000000000000000000ffff0a010203", "gid=00000000000000000000ffff0a01020z"),
          "gid");
  rejects(replace("bytes=100040", "bytes=0"), "bytes");
  rejects(replace("addr=7f1234567000", "addr=12345678123456781"), "addr");  // 17 digits
  rejects(replace("laddr=7f0000001000", "laddr=0"), "landing ring without an address");
  rejects(replace("lid=beef", "lid"), "token 'lid'");
  rejects(replace("lid=beef", "=beef"), "token");
  rejects("rib1", "missing key");
}

}  // namespace

int main() {
  testLoader();
  testGidChoice();
  testPortSelection();
  testRegistration();
  testDescriptor();
  std::puts("test_ib_logic: ok");
  return 0;
}
