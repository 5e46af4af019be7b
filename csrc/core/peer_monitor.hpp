// Notices at once that a peer is gone, without waiting for an op's timeout:
// - a same-host peer whose process exited: a pidfd turns readable when its process exits,
//   whether or not its parent has reaped it yet (kill(pid, 0) cannot tell a zombie from a live
//   process, and a pid can be reused once reaped; the pidfd is opened while the peer is alive);
// - any peer's own word in this rank's inbox (layout.hpp, peer states): it shut its group down,
//   or its group failed (and which rank it found dead).
// Network transports report closed connections themselves (transport/tcp_transport.hpp).
#pragma once

#include <poll.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/engine.hpp"
#include "core/layout.hpp"

namespace resident {

class PeerMonitor {
 public:
  struct Event {
    int peer;
    bool failed;  // false: the peer left in an orderly way (destroyed its group)
    int dead;     // the rank found dead (the peer itself when it exited), or -1
    std::string reason;
    bool unreachable = false;  // `dead` stopped answering over the network (did not exit)
  };

  PeerMonitor(int rank, const std::vector<PeerInfo>& peers, const unsigned char* inbox,
              const InboxLayout& layout);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  // Appends what changed since the last call; each peer is reported at most once as left and
  // once as failed. Cheap: one poll() over the pidfds and a load per peer.
  void poll(std::vector<Event>& out);
  // Whether `peer`'s process is known to have exited (same-host peers only).
  bool exited(int peer) {
    refreshExits();
    return exited_[static_cast<size_t>(peer)] != 0;
  }

 private:
  // Marks the same-host peers whose process exited: one poll() over the pidfds (and /proc for
  // a peer without one).
  void refreshExits();
  std::string who(int peer) const;

  const int rank_;
  const std::vector<PeerInfo> peers_;
  const unsigned char* const inbox_;
  const InboxLayout layout_;
  std::vector<int> pidfd_;  // -1: not same host, or no pidfd
  std::vector<uint8_t> left_, failed_, exited_;
  std::vector<pollfd> fds_;  // refreshExits' poll set and the peers it watches (reused)
  std::vector<int> fd_peer_;
};

}  // namespace resident
