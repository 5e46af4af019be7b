// PeerMonitor (csrc/core/peer_monitor.hpp): a same-host peer whose process exited is reported
// as failed once, whether or not it was reaped (a zombie counts); a peer that wrote "left"
// into its state word and then exits is reported as left, never as failed; a peer that wrote
// "failed" is reported with the rank it found dead and how (exited, or stopped answering over the
// network); processHasExited agrees with the kernel.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/clock.hpp"
#include "core/layout.hpp"
#include "core/peer_monitor.hpp"
#include "core/process_state.hpp"

namespace {

using resident::InboxLayout;
using resident::PeerInfo;
using resident::PeerMonitor;

pid_t sleeper() {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    // Dies with this process: a failed CHECK exits it, and a child left sleeping would keep the
    // test's output pipe open (the runner would wait for its timeout instead of failing).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    pause();
    _exit(0);
  }
  return pid;
}

std::vector<PeerInfo> peersOf(const std::vector<pid_t>& pids) {
  std::vector<PeerInfo> peers(pids.size());
  for (size_t i = 0; i < pids.size(); ++i) {
    peers[i].pid = static_cast<int>(pids[i]);
    peers[i].same_host = true;
    peers[i].host = "here";
    peers[i].name = "rank " + std::to_string(i);
  }
  return peers;
}

// Polls until `n` events arrived or 2 s passed.
std::vector<PeerMonitor::Event> pollFor(PeerMonitor& m, size_t n) {
  std::vector<PeerMonitor::Event> out;
  const uint64_t deadline = resident::nowNs() + 2000000000ull;
  while (out.size() < n && resident::nowNs() < deadline) {
    m.poll(out);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return out;
}

void setState(std::vector<unsigned char>& inbox, const InboxLayout& lay, int peer, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(inbox.data() + lay.peerStateOffset(peer)), v,
                   __ATOMIC_RELEASE);
}

}  // namespace

int main() {
  const int nranks = 5;  // rank 0 is this process; ranks 1-4 are children
  const InboxLayout lay(nranks, 4, 4096);
  std::vector<unsigned char> inbox(lay.totalBytes(), 0);
  CHECK(lay.peerStateOffset(nranks - 1) + 8 <= lay.ringOffset(0, resident::kCollectiveRing));

  std::vector<pid_t> pids = {getpid(), sleeper(), sleeper(), sleeper(), sleeper()};
  PeerMonitor mon(0, peersOf(pids), inbox.data(), lay);
  std::vector<PeerMonitor::Event> ev;
  {
    // A peer whose group failed because rank 2 left in order while an op still needed it: the
    // reason names rank 2 as gone that way, and rank 2 is not reported dead.
    std::vector<unsigned char> inbox2(lay.totalBytes(), 0);
    PeerMonitor mon2(0, peersOf(pids), inbox2.data(), lay);
    setState(inbox2, lay, 1,
             resident::kPeerStateFailed | (uint64_t{2 + 1} << 8) | resident::kPeerStateCauseLeft);
    ev = pollFor(mon2, 1);
    CHECK(ev.size() == 1 && ev[0].peer == 1 && ev[0].failed && ev[0].dead == -1);
    CHECK(ev[0].reason.find("after rank 2 destroyed its process group") != std::string::npos);
    ev.clear();
  }
  mon.poll(ev);
  CHECK(ev.empty());  // everyone alive
  CHECK(!resident::processHasExited(pids[1]));

  // Rank 1 killed and not reaped: a zombie is reported as failed, naming it.
  kill(pids[1], SIGKILL);
  ev = pollFor(mon, 1);
  CHECK(ev.size() == 1 && ev[0].peer == 1 && ev[0].failed && ev[0].dead == 1);
  CHECK(ev[0].reason.find("rank 1") != std::string::npos);
  CHECK(resident::processHasExited(pids[1]));  // zombie counts as exited
  ev.clear();
  mon.poll(ev);
  CHECK(ev.empty());  // reported once

  // Rank 2 leaves in order, then exits (and is reaped): left, never failed.
  setState(inbox, lay, 2, resident::kPeerStateLeft);
  kill(pids[2], SIGTERM);
  CHECK(waitpid(pids[2], nullptr, 0) == pids[2]);
  ev = pollFor(mon, 1);
  CHECK(ev.size() == 1 && ev[0].peer == 2 && !ev[0].failed);
  ev.clear();
  mon.poll(ev);
  CHECK(ev.empty());

  // Rank 3 reports that its group failed after it found rank 1 dead.
  setState(inbox, lay, 3, resident::kPeerStateFailed | (uint64_t{1 + 1} << 8));
  ev = pollFor(mon, 1);
  CHECK(ev.size() == 1 && ev[0].peer == 3 && ev[0].failed && ev[0].dead == 1);
  CHECK(!ev[0].unreachable);
  CHECK(ev[0].reason.find("found rank 1 dead") != std::string::npos);

  // Rank 4 reports that its group failed after rank 2 stopped answering over the network.
  setState(inbox, lay, 4,
           resident::kPeerStateFailed | (uint64_t{2 + 1} << 8) | resident::kPeerStateUnreachable);
  ev = pollFor(mon, 1);
  CHECK(ev.size() == 1 && ev[0].peer == 4 && ev[0].failed && ev[0].dead == 2);
  CHECK(ev[0].unreachable);
  CHECK(ev[0].reason.find("rank 2 stopped answering over the network") != std::string::npos);

  kill(pids[3], SIGKILL);
  kill(pids[4], SIGKILL);
  waitpid(pids[1], nullptr, 0);
  waitpid(pids[3], nullptr, 0);
  waitpid(pids[4], nullptr, 0);
  std::printf("peer monitor: ok\n");
  return 0;
}
