// tcp_netns.hpp: the two network namespaces of tcp_floor.cpp's tcp_netns rows, joined by a veth
// pair (made over rtnetlink: netns_rtnetlink.hpp), and their removal, also from a signal handler
// that takes the forked ends with it. Header-only, so that the program builds from its one .cpp.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <string>

#include "netns_rtnetlink.hpp"
#include "tcp_shared.hpp"

// Namespaces and their veth ends; the lock keeps two runs of this program off the same names.
constexpr const char* kNsA = "resident_floor_a";
constexpr const char* kNsB = "resident_floor_b";
constexpr const char* kAddrA = "10.214.0.1";
constexpr const char* kAddrB = "10.214.0.2";
constexpr const char* kLockPath = "/run/resident_floor.lock";

inline volatile sig_atomic_t g_netns_up = 0;
inline volatile pid_t g_children[2] = {-1, -1};  // the forked ends, killed by OnSignal

// What `ip netns del` does: detach the namespace's bind mount and remove its file. Only
// async-signal-safe calls, so that the signal handler can use it too.
inline void RemoveNetns() {
  for (const char* ns : {kNsA, kNsB}) {
    char path[64] = "/var/run/netns/";
    strncat(path, ns, sizeof(path) - strlen(path) - 1);
    umount2(path, MNT_DETACH);
    unlink(path);
  }
  g_netns_up = 0;
}

inline void OnSignal(int sig) {
  for (pid_t p : g_children) {
    if (p > 0) kill(p, SIGKILL);
  }
  if (g_netns_up) RemoveNetns();
  signal(sig, SIG_DFL);
  raise(sig);
}

// Creates the two namespaces joined by a veth pair; returns "" or why not (then none is left).
inline std::string SetUpNetns(int* lock_fd) {
  if (geteuid() != 0) return "network namespaces need root";
  *lock_fd = open(kLockPath, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (*lock_fd < 0) return std::string("cannot open ") + kLockPath + ": " + strerror(errno);
  for (const uint64_t end = NowNs() + kSetupNs; flock(*lock_fd, LOCK_EX | LOCK_NB) != 0;) {
    if (NowNs() > end) return "another tcp_floor run held " + std::string(kLockPath) + " for 30 s";
    usleep(10000);
  }
  // Under the lock no other run uses these names: any found were left by a killed run.
  RemoveNetns();
  g_netns_up = 1;  // from here on a signal removes whatever exists
  std::string why = rtnl::AddNetns(kNsA);
  if (why.empty()) why = rtnl::AddNetns(kNsB);
  if (why.empty()) why = rtnl::AddVeth(kNsA, "rfloor_a", kNsB, "rfloor_b");
  if (why.empty()) why = rtnl::AddAddress(kNsA, "rfloor_a", kAddrA);
  if (why.empty()) why = rtnl::AddAddress(kNsB, "rfloor_b", kAddrB);
  if (why.empty()) why = rtnl::LinkUp(kNsA, "rfloor_a");
  if (why.empty()) why = rtnl::LinkUp(kNsB, "rfloor_b");
  if (!why.empty()) RemoveNetns();
  return why;
}

// Enters a named network namespace (what `ip netns exec` does before it runs its command).
inline bool EnterNetns(const char* ns, Side* report) {
  const std::string path = rtnl::NsPath(ns);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    SetMsg(report, kSysError, "setns " + path + ": " + strerror(errno));
    return false;
  }
  close(fd);
  return true;
}
