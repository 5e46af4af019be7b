#include "core/peer_monitor.hpp"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/log.hpp"
#include "core/process_state.hpp"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture (Linux 5.3)
#endif

namespace resident {

PeerMonitor::PeerMonitor(int rank, const std::vector<PeerInfo>& peers, const unsigned char* inbox,
                         const InboxLayout& layout)
    : rank_(rank),
      peers_(peers),
      inbox_(inbox),
      layout_(layout),
      pidfd_(peers.size(), -1),
      left_(peers.size(), 0),
      failed_(peers.size(), 0),
      exited_(peers.size(), 0) {
  fds_.reserve(peers.size());
  fd_peer_.reserve(peers.size());
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (static_cast<int>(p) == rank_ || !peers_[p].same_host || peers_[p].pid <= 0) continue;
    const long fd = syscall(SYS_pidfd_open, peers_[p].pid, 0);
    if (fd >= 0) {
      pidfd_[p] = static_cast<int>(fd);
    } else {
      RLOG_INFO("rank %d: no pidfd for rank %zu (pid %d): %s; watching /proc instead", rank_, p,
                peers_[p].pid, std::strerror(errno));
      if (errno == ESRCH) exited_[p] = 1;  // already gone: reported at the first poll
    }
  }
}

PeerMonitor::~PeerMonitor() {
  for (int fd : pidfd_)
    if (fd >= 0) ::close(fd);
}

std::string PeerMonitor::who(int peer) const {
  const PeerInfo& info = peers_[static_cast<size_t>(peer)];
  return info.name + " (pid " + std::to_string(info.pid) + " on " + info.host + ")";
}

void PeerMonitor::refreshExits() {
  fds_.clear();
  fd_peer_.clear();
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (exited_[p] || static_cast<int>(p) == rank_ || !peers_[p].same_host || peers_[p].pid <= 0)
      continue;
    if (pidfd_[p] >= 0) {
      fds_.push_back(pollfd{pidfd_[p], POLLIN, 0});
      fd_peer_.push_back(static_cast<int>(p));
    } else if (processHasExited(peers_[p].pid)) {
      exited_[p] = 1;
    }
  }
  if (fds_.empty() || ::poll(fds_.data(), fds_.size(), 0) <= 0) return;
  for (size_t k = 0; k < fds_.size(); ++k)
    if ((fds_[k].revents & (POLLIN | POLLHUP | POLLERR)) != 0)
      exited_[static_cast<size_t>(fd_peer_[k])] = 1;
}

void PeerMonitor::poll(std::vector<Event>& out) {
  refreshExits();
  for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
    const size_t i = static_cast<size_t>(p);
    if (p == rank_ || failed_[i]) continue;
    const uint64_t word = __atomic_load_n(
        reinterpret_cast<const uint64_t*>(inbox_ + layout_.peerStateOffset(p)), __ATOMIC_ACQUIRE);
    if ((word & 0xff) == kPeerStateFailed) {
      failed_[i] = 1;
      const int named = static_cast<int>((word & kPeerStateDeadMask) >> 8) - 1;
      const bool unreachable = (word & kPeerStateUnreachable) != 0;
      const bool left = (word & kPeerStateCauseLeft) != 0;  // `named` left: it is not dead
      std::string reason = "resident: the process group of " + who(p) + " failed";
      if (named >= 0 && named < static_cast<int>(peers_.size()) && named != rank_) {
        const std::string& name = peers_[static_cast<size_t>(named)].name;
        reason +=
            left ? " after " + name + " destroyed its process group while an op still needed it"
            : unreachable ? " after " + name +
                                " stopped answering over the network (its host or the "
                                "network down, or it hung)"
                          : " after it found " + name + " dead";
      }
      out.push_back(Event{p, true, left ? -1 : named, reason, unreachable});
      continue;
    }
    if (word == kPeerStateLeft && !left_[i]) {
      left_[i] = 1;
      out.push_back(
          Event{p, false, -1, "resident: " + who(p) + " destroyed its process group (or exited)"});
    }
    if (!left_[i] && exited_[i]) {
      failed_[i] = 1;
      out.push_back(Event{p, true, p,
                          "resident: " + who(p) +
                              " exited without destroying its process group (it crashed or was "
                              "killed)"});
    }
  }
}

}  // namespace resident
