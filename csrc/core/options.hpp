// The option registry: every RESIDENT_* option as declared in core/options.def (name, kind,
// tier, default, range or choices, one line of documentation). Config's parser and describe()
// are generated from it; the extension hands it to Python (resident_pg/options.py), whose
// doctor and docs/tuning.md's table come from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace resident {

enum class OptionKind : uint8_t { kUnsigned, kInt, kChoice, kString };
enum class OptionTier : uint8_t { kUser, kAdvanced, kDeveloper, kRemoved };

struct OptionSpec {
  const char* key;  // the pg_options key; the variable is RESIDENT_<KEY>
  OptionKind kind;
  OptionTier tier;
  const char* default_value;  // as the variable spells it ("" for unset)
  int64_t min;                // range of kUnsigned / kInt
  uint64_t max;
  const char* choices;  // kChoice: '|'-separated
  const char* doc;      // one line; for a removed option, why it is refused
  const char* reader;   // "Config" or what else reads the variable
  bool pg_option;       // accepted as a pg_options key
};

// Every option in options.def's order, the removed ones last.
const std::vector<OptionSpec>& optionSpecs();
const OptionSpec* findOption(const std::string& key);
std::string variableName(const std::string& key);  // "slot_bytes" -> "RESIDENT_SLOT_BYTES"
const char* kindName(OptionKind kind);
const char* tierName(OptionTier tier);
// The registered option whose key is closest to `key` (edit distance), for "did you mean".
std::string closestOption(const std::string& key);

}  // namespace resident
