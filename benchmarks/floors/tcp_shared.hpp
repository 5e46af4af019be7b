// tcp_shared.hpp: what tcp_floor.cpp's parent and its two ends share: the blocks (receive method
// by message size), the deadlines, each end's report of each block, the options, and the anonymous
// shared mapping that carries reports and samples back to the parent. Header-only, so that the
// program builds from its one .cpp.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <string>
#include <vector>

[[noreturn]] inline void Die(const char* file, int line, const char* what) {
  fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, strerror(errno));
  exit(2);
}
// A failed POSIX call of the parent's own set-up prints file:line and exits with status 2.
#define PCK(cond)                                \
  do {                                           \
    if (!(cond)) Die(__FILE__, __LINE__, #cond); \
  } while (0)

constexpr size_t kSizes[] = {8, 1 << 10, 8 << 10, 64 << 10, 256 << 10};
constexpr int kNumSizes = 5;
enum Recv : int { kSpin = 0, kEpoll = 1, kUring = 2, kUringSqpoll = 3 };
constexpr int kNumRecv = 4;
constexpr const char* kRecvName[] = {"spin_recv", "epoll_recv", "uring", "uring_sqpoll"};

constexpr uint64_t kMs = 1000000ull;
constexpr uint64_t kWaitNs = 10000 * kMs;     // any single wait of the ping-pong
constexpr uint64_t kBudgetNs = 10000 * kMs;   // one (receive method, size) block, warm-up included
constexpr uint64_t kSetupNs = 30000 * kMs;    // listen / connect / namespace commands
constexpr uint64_t kListenNs = 600000 * kMs;  // --listen: until the other host's --connect
constexpr uint64_t kLast = 1ull << 63;        // set in a message's first word: the block's last
constexpr int kMinSamples = 10;               // fewer timed round trips fail the row

inline uint64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec);
}

enum Err : int32_t { kOk = 0, kTimeout, kPeerClosed, kMismatch, kSysError, kNotRun, kNoUring };
inline const char* ErrName(int e) {
  const char* n[] = {"ok",        "timeout", "peer_closed", "mismatch",
                     "sys_error", "not_run", "no_uring"};
  return e >= 0 && e <= kNoUring ? n[e] : "?";
}

// What one end reports about one (receive method, size) block: kNotRun until it starts it.
struct Side {
  int32_t err;
  char msg[120];
};
struct Block {
  Side client, server;
  uint64_t round_trips;  // completed, warm-up included
  uint64_t timed;        // samples written
  int32_t truncated;     // the block's budget ran out before --iters timed round trips
};
// Shared by the parent and both ends (an anonymous shared mapping made before the forks); between
// hosts each run has its own, and the echo end's checks reach the timing end as its verdict.
struct Shared {
  std::atomic<int32_t> port;  // 0 until the server listens, -1 if it failed to
  Side setup_client, setup_server;
  Block blocks[kNumRecv][kNumSizes];
  double samples[1];  // [kNumRecv][kNumSizes][iters], one-way µs
};

struct Opts {
  std::vector<std::string> only;
  long iters = 10000;
  long warmup = 1000;
  std::string json;
  bool corrupt = false;  // the client spoils each block's last message (the program's own test)
  std::string listen;    // --listen [ADDR:]PORT: this run is the echo end of tcp_hosts
  std::string connect;   // --connect HOST:PORT: this run is the timing end of tcp_hosts
  bool Want(const char* n) const {
    return only.empty() || std::find(only.begin(), only.end(), n) != only.end();
  }
};

// The bytes of a Shared with --iters samples per block.
inline size_t SharedBytes(const Opts& o) {
  return sizeof(Shared) + sizeof(double) * kNumRecv * kNumSizes * size_t(o.iters);
}

inline void SetMsg(Side* s, int32_t err, const std::string& m) {
  if (s->err != kOk) return;  // keep the first failure
  s->err = err;
  snprintf(s->msg, sizeof(s->msg), "%s", m.c_str());
}

// A Shared with room for every block's samples, in an anonymous shared mapping (inherited by
// forked ends); every block kNotRun. Released by FreeShared.
inline Shared* MapShared(const Opts& o) {
  void* mem =
      mmap(nullptr, SharedBytes(o), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  PCK(mem != MAP_FAILED);
  Shared* sh = new (mem) Shared();
  for (auto& row : sh->blocks) {
    for (Block& b : row) b.client.err = b.server.err = kNotRun;
  }
  return sh;
}
inline void FreeShared(Shared* sh, const Opts& o) {
  sh->~Shared();
  munmap(sh, SharedBytes(o));
}
