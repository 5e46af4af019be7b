// The result rows of the floor programs (floors.cu, tcp_floor.cpp): the quantiles of a row's
// samples, its line in the printed table and its entry in the JSON's "results" list (the format
// resident_pg/bench/cuda.py reads). Host code, header-only: each program stays one file to build.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

struct Result {
  std::string name, variant;
  size_t bytes = 0;
  std::string unit, note;
  bool ok = false;
  bool skipped = false;  // not run here (the note says why); not a failure
  double median = NAN, p10 = NAN, p90 = NAN;
  size_t n = 0;
};

// The names of a comma-separated `--only` list, each one of `known`; false at the first that is
// not (the caller prints its usage).
template <size_t N>
inline bool ParseNameList(std::string rest, const char* const (&known)[N],
                          std::vector<std::string>* out) {
  while (!rest.empty()) {
    const size_t c = rest.find(',');
    const std::string nm = rest.substr(0, c);
    rest = c == std::string::npos ? "" : rest.substr(c + 1);
    if (std::none_of(std::begin(known), std::end(known), [&](const char* k) { return nm == k; }))
      return false;
    out->push_back(nm);
  }
  return true;
}

// `r` with n, median, p10 and p90 of `v` (linear interpolation between order statistics).
inline Result Summarize(Result r, std::vector<double> v) {
  r.n = v.size();
  if (v.empty()) return r;
  std::sort(v.begin(), v.end());
  auto q = [&](double p) {
    const double x = p * double(v.size() - 1);
    const size_t lo = size_t(x), hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (x - double(lo));
  };
  r.median = q(0.5), r.p10 = q(0.1), r.p90 = q(0.9);
  return r;
}

inline std::string JsonStr(const std::string& x) {
  std::string o = "\"";
  for (char c : x) {
    if (c == '"' || c == '\\') o += '\\';
    o += (c == '\n' || c == '\t') ? ' ' : c;
  }
  return o + "\"";
}

inline std::string JsonNum(double x) {
  char b[32];
  snprintf(b, sizeof(b), "%.4f", x);
  return std::isfinite(x) ? b : "null";
}

// Prints the table; true when every row passed or was skipped.
inline bool PrintResults(const std::vector<Result>& res) {
  bool all_ok = true;
  printf("\n%-19s %-11s %8s %9s %9s %9s %6s  %s\n", "name", "variant", "bytes", "median_us",
         "p10_us", "p90_us", "n", "note");
  for (const Result& r : res) {
    all_ok &= r.ok || r.skipped;
    printf("%-19s %-11s %8zu %9.3f %9.3f %9.3f %6zu  %s%s\n", r.name.c_str(),
           r.variant.empty() ? "-" : r.variant.c_str(), r.bytes, r.median, r.p10, r.p90, r.n,
           r.ok || r.skipped ? "" : "FAILED ", r.note.c_str());
  }
  return all_ok;
}

// The JSON's `"results": [...]` member (the caller writes the object around it).
inline void WriteResultRows(FILE* f, const std::vector<Result>& res) {
  fprintf(f, "\"results\": [");
  for (size_t i = 0; i < res.size(); ++i) {
    const Result& r = res[i];
    fprintf(f,
            "%s\n  {\"name\": %s, \"variant\": %s, \"bytes\": %zu, \"median_us\": %s, "
            "\"p10_us\": %s, \"p90_us\": %s, \"samples\": %zu, \"unit\": %s, \"ok\": %s, "
            "\"skipped\": %s, \"note\": %s}",
            i ? "," : "", JsonStr(r.name).c_str(), JsonStr(r.variant).c_str(), r.bytes,
            JsonNum(r.median).c_str(), JsonNum(r.p10).c_str(), JsonNum(r.p90).c_str(), r.n,
            JsonStr(r.unit).c_str(), r.ok ? "true" : "false", r.skipped ? "true" : "false",
            JsonStr(r.note).c_str());
  }
  fprintf(f, "\n]");
}
