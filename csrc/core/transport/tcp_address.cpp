#include "core/transport/tcp_address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace resident {
namespace {

struct Interface {
  std::string name, address;
  bool ipv6 = false, up = false, loopback = false;
};

// Global-scope IPv6 addresses only: a link-local one needs its interface with every use.
std::vector<Interface> interfaces() {
  std::vector<Interface> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    const int family = a->ifa_addr->sa_family;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof(buf));
    } else if (family == AF_INET6) {
      const in6_addr& v6 = reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(&v6)) continue;
      inet_ntop(AF_INET6, &v6, buf, sizeof(buf));
    } else {
      continue;
    }
    out.push_back({a->ifa_name, buf, family == AF_INET6, (a->ifa_flags & IFF_UP) != 0,
                   (a->ifa_flags & IFF_LOOPBACK) != 0});
  }
  freeifaddrs(list);
  return out;
}

// Bridges of containers and virtual machines on this host: other hosts do not reach them.
bool isLocalBridge(const std::string& name) {
  return name.rfind("docker", 0) == 0 || name.rfind("virbr", 0) == 0;
}

}  // namespace

bool socketAddress(const std::string& literal, uint16_t port, sockaddr_storage& out,
                   socklen_t& len) {
  std::memset(&out, 0, sizeof(out));
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  if (inet_pton(AF_INET, literal.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    len = sizeof(sockaddr_in);
    return true;
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (inet_pton(AF_INET6, literal.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

std::string endpointText(const std::string& literal, uint16_t port) {
  const bool v6 = literal.find(':') != std::string::npos;
  return (v6 ? "[" + literal + "]" : literal) + ":" + std::to_string(port);
}

std::string addressText(const sockaddr* address) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (address->sa_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr, buf,
              sizeof(buf));
  else
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr, buf, sizeof(buf));
  return buf;
}

uint16_t portOf(const sockaddr* address) {
  return ntohs(address->sa_family == AF_INET6
                   ? reinterpret_cast<const sockaddr_in6*>(address)->sin6_port
                   : reinterpret_cast<const sockaddr_in*>(address)->sin_port);
}

std::string endpointText(const sockaddr* address) {
  return endpointText(addressText(address), portOf(address));
}

bool parseEndpoint(const std::string& endpoint, sockaddr_storage& out, socklen_t& len) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    if (host.find(':') == std::string::npos) return false;  // brackets hold IPv6 only
  } else if (host.find(':') != std::string::npos) {
    return false;  // IPv6 without brackets: the port is ambiguous
  }
  char* end = nullptr;
  const unsigned long v = std::strtoul(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || v == 0 || v > 65535) return false;
  return socketAddress(host, static_cast<uint16_t>(v), out, len);
}

bool isLoopbackAddress(const std::string& literal) {
  sockaddr_storage s{};
  socklen_t len = 0;
  if (!socketAddress(literal, 0, s, len)) return false;
  if (s.ss_family == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&s)->sin_addr.s_addr) >> 24) == 127;
  return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr);
}

std::string routeSourceAddress(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr)
    return "";
  std::string out;
  const int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      out = addressText(reinterpret_cast<const sockaddr*>(&local));
      // A link-local source needs its interface with every use: not one to publish.
      if (local.ss_family == AF_INET6 &&
          IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr))
        out.clear();
    }
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

std::string firstNonLoopbackAddress() {
  std::string bridge, v6;
  for (const Interface& i : interfaces()) {
    if (i.loopback || !i.up) continue;
    if (i.ipv6) {
      if (v6.empty()) v6 = i.address;
    } else if (!isLocalBridge(i.name)) {
      return i.address;
    } else if (bridge.empty()) {
      bridge = i.address;
    }
  }
  if (!bridge.empty()) return bridge;
  return v6.empty() ? "127.0.0.1" : v6;
}

ListenAddress chooseListenAddress(const std::string& setting, const std::string& rendezvous_host) {
  if (!setting.empty()) {
    sockaddr_storage s{};
    socklen_t len = 0;
    if (socketAddress(setting, 0, s, len)) {
      const bool any =
          s.ss_family == AF_INET
              ? reinterpret_cast<const sockaddr_in*>(&s)->sin_addr.s_addr == INADDR_ANY
              : IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr);
      const bool link_local =
          s.ss_family == AF_INET6 &&
          IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr);
      if (!any && !link_local) return {setting, "RESIDENT_TCP_ADDR"};
    }
    std::string known, v6;
    for (const Interface& i : interfaces()) {
      if (i.name == setting) {
        if (!i.ipv6) return {i.address, "RESIDENT_TCP_ADDR=" + setting};
        if (v6.empty()) v6 = i.address;
      }
      known += (known.empty() ? "" : ", ") + i.name + " " + i.address;
    }
    if (!v6.empty()) return {v6, "RESIDENT_TCP_ADDR=" + setting};
    throw InvalidArgument(
        "resident: RESIDENT_TCP_ADDR must be an IPv4 or IPv6 address of this host (not 0.0.0.0, "
        ":: or an IPv6 link-local one) or the name of an interface with one, got '" +
        setting + "' (addresses here: " + (known.empty() ? "none" : known) + ")");
  }
  const std::string routed = routeSourceAddress(rendezvous_host);
  if (!routed.empty() && !isLoopbackAddress(routed))
    return {routed, "the route to the rendezvous host " + rendezvous_host};
  return {firstNonLoopbackAddress(), "the first non-loopback interface"};
}

}  // namespace resident
