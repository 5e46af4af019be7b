// readFirstLine (csrc/core/first_line.hpp), which reads /proc and /sys entries for the host key
// and the ib transport's GID types: the first line without its line end ("\n" or "\r\n"), the
// whole content when there is no line end, and "" for an empty or missing file.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "check.hpp"
#include "core/first_line.hpp"

namespace {

std::string withContent(const char* content) {
  char path[] = "/tmp/resident_first_line_XXXXXX";
  const int fd = mkstemp(path);
  CHECK(fd >= 0);
  FILE* f = fdopen(fd, "w");
  CHECK(f != nullptr);
  std::fputs(content, f);
  std::fclose(f);
  const std::string line = resident::readFirstLine(path);
  std::remove(path);
  return line;
}

}  // namespace

int main() {
  CHECK(withContent("RoCE v2\n") == "RoCE v2");
  CHECK(withContent("8a0e6c7e-0b1f-4d5c\r\nsecond line\n") == "8a0e6c7e-0b1f-4d5c");
  CHECK(withContent("no line end") == "no line end");
  CHECK(withContent("").empty());
  CHECK(withContent("\n").empty());
  CHECK(resident::readFirstLine("/nonexistent/resident/first_line").empty());
  std::printf("ok\n");
  return 0;
}
