#include "core/transport/ib/qp_desc.hpp"

#include <cstring>
#include <vector>

namespace resident {
namespace ib {
namespace {

constexpr const char* kVersion = "rib1";

std::string hex(uint64_t v) {
  static const char kHex[] = "0123456789abcdef";
  char buf[17];
  int n = 16;
  buf[n] = '\0';
  do {
    buf[--n] = kHex[v & 15];
    v >>= 4;
  } while (v != 0);
  return std::string(buf + n);
}

int hexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // upper case is not produced, so not accepted either
}

bool parseHex(const std::string& s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    const int d = hexDigit(c);
    if (d < 0) return false;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  if (v > max) return false;
  *out = v;
  return true;
}

enum Field {
  kQpn,
  kPsn,
  kLid,
  kGid,
  kMtu,
  kLink,
  kAddr,
  kRkey,
  kBytes,
  kLAddr,
  kLRkey,
  kLSlots,
  kFields
};
const char* const kNames[kFields] = {"qpn",  "psn",  "lid",   "gid",   "mtu",   "link",
                                     "addr", "rkey", "bytes", "laddr", "lrkey", "lslots"};

}  // namespace

std::string serializeDescriptor(const QpDescriptor& d) {
  std::string s = kVersion;
  auto add = [&s](const char* key, const std::string& value) {
    s += ' ';
    s += key;
    s += '=';
    s += value;
  };
  add(kNames[kQpn], hex(d.qpn));
  add(kNames[kPsn], hex(d.psn));
  add(kNames[kLid], hex(d.lid));
  add(kNames[kGid], gidToString(d.gid));
  add(kNames[kMtu], hex(d.mtu));
  add(kNames[kLink], d.link == LinkLayer::kEthernet ? "eth" : "ib");
  add(kNames[kAddr], hex(d.inbox_addr));
  add(kNames[kRkey], hex(d.inbox_rkey));
  add(kNames[kBytes], hex(d.inbox_bytes));
  add(kNames[kLAddr], hex(d.landing_addr));
  add(kNames[kLRkey], hex(d.landing_rkey));
  add(kNames[kLSlots], hex(d.landing_slots));
  return s;
}

bool parseDescriptor(const std::string& text, QpDescriptor* out, std::string* why) {
  auto fail = [why, &text](const std::string& reason) {
    if (why) *why = "malformed ib descriptor (" + reason + "): '" + text.substr(0, 200) + "'";
    return false;
  };
  // Tokens separated by exactly one space; no leading/trailing blanks.
  std::vector<std::string> tokens;
  size_t start = 0;
  while (true) {
    const size_t sp = text.find(' ', start);
    tokens.push_back(text.substr(start, sp == std::string::npos ? std::string::npos : sp - start));
    if (sp == std::string::npos) break;
    start = sp + 1;
  }
  if (tokens.empty() || tokens[0] != kVersion) return fail("expected version tag rib1 first");
  std::string values[kFields];
  bool seen[kFields] = {};
  for (size_t i = 1; i < tokens.size(); ++i) {
    const std::string& t = tokens[i];
    const size_t eq = t.find('=');
    if (t.empty() || eq == std::string::npos || eq == 0) return fail("token '" + t + "'");
    const std::string key = t.substr(0, eq);
    int f = 0;
    while (f < kFields && key != kNames[f]) ++f;
    if (f == kFields) return fail("unknown key '" + key + "'");
    if (seen[f]) return fail("duplicate key '" + key + "'");
    seen[f] = true;
    values[f] = t.substr(eq + 1);
  }
  for (int f = 0; f < kFields; ++f)
    if (!seen[f]) return fail(std::string("missing key '") + kNames[f] + "'");

  QpDescriptor d;
  uint64_t v = 0;
  if (!parseHex(values[kQpn], 0xffffff, &v)) return fail("qpn");
  d.qpn = static_cast<uint32_t>(v);
  if (!parseHex(values[kPsn], 0xffffff, &v)) return fail("psn");
  d.psn = static_cast<uint32_t>(v);
  if (!parseHex(values[kLid], 0xffff, &v)) return fail("lid");
  d.lid = static_cast<uint16_t>(v);
  const std::string& g = values[kGid];
  if (g.size() != 32) return fail("gid must have 32 hex digits");
  for (size_t i = 0; i < 16; ++i) {
    const int hi = hexDigit(g[2 * i]), lo = hexDigit(g[2 * i + 1]);
    if (hi < 0 || lo < 0) return fail("gid");
    d.gid.raw[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  if (!parseHex(values[kMtu], abi::kMtu4096, &v) || v < abi::kMtu256) return fail("mtu");
  d.mtu = static_cast<uint32_t>(v);
  if (values[kLink] == "ib")
    d.link = LinkLayer::kInfiniBand;
  else if (values[kLink] == "eth")
    d.link = LinkLayer::kEthernet;
  else
    return fail("link");
  if (!parseHex(values[kAddr], ~0ull, &d.inbox_addr)) return fail("addr");
  if (!parseHex(values[kRkey], 0xffffffffull, &v)) return fail("rkey");
  d.inbox_rkey = static_cast<uint32_t>(v);
  if (!parseHex(values[kBytes], ~0ull, &d.inbox_bytes) || d.inbox_bytes == 0) return fail("bytes");
  if (!parseHex(values[kLAddr], ~0ull, &d.landing_addr)) return fail("laddr");
  if (!parseHex(values[kLRkey], 0xffffffffull, &v)) return fail("lrkey");
  d.landing_rkey = static_cast<uint32_t>(v);
  if (!parseHex(values[kLSlots], 1u << 20, &v)) return fail("lslots");
  d.landing_slots = static_cast<uint32_t>(v);
  if (d.landing_slots != 0 && d.landing_addr == 0) return fail("landing ring without an address");
  *out = d;
  return true;
}

}  // namespace ib
}  // namespace resident
