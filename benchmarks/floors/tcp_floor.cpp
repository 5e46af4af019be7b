// tcp_floor.cpp: one-way latency floor of a busy-polled TCP ping-pong between two processes, on
// loopback, between two network namespaces joined by a veth pair, or between two hosts (one run
// of the program on each: --listen and --connect). Standalone (no torch, no CUDA); see README.md
// for what each row means and how to run it.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/transport/tcp_address.hpp"
#include "floor_results.hpp"
#include "tcp_netns.hpp"
#include "tcp_ping_pong.hpp"
#include "tcp_rows.hpp"
#include "tcp_shared.hpp"
#include "tcp_sockets.hpp"

namespace {

const char* kNames[] = {"tcp_loopback", "tcp_netns"};
const char* kHostsName = "tcp_hosts";  // the rows of --connect: between two hosts

// One placement: server and client forked (each entering its namespace first when `netns`),
// the parent waiting on both with a deadline; one row per (receive method, size).
void RunPlacement(const char* name, bool netns, const Opts& o, std::vector<Result>& out) {
  Shared* sh = MapShared(o);
  const char* ip = netns ? kAddrB : "127.0.0.1";
  const pid_t parent = getpid();
  for (int i = 0; i < 2; ++i) {
    fflush(stdout), fflush(stderr);
    const pid_t pid = fork();
    PCK(pid >= 0);
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the parent
      if (getppid() != parent) _exit(3);
      Side* setup = i == 0 ? &sh->setup_server : &sh->setup_client;
      if (netns && !EnterNetns(i == 0 ? kNsB : kNsA, setup)) {
        if (i == 0) sh->port.store(-1);
        _exit(1);
      }
      _exit(i == 0 ? ServerMain(sh, ip, 0, Ends{}) : ClientMain(sh, o, ip, Ends{}));
    }
    g_children[i] = pid;
  }
  // Each wait of the ends is bounded; this bound covers all of them.
  const uint64_t end = NowNs() + kSetupNs + kNumRecv * kNumSizes * (kBudgetNs + 2 * kWaitNs);
  int st[2] = {0, 0};
  bool reaped[2] = {false, false}, killed = false;
  while (!(reaped[0] && reaped[1])) {
    for (int i = 0; i < 2; ++i) {
      if (!reaped[i]) reaped[i] = waitpid(g_children[i], &st[i], WNOHANG) == g_children[i];
    }
    if (!killed && NowNs() > end) {
      for (int i = 0; i < 2; ++i) {
        if (!reaped[i]) kill(g_children[i], SIGKILL);
      }
      killed = true;
    }
    usleep(20000);
  }
  g_children[0] = g_children[1] = -1;
  std::string ends;
  for (int i = 0; i < 2; ++i) {
    if (!WIFEXITED(st[i]) || WEXITSTATUS(st[i]) != 0) {
      ends += std::string(i ? " client" : " server") + "_exit=" +
              (WIFEXITED(st[i]) ? std::to_string(WEXITSTATUS(st[i]))
                                : "signal" + std::to_string(WTERMSIG(st[i])));
    }
  }
  if (killed) ends += " killed_after_deadline";
  AddRows(name, *sh, o, kNumRecv, ends, out);
  FreeShared(sh, o);
}

// ---- between two hosts ----

// --listen: the echo end of tcp_hosts, for one --connect; prints each failed check. 0 when every
// block passed its checks, 1 otherwise.
int RunListen(const Opts& o) {
  std::string ip;
  int port = 0;
  if (const std::string why = ParseHostPort(o.listen, true, &ip, &port); !why.empty()) {
    fprintf(stderr, "tcp_floor: --listen: %s\n", why.c_str());
    return 2;
  }
  Shared* sh = MapShared(o);
  const int status = ServerMain(sh, ip.c_str(), port, kRemoteEnds);
  if (sh->setup_server.err != kOk) printf("tcp_floor: FAILED: %s\n", sh->setup_server.msg);
  for (int v = 0; v < kRemoteEnds.methods; ++v) {
    for (int s = 0; s < kNumSizes; ++s) {
      const Side& me = sh->blocks[v][s].server;
      if (me.err != kOk) {
        printf("tcp_floor: FAILED %s %zu B: %s (%s)\n", kRecvName[v], kSizes[s], ErrName(me.err),
               me.msg);
      }
    }
  }
  printf("tcp_floor: served %s: %s\n",
         resident::endpointText(ip, uint16_t(sh->port.load())).c_str(),
         status ? "failed" : "every check passed");
  FreeShared(sh, o);
  return status ? 1 : 0;
}

// --connect: the timing end of tcp_hosts; its rows carry the echo end's checks.
void RunConnect(const Opts& o, std::vector<Result>& out) {
  std::string ip;
  int port = 0;
  if (const std::string why = ParseHostPort(o.connect, false, &ip, &port); !why.empty()) {
    fprintf(stderr, "tcp_floor: --connect: %s\n", why.c_str());
    exit(2);
  }
  Shared* sh = MapShared(o);
  sh->port.store(port);
  const int status = ClientMain(sh, o, ip.c_str(), kRemoteEnds);
  AddRows(kHostsName, *sh, o, kRemoteEnds.methods,
          status ? " client_exit=" + std::to_string(status) : "", out);
  FreeShared(sh, o);
}

void Usage() {
  fprintf(stderr,
          "usage: tcp_floor [--only NAME[,NAME]] [--iters N] [--json PATH] [--corrupt]\n"
          "       tcp_floor --listen [ADDR:]PORT      (on one host: the echo end of tcp_hosts)\n"
          "       tcp_floor --connect HOST:PORT [--iters N] [--json PATH] [--corrupt]\n"
          "                                           (on the other: the timing end)\n"
          "  HOST, ADDR: a name, an IPv4 address or an IPv6 one in brackets ([::1]:7100)\n"
          "  names: tcp_loopback tcp_netns\n"
          "  --corrupt: spoil each block's last message (checks that the far side notices)\n");
  exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) {
      if (!ParseNameList(argv[++i], kNames, &o.only)) Usage();
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::min(std::max(atol(argv[++i]), long(kMinSamples)), 1000000L);
    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else if (a == "--corrupt") {
      o.corrupt = true;
    } else if (a == "--listen" && i + 1 < argc) {
      o.listen = argv[++i];
    } else if (a == "--connect" && i + 1 < argc) {
      o.connect = argv[++i];
    } else {
      Usage();
    }
  }
  // --listen takes no other option; --connect runs its placement alone
  if (!o.listen.empty() && argc != 3) Usage();
  if (!o.connect.empty() && !o.only.empty()) Usage();
  o.warmup = std::min(std::max(o.iters / 10, 10L), 1000L);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) signal(sig, OnSignal);
  if (!o.listen.empty()) return RunListen(o);
  printf("tcp_floor: %ld cpus, iters %ld, warm-up %ld round trips per row\n",
         sysconf(_SC_NPROCESSORS_ONLN), o.iters, o.warmup);

  std::vector<Result> res;
  if (!o.connect.empty()) {
    printf("running %s to %s\n", kHostsName, o.connect.c_str());
    RunConnect(o, res);
  } else if (o.Want("tcp_loopback")) {
    printf("running tcp_loopback\n");
    RunPlacement("tcp_loopback", false, o, res);
  }
  if (o.connect.empty() && o.Want("tcp_netns")) {
    printf("running tcp_netns\n");
    int lock_fd = -1;
    const std::string why = SetUpNetns(&lock_fd);
    if (why.empty()) {
      RunPlacement("tcp_netns", true, o, res);
      RemoveNetns();
    } else {
      Result r;
      r.name = "tcp_netns", r.skipped = true, r.note = "not run: " + why;
      r.unit = "us one-way (round trip / 2)";
      res.push_back(r);
    }
    if (lock_fd >= 0) close(lock_fd);
  }

  const bool all_ok = PrintResults(res);
  if (!o.json.empty()) {
    WriteJson(o.json, o, res);
    printf("wrote %s\n", o.json.c_str());
  }
  return all_ok ? 0 : 1;
}
