// The tag a stream writes into the resident kernel's mailbox (kernels/persistent_args.hpp):
// slot and generation survive the round trip for every slot the table can have and every
// generation a slot can carry, and a tag is never 0 (no op) nor the exit command.
#include <cstdint>
#include <cstdio>

#include "../kernels/persistent_args.hpp"
#include "check.hpp"
#include "core/descriptor_slots.hpp"

using namespace resident::gpu;

int main() {
  static_assert(resident::DescriptorSlots::kMaxGeneration == kMaxTagGeneration,
                "a slot's generation must fit the tag");
  constexpr uint32_t kMaxSlots = 65536;  // RESIDENT_GPU_PERSISTENT_SLOTS' upper bound
  CHECK(kMaxSlots < (1u << kTagSlotBits));
  for (uint32_t slot = 0; slot < kMaxSlots; slot += (slot < 256 ? 1 : 97)) {
    for (uint32_t gen = 1; gen <= kMaxTagGeneration; gen += (gen < 64 ? 1 : 251)) {
      const uint32_t tag = opTag(slot, gen);
      CHECK(tag != 0 && tag != kExitCommand);
      CHECK(tagSlot(tag) == slot && tagGeneration(tag) == gen);
    }
    const uint32_t top = opTag(slot, kMaxTagGeneration);
    CHECK(top != kExitCommand && tagSlot(top) == slot);
  }
  const uint32_t last = opTag(kMaxSlots - 1, kMaxTagGeneration);
  CHECK(last != kExitCommand && tagSlot(last) == kMaxSlots - 1);
  std::printf("ok\n");
  return 0;
}
