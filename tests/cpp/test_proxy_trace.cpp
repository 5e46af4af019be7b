// ProxyTrace (RESIDENT_GPU_PROXY_TRACE): events come back from the file in order, with their
// names, peers and byte counts, on a clock that does not run backwards; events past the
// table's end are counted as dropped, not written; an unwritable path reports false.
#include <unistd.h>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/proxy/proxy_trace.hpp"

int main() {
  using resident::TraceEvent;
  std::mt19937_64 rng(20261130);
  const char* names[] = {"pop_lines", "pop_copy", "pop_flag", "posted",
                         "flags",     "credit",   "sent",     "received"};
  resident::ProxyTrace trace(100);
  struct Want {
    int what, peer;
    unsigned long long bytes;
  };
  std::vector<Want> want;
  for (int i = 0; i < 130; ++i) {
    const Want w{static_cast<int>(rng() % 8), static_cast<int>(rng() % 64),
                 static_cast<unsigned long long>(rng() % (1u << 20))};
    trace.record(static_cast<TraceEvent>(w.what), w.peer, w.bytes);
    if (i < 100) want.push_back(w);
  }
  const std::string path = "/tmp/resident_trace_test." + std::to_string(getpid()) + ".tsv";
  CHECK(trace.writeTsv(path));
  std::ifstream in(path);
  std::string header;
  std::getline(in, header);
  CHECK(header.find("(dropped 30)") != std::string::npos);
  unsigned long long last_t = 0;
  size_t n = 0;
  for (std::string line; std::getline(in, line); ++n) {
    std::istringstream fields(line);
    unsigned long long t = 0, bytes = 0;
    std::string name;
    int peer = -1;
    fields >> t >> name >> peer >> bytes;
    CHECK(n < want.size());
    CHECK(t >= last_t);
    last_t = t;
    CHECK(name == names[want[n].what]);
    CHECK(peer == want[n].peer);
    CHECK(bytes == want[n].bytes);
  }
  CHECK(n == want.size());
  std::remove(path.c_str());
  CHECK(!trace.writeTsv("/nonexistent-dir/trace.tsv"));
  // save: <prefix>.rank<r>.<n><suffix>, n from the caller's counter.
  std::atomic<int> serial{3};
  const std::string prefix = "/tmp/resident_trace_test." + std::to_string(getpid());
  trace.save(prefix, 7, serial, ".tcp.tsv");
  const std::string saved = prefix + ".rank7.3.tcp.tsv";
  CHECK(serial.load() == 4 && std::ifstream(saved).good());
  std::remove(saved.c_str());
  std::puts("test_proxy_trace: ok");
  return 0;
}
