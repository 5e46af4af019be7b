// The descriptor a rank posts at group creation (csrc/core/group_descriptor.hpp): it decodes to
// what was encoded, a text that is not a descriptor is refused naming its rank, and each shared
// setting that differs fails creation naming the setting and both values.
#include <string>

#include "check.hpp"
#include "core/error.hpp"
#include "core/group_descriptor.hpp"

namespace {

using resident::GroupDescriptor;

// The message checkSharedSettings throws for `theirs`, or "" when it accepts it.
std::string mismatch(const GroupDescriptor& mine, const GroupDescriptor& theirs) {
  try {
    resident::checkSharedSettings(mine, 0, theirs, 3);
  } catch (const resident::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

int main() {
  resident::Config cfg;
  cfg.slots = 8;
  cfg.slot_bytes = 65536;
  cfg.transport = "auto";
  cfg.path = resident::PathMode::kProxy;
  cfg.gpu_protocol = resident::GpuProtocol::kSimple;
  cfg.handoff_bytes = 0;
  cfg.gpu_chunk_bytes = 262144;
  cfg.gpu_first_round = 7;
  const GroupDescriptor mine =
      resident::localDescriptor(cfg, "/resident_12_ab", 1u << 20, "10.0.0.2:4711", true);
  CHECK(mine.gpu_protocol == "simple/proxy");
  CHECK(mine.gpu_rounds == "262144/7");

  // Round trip, every field.
  const GroupDescriptor back = resident::decodeDescriptor(resident::encodeDescriptor(mine), 5);
  CHECK(back.inbox == "/resident_12_ab" && back.inbox_bytes == (1u << 20));
  CHECK(back.tcp_endpoint == "10.0.0.2:4711" && back.ib && back.path == "proxy");
  CHECK(back.slots == "8" && back.slot_bytes == "65536" && back.transport == "auto");
  CHECK(back.gpu_protocol == mine.gpu_protocol && back.handoff_bytes == "0");
  CHECK(back.gpu_rounds == mine.gpu_rounds);
  CHECK(mismatch(mine, back).empty());
  const GroupDescriptor no_ib = resident::decodeDescriptor(
      resident::encodeDescriptor(resident::localDescriptor(cfg, "/r", 4096, "-", false)), 1);
  CHECK(!no_ib.ib && no_ib.tcp_endpoint == "-" && no_ib.inbox_bytes == 4096);

  // Not a descriptor: too few or too many fields, a size that is not a number.
  for (const char* bad :
       {"", "a|b", "/r|12x|8|65536|auto|-|-|proxy|ll|0|1/0", "/r||8|65536|auto|-|-|proxy|ll|0|1/0",
        "/r|1|8|65536|auto|-|-|proxy|ll|0|1/0|extra"}) {
    bool threw = false;
    try {
      resident::decodeDescriptor(bad, 6);
    } catch (const resident::CommError& e) {
      threw = contains(e.what(), "malformed descriptor from rank 6");
    }
    CHECK(threw);
  }

  // Each shared setting that differs names itself, the other rank's value and this rank's.
  struct Differing {
    std::string GroupDescriptor::*field;
    const char* theirs;
    const char* message;
  };
  const Differing differing[] = {
      {&GroupDescriptor::slot_bytes, "4096",
       "rank 3 uses RESIDENT_SLOTS=8 RESIDENT_SLOT_BYTES=4096 but rank 0 uses 8/65536"},
      {&GroupDescriptor::transport, "tcp",
       "rank 3 uses RESIDENT_TRANSPORT=tcp but rank 0 uses auto"},
      {&GroupDescriptor::gpu_protocol, "ll",
       "RESIDENT_GPU_PROTOCOL=ll but rank 0 uses RESIDENT_GPU_PROTOCOL=simple with "
       "RESIDENT_PATH=proxy"},
      {&GroupDescriptor::handoff_bytes, "1024",
       "rank 3 uses RESIDENT_HANDOFF_BYTES=1024 but rank 0 uses 0"},
      {&GroupDescriptor::gpu_rounds, "65536/7",
       "RESIDENT_GPU_CHUNK_BYTES=65536 RESIDENT_GPU_FIRST_ROUND=7 but rank 0 uses "
       "RESIDENT_GPU_CHUNK_BYTES=262144 RESIDENT_GPU_FIRST_ROUND=7"},
  };
  for (const Differing& c : differing) {
    GroupDescriptor d = mine;
    d.*c.field = c.theirs;
    const std::string m = mismatch(mine, d);
    CHECK(contains(m, c.message));
    CHECK(contains(m, "all ranks must agree"));
  }
  // What a rank may choose for itself is not a shared setting.
  GroupDescriptor d = mine;
  d.path = "direct";
  d.tcp_endpoint = "-";
  d.ib = false;
  d.inbox = "/other";
  CHECK(mismatch(mine, d).empty());

  std::printf("ok\n");
  return 0;
}
