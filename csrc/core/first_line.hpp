// The first line of a small text file (a /proc or /sys entry), without its line end; empty when
// the file cannot be read. stdio, not iostreams: libstdc++ stream code in the extension clashes
// with the host's under torch 2.11 (tests/test_source_rules.py).
#pragma once

#include <cstdio>
#include <string>

namespace resident {

inline std::string readFirstLine(const char* path) {
  std::string line;
  if (FILE* f = std::fopen(path, "r")) {
    char buf[256] = {0};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) line = buf;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

}  // namespace resident
