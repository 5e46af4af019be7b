// netns_rtnetlink.hpp: what `ip netns add` and `ip link` / `ip addr` would do for tcp_floor.cpp's
// namespace rows, over rtnetlink (a machine without iproute2 still lets root do it). Each call
// returns "" or why it failed. Header-only, so that the program builds from its one .cpp.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace rtnl {

constexpr int kAnswerMs = 30000;  // the kernel's answer to one request

// A thread that cannot go back to its own namespace would run the rest of the program in the
// wrong one.
[[noreturn]] inline void BackHomeFailed() {
  fprintf(stderr, "setns back to this thread's network namespace: %s\n", strerror(errno));
  exit(2);
}

inline std::string NsPath(const char* ns) {
  return std::string("/var/run/netns/") + ns;
}

// This thread into namespace `ns` (nullptr: stays) for the life of the object: a netlink socket
// and an interface index belong to the namespace of the thread that opens or asks.
class InNetns {
 public:
  explicit InNetns(const char* ns) {
    if (ns == nullptr) return;
    home_ = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    const int fd = open(NsPath(ns).c_str(), O_RDONLY | O_CLOEXEC);
    ok_ = home_ >= 0 && fd >= 0 && setns(fd, CLONE_NEWNET) == 0;
    if (!ok_) why_ = "setns " + NsPath(ns) + ": " + strerror(errno);
    if (fd >= 0) close(fd);
  }
  ~InNetns() {
    if (home_ < 0) return;
    if (ok_ && setns(home_, CLONE_NEWNET) != 0) BackHomeFailed();
    close(home_);
  }
  const std::string& why() const { return why_; }

 private:
  int home_ = -1;
  bool ok_ = true;
  std::string why_;
};

inline void PutAttr(std::string& m, uint16_t type, const void* data, size_t n) {
  const rtattr a{static_cast<unsigned short>(RTA_LENGTH(n)), type};
  m.append(reinterpret_cast<const char*>(&a), sizeof(a));
  m.append(static_cast<const char*>(data), n);
  m.append(RTA_ALIGN(n) - n, '\0');
}
inline void PutAttr(std::string& m, uint16_t type, const std::string& text) {
  PutAttr(m, type, text.c_str(), text.size() + 1);
}
// A nested attribute: opened, filled, then closed (its length patched).
inline size_t OpenAttr(std::string& m, uint16_t type) {
  const size_t at = m.size();
  const rtattr a{0, type};
  m.append(reinterpret_cast<const char*>(&a), sizeof(a));
  return at;
}
inline void CloseAttr(std::string& m, size_t at) {
  const auto n = static_cast<unsigned short>(m.size() - at);
  memcpy(&m[at], &n, sizeof(n));
}
inline std::string IfInfo(int index = 0, unsigned flags = 0, unsigned change = 0) {
  ifinfomsg i{};
  i.ifi_family = AF_UNSPEC, i.ifi_index = index, i.ifi_flags = flags, i.ifi_change = change;
  return std::string(reinterpret_cast<const char*>(&i), sizeof(i));
}

// One request in namespace `ns`, answered by the kernel's acknowledgement: "" or why not.
inline std::string Netlink(const char* ns, uint16_t type, uint16_t flags, const std::string& body,
                           const std::string& what) {
  int fd = -1;
  {
    InNetns in(ns);
    if (!in.why().empty()) return what + ": " + in.why();
    fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  }
  if (fd < 0) return what + ": netlink socket: " + strerror(errno);
  nlmsghdr h{};
  h.nlmsg_len = static_cast<uint32_t>(sizeof(h) + body.size());
  h.nlmsg_type = type;
  h.nlmsg_flags = static_cast<uint16_t>(NLM_F_REQUEST | NLM_F_ACK | flags);
  h.nlmsg_seq = 1;
  std::string m(reinterpret_cast<const char*>(&h), sizeof(h));
  m += body;
  std::string why = what + ": no answer from the kernel";
  alignas(nlmsghdr) char buf[8192];
  if (send(fd, m.data(), m.size(), 0) != ssize_t(m.size())) {
    why = what + ": netlink send: " + strerror(errno);
  } else if (pollfd p{fd, POLLIN, 0}; poll(&p, 1, kAnswerMs) > 0) {
    const ssize_t k = recv(fd, buf, sizeof(buf), 0);
    const auto* r = reinterpret_cast<const nlmsghdr*>(buf);
    if (k >= ssize_t(sizeof(nlmsghdr) + sizeof(nlmsgerr)) && r->nlmsg_type == NLMSG_ERROR) {
      const int err = static_cast<const nlmsgerr*>(NLMSG_DATA(r))->error;
      why = err == 0 ? "" : what + ": " + strerror(-err);
    }
  }
  close(fd);
  return why;
}

inline int IndexIn(const char* ns, const char* link) {
  InNetns in(ns);
  return in.why().empty() ? static_cast<int>(if_nametoindex(link)) : 0;
}

// What `ip netns add` does: a new namespace bind-mounted on /var/run/netns/<ns>.
inline std::string AddNetns(const char* ns) {
  mkdir("/var/run/netns", 0755);
  const std::string path = NsPath(ns);
  const int f = open(path.c_str(), O_RDONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0);
  if (f < 0) return "create " + path + ": " + strerror(errno);
  close(f);
  const int home = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  std::string why;
  if (home < 0 || unshare(CLONE_NEWNET) != 0) {
    why = std::string("unshare(CLONE_NEWNET): ") + strerror(errno);
  } else {
    if (mount("/proc/thread-self/ns/net", path.c_str(), "none", MS_BIND, nullptr) != 0)
      why = "bind mount on " + path + ": " + strerror(errno);
    if (setns(home, CLONE_NEWNET) != 0) BackHomeFailed();
  }
  if (home >= 0) close(home);
  if (!why.empty()) unlink(path.c_str());
  return why;
}

inline std::string LinkUp(const char* ns, const char* link) {
  const int index = IndexIn(ns, link);
  if (index == 0) return std::string("no link ") + link + " in " + ns;
  return Netlink(ns, RTM_NEWLINK, 0, IfInfo(index, IFF_UP, IFF_UP),
                 std::string("set ") + link + " up in " + ns);
}

inline std::string AddAddress(const char* ns, const char* link, const char* addr) {
  const int index = IndexIn(ns, link);
  if (index == 0) return std::string("no link ") + link + " in " + ns;
  ifaddrmsg a{};
  a.ifa_family = AF_INET, a.ifa_prefixlen = 24, a.ifa_index = static_cast<unsigned>(index);
  in_addr ip{};
  if (inet_pton(AF_INET, addr, &ip) != 1) return std::string("not an IPv4 address: ") + addr;
  std::string body(reinterpret_cast<const char*>(&a), sizeof(a));
  PutAttr(body, IFA_LOCAL, &ip, sizeof(ip));
  PutAttr(body, IFA_ADDRESS, &ip, sizeof(ip));
  return Netlink(ns, RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body,
                 std::string("add ") + addr + "/24 to " + link + " in " + ns);
}

// A veth pair: `a` in namespace `ns_a`, its peer `b` in `ns_b`.
inline std::string AddVeth(const char* ns_a, const char* a, const char* ns_b, const char* b) {
  const int fd_b = open(NsPath(ns_b).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_b < 0) return "open " + NsPath(ns_b) + ": " + strerror(errno);
  std::string body = IfInfo();
  PutAttr(body, IFLA_IFNAME, a);
  const size_t info = OpenAttr(body, IFLA_LINKINFO);
  PutAttr(body, IFLA_INFO_KIND, "veth");
  const size_t data = OpenAttr(body, IFLA_INFO_DATA);
  const size_t peer = OpenAttr(body, VETH_INFO_PEER);
  body += IfInfo();
  PutAttr(body, IFLA_IFNAME, b);
  const uint32_t ns_fd = static_cast<uint32_t>(fd_b);
  PutAttr(body, IFLA_NET_NS_FD, &ns_fd, sizeof(ns_fd));
  CloseAttr(body, peer);
  CloseAttr(body, data);
  CloseAttr(body, info);
  const std::string why =
      Netlink(ns_a, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body,
              std::string("add veth ") + a + " in " + ns_a + " (peer " + b + " in " + ns_b + ")");
  close(fd_b);
  return why;
}

}  // namespace rtnl
