#include "core/config.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/options.hpp"

namespace resident {
namespace {

std::vector<std::string> choicesOf(const OptionSpec& spec) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = spec.choices; *p; ++p) {
    if (*p == '|') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  out.push_back(cur);
  return out;
}

// "a, b or c", as the error messages list the choices.
std::string choiceList(const std::vector<std::string>& choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i)
    out += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  return out;
}

[[noreturn]] void badInteger(const OptionSpec& spec, const std::string& value) {
  throw InvalidArgument("resident: invalid value '" + value + "' for " + spec.key +
                        " (expected an integer in [" + std::to_string(spec.min) + ", " +
                        std::to_string(spec.max) + "])");
}

size_t choiceIndex(const OptionSpec& spec, const std::string& value) {
  const std::vector<std::string> choices = choicesOf(spec);
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == value) return i;
  throw InvalidArgument("resident: " + variableName(spec.key) + " must be " + choiceList(choices) +
                        ", got '" + value + "'");
}

template <typename T>
void parseInto(T& field, const OptionSpec& spec, const std::string& value) {
  if constexpr (std::is_enum_v<T>) {
    field = static_cast<T>(choiceIndex(spec, value));
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (spec.kind == OptionKind::kChoice) choiceIndex(spec, value);
    field = value;
  } else if constexpr (std::is_signed_v<T>) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0 || v < spec.min ||
        v > static_cast<long long>(spec.max))
      badInteger(spec, value);
    field = static_cast<T>(v);
  } else {
    static_assert(std::is_unsigned_v<T>, "an option's field is an enum, a string or an integer");
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
    if (value.empty() || value[0] == '-' || *end != '\0' || errno != 0 ||
        v < static_cast<uint64_t>(spec.min) || v > spec.max || v > std::numeric_limits<T>::max())
      badInteger(spec, value);
    field = static_cast<T>(v);
  }
}

template <typename T>
std::string valueName(const T& field, const OptionSpec& spec) {
  if constexpr (std::is_enum_v<T>) {
    return choicesOf(spec).at(static_cast<size_t>(field));
  } else if constexpr (std::is_same_v<T, std::string>) {
    return field;
  } else {
    return std::to_string(field);
  }
}

// Sizes rounded down to the unit their consumers need (see the fields' comments).
void roundSizes(Config& c) {
  c.slot_bytes &= ~63u;
  c.gpu_chunk_bytes &= ~2047u;
}

void apply(Config& c, const std::string& key, const std::string& value) {
  const OptionSpec* spec = findOption(key);
  if (spec == nullptr) {
    throw InvalidArgument("resident: unknown option '" + key + "' (did you mean '" +
                          closestOption(key) + "'?)");
  }
#define RESIDENT_OPTION(k, field, kind, tier, def, min, max, choices, doc) \
  if (key == #k) return parseInto(c.field, *spec, value);
#define RESIDENT_EXTERNAL_OPTION(...)
#define RESIDENT_REMOVED_OPTION(k, reason)
#include "core/options.def"
#undef RESIDENT_OPTION
#undef RESIDENT_EXTERNAL_OPTION
#undef RESIDENT_REMOVED_OPTION
  // An option read elsewhere (e.g. debug, by the logger), accepted as a key.
  if (!spec->pg_option || spec->tier == OptionTier::kRemoved)
    throw InvalidArgument("resident: '" + key + "' is not a pg_options key");
}

void rejectRemoved(const std::string& name, const OptionSpec& spec, const char* remedy) {
  throw InvalidArgument("resident: " + name + " is not supported: " + spec.doc + "; " + remedy);
}

}  // namespace

Config::Config() {
#define RESIDENT_OPTION(k, field, kind, tier, def, min, max, choices, doc) \
  parseInto(field, *findOption(#k), def);
#define RESIDENT_EXTERNAL_OPTION(...)
#define RESIDENT_REMOVED_OPTION(k, reason)
#include "core/options.def"
#undef RESIDENT_OPTION
#undef RESIDENT_EXTERNAL_OPTION
#undef RESIDENT_REMOVED_OPTION
  roundSizes(*this);
}

Config Config::fromEnvironment(const std::map<std::string, std::string>& options) {
  for (const OptionSpec& spec : optionSpecs()) {
    if (spec.tier != OptionTier::kRemoved) continue;
    const std::string var = variableName(spec.key);
    if (std::getenv(var.c_str()) != nullptr) rejectRemoved(var, spec, "unset it");
    if (options.count(spec.key) != 0)
      rejectRemoved("option '" + std::string(spec.key) + "' (" + var + ")", spec,
                    "leave it out of pg_options");
  }
  Config c;
  for (const OptionSpec& spec : optionSpecs()) {
    if (spec.tier == OptionTier::kRemoved || std::string(spec.reader) != "Config") continue;
    if (const char* v = std::getenv(variableName(spec.key).c_str())) apply(c, spec.key, v);
  }
  for (const auto& kv : options) apply(c, kv.first, kv.second);
  if (c.gpu_chunk_bytes != 0 && c.gpu_chunk_bytes < 2048) {
    throw InvalidArgument("resident: invalid value '" + std::to_string(c.gpu_chunk_bytes) +
                          "' for gpu_chunk_bytes (expected 0, automatic, or an integer in [2048, " +
                          std::to_string(findOption("gpu_chunk_bytes")->max) + "])");
  }
  roundSizes(c);
  c.spin_us_given =
      std::getenv(variableName("spin_us").c_str()) != nullptr || options.count("spin_us") != 0;
  return c;
}

std::string Config::describe() const {
  std::string out;
  auto add = [&out](const char* key, const std::string& value) {
    if (value.empty()) return;
    out += (out.empty() ? "" : " ") + std::string(key) + "=" + value;
  };
#define RESIDENT_OPTION(k, field, kind, tier, def, min, max, choices, doc) \
  add(#k, valueName(field, *findOption(#k)));
#define RESIDENT_EXTERNAL_OPTION(...)
#define RESIDENT_REMOVED_OPTION(k, reason)
#include "core/options.def"
#undef RESIDENT_OPTION
#undef RESIDENT_EXTERNAL_OPTION
#undef RESIDENT_REMOVED_OPTION
  return out;
}

const char* pathModeName(PathMode mode) {
  switch (mode) {
    case PathMode::kAuto:
      return "auto";
    case PathMode::kDirect:
      return "direct";
    case PathMode::kProxy:
      return "proxy";
  }
  return "?";
}

}  // namespace resident
