#include "core/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace resident {
namespace {

LogLevel parseLevel(const char* text) {
  if (text == nullptr || *text == '\0') return LogLevel::kOff;
  const std::string s(text);
  if (s == "error" || s == "1") return LogLevel::kError;
  if (s == "warn" || s == "2") return LogLevel::kWarn;
  if (s == "info" || s == "3") return LogLevel::kInfo;
  if (s == "debug" || s == "4") return LogLevel::kDebug;
  if (s == "trace" || s == "5") return LogLevel::kTrace;
  return LogLevel::kOff;
}

std::atomic<int>& levelStorage() {
  static std::atomic<int> level{static_cast<int>(parseLevel(std::getenv("RESIDENT_DEBUG")))};
  return level;
}

const char* levelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "ERROR";
    case LogLevel::kWarn:
      return "WARN";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kTrace:
      return "TRACE";
    default:
      return "";
  }
}

}  // namespace

LogLevel logLevel() {
  return static_cast<LogLevel>(levelStorage().load(std::memory_order_relaxed));
}

void setLogLevel(LogLevel level) {
  levelStorage().store(static_cast<int>(level));
}

void logMessage(LogLevel level, const char* file, int line, const char* fmt, ...) {
  char buf[1024];
  const char* base = std::strrchr(file, '/');
  int n = std::snprintf(buf, sizeof(buf), "[resident %s pid %d %s:%d] ", levelName(level),
                        static_cast<int>(getpid()), base ? base + 1 : file, line);
  if (n < 0) return;
  va_list args;
  va_start(args, fmt);
  int m = std::vsnprintf(buf + n, sizeof(buf) - static_cast<size_t>(n) - 1, fmt, args);
  va_end(args);
  size_t len = static_cast<size_t>(n) + (m > 0 ? static_cast<size_t>(m) : 0);
  if (len > sizeof(buf) - 2) len = sizeof(buf) - 2;
  buf[len++] = '\n';
  // One write(2) per line so lines from several threads do not interleave.
  ssize_t ignored = ::write(STDERR_FILENO, buf, len);
  (void)ignored;
}

}  // namespace resident
