#include "core/options.hpp"

#include <algorithm>
#include <cctype>
#include <cstdint>

namespace resident {

const std::vector<OptionSpec>& optionSpecs() {
  static const std::vector<OptionSpec> specs = [] {
    std::vector<OptionSpec> live, removed;
#define RESIDENT_OPTION(key, field, kind, tier, def, min, max, choices, doc) \
  live.push_back(                                                            \
      {#key, OptionKind::kind, OptionTier::tier, def, min, max, choices, doc, "Config", true});
#define RESIDENT_EXTERNAL_OPTION(key, reader, pg_option, kind, tier, def, min, max, choices, doc) \
  live.push_back({#key, OptionKind::kind, OptionTier::tier, def, min, max, choices, doc, reader,  \
                  pg_option != 0});
#define RESIDENT_REMOVED_OPTION(key, reason) \
  removed.push_back(                         \
      {#key, OptionKind::kString, OptionTier::kRemoved, "", 0, 0, "", reason, "", true});
#include "core/options.def"
#undef RESIDENT_OPTION
#undef RESIDENT_EXTERNAL_OPTION
#undef RESIDENT_REMOVED_OPTION
    live.insert(live.end(), removed.begin(), removed.end());
    return live;
  }();
  return specs;
}

const OptionSpec* findOption(const std::string& key) {
  for (const OptionSpec& s : optionSpecs())
    if (key == s.key) return &s;
  return nullptr;
}

std::string variableName(const std::string& key) {
  std::string var = "RESIDENT_";
  for (char ch : key) var += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return var;
}

const char* kindName(OptionKind kind) {
  switch (kind) {
    case OptionKind::kUnsigned:
      return "unsigned";
    case OptionKind::kInt:
      return "int";
    case OptionKind::kChoice:
      return "choice";
    case OptionKind::kString:
      return "string";
  }
  return "?";
}

const char* tierName(OptionTier tier) {
  switch (tier) {
    case OptionTier::kUser:
      return "user";
    case OptionTier::kAdvanced:
      return "advanced";
    case OptionTier::kDeveloper:
      return "developer";
    case OptionTier::kRemoved:
      return "removed";
  }
  return "?";
}

namespace {

size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string closestOption(const std::string& key) {
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const OptionSpec& s : optionSpecs()) {
    if (s.tier == OptionTier::kRemoved) continue;
    const size_t d = editDistance(key, s.key);
    if (d < best_distance) {
      best_distance = d;
      best = s.key;
    }
  }
  return best;
}

}  // namespace resident
