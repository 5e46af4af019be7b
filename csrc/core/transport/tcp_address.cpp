#include "core/transport/tcp_address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace resident {
namespace {

struct Interface {
  std::string name, address;
  bool up = false, loopback = false;
};

std::vector<Interface> ipv4Interfaces() {
  std::vector<Interface> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    if (inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf,
                  sizeof(buf)) == nullptr)
      continue;
    out.push_back(
        {a->ifa_name, buf, (a->ifa_flags & IFF_UP) != 0, (a->ifa_flags & IFF_LOOPBACK) != 0});
  }
  freeifaddrs(list);
  return out;
}

bool isIPv4Literal(const std::string& s, in_addr* out) {
  return inet_pton(AF_INET, s.c_str(), out) == 1;
}

bool isLoopback(const std::string& address) {
  in_addr a{};
  return isIPv4Literal(address, &a) && (ntohl(a.s_addr) >> 24) == 127;
}

// Bridges of containers and virtual machines on this host: other hosts do not reach them.
bool isLocalBridge(const std::string& name) {
  return name.rfind("docker", 0) == 0 || name.rfind("virbr", 0) == 0;
}

}  // namespace

std::string routeSourceAddress(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr)
    return "";
  std::string out;
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char buf[INET_ADDRSTRLEN] = {0};
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)) != nullptr)
      out = buf;
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

std::string firstNonLoopbackIPv4() {
  std::string bridge;
  for (const Interface& i : ipv4Interfaces()) {
    if (i.loopback || !i.up) continue;
    if (!isLocalBridge(i.name)) return i.address;
    if (bridge.empty()) bridge = i.address;
  }
  return bridge.empty() ? "127.0.0.1" : bridge;
}

ListenAddress chooseListenAddress(const std::string& setting, const std::string& rendezvous_host) {
  if (!setting.empty()) {
    in_addr a{};
    if (isIPv4Literal(setting, &a) && a.s_addr != INADDR_ANY) return {setting, "RESIDENT_TCP_ADDR"};
    std::string known;
    for (const Interface& i : ipv4Interfaces()) {
      if (i.name == setting) return {i.address, "RESIDENT_TCP_ADDR=" + setting};
      known += (known.empty() ? "" : ", ") + i.name + " " + i.address;
    }
    throw InvalidArgument(
        "resident: RESIDENT_TCP_ADDR must be an IPv4 address of this host (not 0.0.0.0) or "
        "the name of an interface with one, got '" +
        setting + "' (interfaces with IPv4 addresses here: " + (known.empty() ? "none" : known) +
        ")");
  }
  const std::string routed = routeSourceAddress(rendezvous_host);
  if (!routed.empty() && !isLoopback(routed))
    return {routed, "the route to the rendezvous host " + rendezvous_host};
  return {firstNonLoopbackIPv4(), "the first non-loopback interface"};
}

}  // namespace resident
