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
  bool writeTsv(const std::string& path) const {
    static const char* const kNames[] = {"pop_lines", "pop_copy", "pop_flag", "posted",  "flags",
                                         "credit",    "sent",     "received", "readable"};
    // stdio, not iostreams (see localHostKey): an ofstream here crashed both ranks with
    // SIGSEGV on the GPU machine (torch 2.11), the file left empty.
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return false;
    std::fprintf(f, "# t_ns\tevent\tpeer\tbytes\t(dropped %llu)\n",
                 static_cast<unsigned long long>(dropped_));
    for (size_t i = 0; i < used_; ++i) {
      const Entry& e = events_[i];
      std::fprintf(f, "%llu\t%s\t%d\t%llu\n", static_cast<unsigned long long>(e.t_ns),
                   kNames[static_cast<int>(e.what)], e.peer,
                   static_cast<unsigned long long>(e.bytes));
    }
    return std::fclose(f) == 0;
  }

  // Writes <prefix>.rank<r>.<n><suffix> and logs where (or that it could not). n counts the
  // files written through `serial`, so that several groups of one process get files of their
  // own.
  // Returns the file's number (`serial`'s value, which it advances).
  int save(const std::string& prefix, int rank, std::atomic<int>& serial,
           const char* suffix) const {
    const int n = serial++;
    const std::string path =
        prefix + ".rank" + std::to_string(rank) + "." + std::to_string(n) + suffix;
    if (writeTsv(path))
      RLOG_INFO("rank %d: trace written to %s", rank, path.c_str());
    else
      RLOG_WARN("rank %d: could not write the trace to %s", rank, path.c_str());
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
