// tcp_rows.hpp: tcp_floor.cpp's result rows, from what the ends reported, and its JSON document
// around them (floor_results.hpp writes the rows). Header-only, so that the program builds from
// its one .cpp.
#pragma once

#include <sys/utsname.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "floor_results.hpp"
#include "tcp_shared.hpp"

// One row per (receive method, size) of the first `methods` methods, from what the ends wrote;
// `ends`: how the ends exited, added to a failed row's note.
inline void AddRows(const char* name, const Shared& sh, const Opts& o, int methods,
                    const std::string& ends, std::vector<Result>& out) {
  std::string setup;
  for (const Side* s : {&sh.setup_server, &sh.setup_client}) {
    if (s->err != kOk) setup += std::string(" setup: ") + s->msg;
  }
  for (int v = 0; v < methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const Block& b = sh.blocks[v][s];
      Result r;
      r.name = name, r.variant = kRecvName[v], r.bytes = kSizes[s];
      r.unit = "us one-way (round trip / 2)";
      const double* smp = sh.samples + (size_t(v) * kNumSizes + size_t(s)) * size_t(o.iters);
      r = Summarize(r, std::vector<double>(smp, smp + b.timed));
      r.ok = b.client.err == kOk && b.server.err == kOk && b.timed >= kMinSamples;
      r.skipped = b.client.err == kNoUring || b.server.err == kNoUring;
      r.note = "round_trips=" + std::to_string(b.round_trips) + " client=" + ErrName(b.client.err) +
               " server=" + ErrName(b.server.err);
      if (b.truncated) r.note += " budget_truncated";
      for (const Side* side : {&b.client, &b.server}) {
        if (side->err != kOk && side->msg[0]) r.note += std::string(" (") + side->msg + ")";
      }
      if (r.skipped)
        r.note = std::string("not run: ") + (b.client.msg[0] ? b.client.msg : b.server.msg);
      if (!r.ok && !r.skipped) r.note += setup + ends;
      out.push_back(r);
    }
  }
}

// The JSON document: the run's header (host, CPUs, kernel, date, iters, warm-up; the peer of
// --connect) around the result rows.
inline void WriteJson(const std::string& path, const Opts& o, const std::vector<Result>& res) {
  FILE* f = fopen(path.c_str(), "w");
  PCK(f != nullptr);
  char host[256] = "?", date[32];
  gethostname(host, sizeof(host) - 1);
  utsname u{};
  uname(&u);
  const time_t now = time(nullptr);
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  fprintf(f, "{\"program\": \"tcp_floor\", \"host\": %s, \"cpus\": %ld, \"kernel\": %s, ",
          JsonStr(host).c_str(), sysconf(_SC_NPROCESSORS_ONLN), JsonStr(u.release).c_str());
  fprintf(f, "\"date\": \"%s\", \"iters\": %ld, \"warmup\": %ld, ", date, o.iters, o.warmup);
  if (!o.connect.empty()) fprintf(f, "\"peer\": %s, ", JsonStr(o.connect).c_str());
  WriteResultRows(f, res);
  fprintf(f, "}\n");
  PCK(fclose(f) == 0);
}
