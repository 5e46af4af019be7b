// tcp_ping_pong.hpp: the two ends of tcp_floor.cpp's ping-pong: the echo end, which checks
// every message it sends back, and the timing end, which times each round trip. Header-only, so
// that the program builds from its one .cpp.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/transport/tcp_address.hpp"
#include "tcp_conn.hpp"
#include "tcp_shared.hpp"
#include "tcp_sockets.hpp"

// How the two ends of a placement run. On one host (both forked by this program, reporting
// through the shared mapping): every receive method. Between hosts (one run of the program on
// each): the methods the library's proxy uses, since whether an io_uring block can run depends on
// each host's kernel and CPUs and both ends must walk the same blocks; the echo end waits longer
// for its connection and, the mapping not being shared, sends its checks to the timing end at the
// end (the verdict, after the last block: off the measured path).
struct Ends {
  int methods = kNumRecv;
  bool remote = false;
  uint64_t accept_ns = kSetupNs;
};
constexpr Ends kRemoteEnds{kEpoll + 1, true, kListenNs};

// The payload of a block: random bytes, the same on both ends (seeded by size and method).
inline std::vector<uint8_t> Payload(size_t n, int recv) {
  std::mt19937_64 rng(0x7cf1003 + n * 31 + size_t(recv));
  std::vector<uint8_t> p(n);
  for (auto& b : p) b = uint8_t(rng());
  return p;
}
inline uint64_t Word0(const uint8_t* p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}

// The echo end: listens on `ip`:`port` (0: any), publishes its port, then for every block
// receives each message, checks its sequence number (every message) and its bytes (the first and
// the last), and sends it back; between hosts it then sends its verdict. 1 when a check failed.
inline int ServerMain(Shared* sh, const char* ip, int port, const Ends& ends) {
  std::string why;
  SockAddr a(ip, port);
  const int lfd = socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t len = sizeof(a.ss);
  if (lfd < 0 || bind(lfd, a.get(), a.len) != 0 || listen(lfd, 1) ||
      getsockname(lfd, a.get(), &len) != 0) {
    SetMsg(&sh->setup_server, kSysError, std::string("listen on ") + ip + ": " + strerror(errno));
    sh->port.store(-1);
    return 1;
  }
  sh->port.store(resident::portOf(a.get()));
  if (ends.remote) printf("tcp_floor: listening on %s\n", resident::endpointText(a.get()).c_str());
  if (!WaitFd(lfd, POLLIN, NowNs() + ends.accept_ns)) {
    SetMsg(&sh->setup_server, kTimeout,
           "no connection within " + std::to_string(ends.accept_ns / 1000000000ull) + " s");
    return 1;
  }
  const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  close(lfd);
  if (fd < 0) return SetMsg(&sh->setup_server, kSysError, strerror(errno)), 1;
  TuneSocket(fd);
  Conn c(fd);
  int status = 0;
  for (int v = 0; v < ends.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const size_t n = kSizes[s];
      Side* me = &sh->blocks[v][s].server;
      me->err = kOk;
      const std::vector<uint8_t> want = Payload(n, v);
      std::vector<uint8_t> buf(n);
      if (int32_t e = c.Use(v, &why)) {
        SetMsg(me, e, why);
        if (e == kNoUring) continue;  // both ends skip the block: the same kernel refused them
        return 1;
      }
      for (uint64_t seq = 0;; ++seq) {
        if (int32_t e = c.Recv(buf.data(), n, &why)) return SetMsg(me, e, why), 1;
        const uint64_t w = Word0(buf.data()) ^ Word0(want.data());
        const bool last = (w & kLast) != 0;
        if ((w & ~kLast) != seq) {  // every message: its first word (all of an 8 B one)
          SetMsg(me, kMismatch,
                 "sequence " + std::to_string(w & ~kLast) + ", expected " + std::to_string(seq));
        }
        if ((seq == 0 || last) && memcmp(buf.data() + 8, want.data() + 8, n - 8) != 0) {
          SetMsg(me, kMismatch, "payload differs at round trip " + std::to_string(seq));
        }
        if (int32_t e = c.Send(buf.data(), n, &why)) return SetMsg(me, e, why), 1;
        if (last) break;
      }
      if (int32_t e = c.Flush(&why)) return SetMsg(me, e, why), 1;  // before buf goes
      status |= me->err != kOk;
    }
  }
  if (ends.remote) {  // the verdict: this end's Side of every block, in block order
    std::vector<Side> verdict;
    for (int v = 0; v < ends.methods; ++v) {
      for (int s = 0; s < kNumSizes; ++s) verdict.push_back(sh->blocks[v][s].server);
    }
    const auto* p = reinterpret_cast<const uint8_t*>(verdict.data());
    if (int32_t e = c.Send(p, verdict.size() * sizeof(Side), &why)) {
      return SetMsg(&sh->setup_server, e, "sending the verdict: " + why), 1;
    }
    if (int32_t e = c.Flush(&why)) return SetMsg(&sh->setup_server, e, why), 1;
  }
  return status;
}

// round trip (one-way = half of it); the first and the last echo are checked byte for byte.
// Between hosts it then takes the echo end's verdict into the blocks.
inline int ClientMain(Shared* sh, const Opts& o, const char* ip, const Ends& ends) {
  std::string why;
  const uint64_t setup_end = NowNs() + kSetupNs;
  int port = 0;
  while ((port = sh->port.load()) == 0 && NowNs() < setup_end) usleep(1000);
  if (port <= 0) return SetMsg(&sh->setup_client, kNotRun, "the server never listened"), 1;
  const int fd = ConnectTo(ip, port, setup_end, ends.remote);
  if (fd < 0) {
    SetMsg(&sh->setup_client, kSysError,
           std::string("connect to ") + ip + ":" + std::to_string(port) + ": " + strerror(errno));
    return 1;
  }
  TuneSocket(fd);
  Conn c(fd);
  int status = 0;
  for (int v = 0; v < ends.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const size_t n = kSizes[s];
      Block* b = &sh->blocks[v][s];
      double* out = sh->samples + (size_t(v) * kNumSizes + size_t(s)) * size_t(o.iters);
      const std::vector<uint8_t> base = Payload(n, v);
      std::vector<uint8_t> msg = base, echo(n);
      b->client.err = kOk;
      if (int32_t e = c.Use(v, &why)) {
        SetMsg(&b->client, e, why);
        if (e == kNoUring) continue;
        return 1;
      }
      const uint64_t total = uint64_t(o.warmup + o.iters), start = NowNs();
      for (uint64_t seq = 0;; ++seq) {
        const bool last = seq + 1 == total || NowNs() - start > kBudgetNs;
        const uint64_t w = Word0(base.data()) ^ seq ^ (last ? kLast : 0);
        memcpy(msg.data(), &w, 8);
        if (last && o.corrupt) msg[n > 8 ? n - 1 : 0] ^= 0x5a;
        const uint64_t t0 = NowNs();
        if (int32_t e = c.Send(msg.data(), n, &why)) return SetMsg(&b->client, e, why), 1;
        if (int32_t e = c.Recv(echo.data(), n, &why)) return SetMsg(&b->client, e, why), 1;
        const uint64_t t1 = NowNs();
        b->round_trips = seq + 1;
        if (seq >= uint64_t(o.warmup)) out[b->timed++] = double(t1 - t0) / 2e3;
        if ((seq == 0 || last) && echo != msg) {
          SetMsg(&b->client, kMismatch, "echo differs at round trip " + std::to_string(seq));
          status = 1;
        }
        if (last) {
          b->truncated = seq + 1 < total;
          break;
        }
      }
    }
  }
  if (ends.remote) {  // the echo end's checks (ServerMain's verdict)
    std::vector<Side> verdict(size_t(ends.methods) * kNumSizes);
    auto* p = reinterpret_cast<uint8_t*>(verdict.data());
    if (int32_t e = c.Recv(p, verdict.size() * sizeof(Side), &why)) {
      return SetMsg(&sh->setup_client, e, "receiving the verdict: " + why), 1;
    }
    for (size_t i = 0; i < verdict.size(); ++i) {
      verdict[i].msg[sizeof(verdict[i].msg) - 1] = 0;
      sh->blocks[i / kNumSizes][i % kNumSizes].server = verdict[i];
    }
  }
  return status;
}
