// An opt-in timeline of the proxy's CUDA work (RESIDENT_GPU_PROXY_TRACE): when each trigger was
// popped, when each merged write was posted and when each pass's flags were raised (and, over
// tcp, when each sendmsg and recv returned and when a peer's socket was found readable: a file of
// its own), on this host's monotonic clock, so that two ranks' files line up. It answers where a
// proxied op's time goes between the GPUs' stages and the proxy's (scripts/proxy_trace_summary.py).
// The table is allocated once when tracing is on; recording never allocates, and events past its
// end are counted, not kept.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/clock.hpp"
#include "core/log.hpp"

namespace resident {

enum class TraceEvent : uint8_t {
  kPopLines,  // a trigger of LL lines popped (bytes: the range)
  kPopCopy,   // a trigger of payload bytes popped (the simple protocol)
  kPopFlag,   // a trigger of flags popped (bytes: the flag lines' range)
  kPosted,    // one merged write posted (bytes)
  kFlags,     // a pass's flags raised (bytes: how many)
  kCredit,    // a send/recv credit forwarded
  kSent,      // tcp: one sendmsg to the peer returned (bytes: what it took)
  kReceived,  // tcp: one recv from the peer returned (bytes: what it read)
  kReadable,  // tcp: epoll_wait found the peer's socket readable (bytes: 0)
};

// A trace's file name: <prefix>.rank<r>.<n><suffix>.
inline std::string traceFilePath(const std::string& prefix, int rank, int n, const char* suffix) {
  return prefix + ".rank" + std::to_string(rank) + "." + std::to_string(n) + suffix;
}

// Writes `path` with `write(FILE*)` and logs (as rank `rank`) where it went, or that it could
// not; false then. stdio, not iostreams (see localHostKey): an ofstream here crashed both ranks
// with SIGSEGV on the GPU machine (torch 2.11), the file left empty.
template <typename Write>
bool writeTraceFile(int rank, const std::string& path, Write&& write) {
  FILE* f = std::fopen(path.c_str(), "w");
  bool ok = f != nullptr;
  if (ok) {
    write(f);
    ok = std::fclose(f) == 0;
  }
  if (ok)
    RLOG_INFO("rank %d: trace written to %s", rank, path.c_str());
  else
    RLOG_WARN("rank %d: could not write the trace to %s", rank, path.c_str());
  return ok;
}

class ProxyTrace {
 public:
  explicit ProxyTrace(size_t capacity) : events_(capacity) {}

  void record(TraceEvent what, int peer, uint64_t bytes) {
    if (used_ == events_.size()) {
      ++dropped_;
      return;
    }
    events_[used_++] = {nowNs(), bytes, peer, what};
  }

  // One line per event: time (ns), event name, peer, bytes; a header line says what was
  // dropped. False when the file cannot be written.
  bool writeTsv(const std::string& path, int rank = -1) const {
    static const char* const kNames[] = {"pop_lines", "pop_copy", "pop_flag", "posted",  "flags",
                                         "credit",    "sent",     "received", "readable"};
    return writeTraceFile(rank, path, [&](FILE* f) {
      std::fprintf(f, "# t_ns\tevent\tpeer\tbytes\t(dropped %llu)\n",
                   static_cast<unsigned long long>(dropped_));
      for (size_t i = 0; i < used_; ++i) {
        const Entry& e = events_[i];
        std::fprintf(f, "%llu\t%s\t%d\t%llu\n", static_cast<unsigned long long>(e.t_ns),
                     kNames[static_cast<int>(e.what)], e.peer,
                     static_cast<unsigned long long>(e.bytes));
      }
    });
  }

  // Writes traceFilePath(prefix, rank, n, suffix), n counting the files written through
  // `serial`, so that several groups of one process get files of their own. Returns n.
  int save(const std::string& prefix, int rank, std::atomic<int>& serial,
           const char* suffix) const {
    const int n = serial++;
    writeTsv(traceFilePath(prefix, rank, n, suffix), rank);
    return n;
  }

 private:
  struct Entry {
    uint64_t t_ns, bytes;
    int peer;
    TraceEvent what;
  };
  std::vector<Entry> events_;
  size_t used_ = 0;
  uint64_t dropped_ = 0;
};

}  // namespace resident
