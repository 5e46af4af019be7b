// Leveled logger, off by default. RESIDENT_DEBUG=error|warn|info|debug|trace (or 0-5)
// switches it on; lines go to stderr prefixed with the process id and, once known, the rank.
#pragma once

namespace resident {

enum class LogLevel : int { kOff = 0, kError = 1, kWarn = 2, kInfo = 3, kDebug = 4, kTrace = 5 };

// Current level, read once from RESIDENT_DEBUG.
LogLevel logLevel();
// Override (tests, backend options).
void setLogLevel(LogLevel level);
// Printf-style; cheap no-op test when the level is disabled (the macro checks first).
void logMessage(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace resident

#define RESIDENT_LOG(level, ...)                                             \
  do {                                                                       \
    if (static_cast<int>(::resident::logLevel()) >= static_cast<int>(level)) \
      ::resident::logMessage(level, __FILE__, __LINE__, __VA_ARGS__);        \
  } while (0)
#define RLOG_ERROR(...) RESIDENT_LOG(::resident::LogLevel::kError, __VA_ARGS__)
#define RLOG_WARN(...) RESIDENT_LOG(::resident::LogLevel::kWarn, __VA_ARGS__)
#define RLOG_INFO(...) RESIDENT_LOG(::resident::LogLevel::kInfo, __VA_ARGS__)
#define RLOG_DEBUG(...) RESIDENT_LOG(::resident::LogLevel::kDebug, __VA_ARGS__)
#define RLOG_TRACE(...) RESIDENT_LOG(::resident::LogLevel::kTrace, __VA_ARGS__)
