// Which address the tcp transport listens on: RESIDENT_TCP_ADDR as an IPv4 or IPv6 address or
// an interface name (an unknown name is an error listing the interfaces), else the source
// address of the route to the rendezvous host unless that is loopback, else the first
// non-loopback interface; and the endpoint text peers publish ("a.b.c.d:port", "[v6]:port").
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "check.hpp"
#include "core/error.hpp"
#include "core/transport/tcp_address.hpp"

using namespace resident;

namespace {

bool hasIPv6Loopback() {
  sockaddr_storage s{};
  socklen_t len = 0;
  socketAddress("::1", 0, s, len);
  const int fd = socket(AF_INET6, SOCK_DGRAM, 0);
  if (fd < 0) return false;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&s), len) == 0;
  close(fd);
  return ok;
}

void checkEndpoints() {
  sockaddr_storage s{};
  socklen_t len = 0;
  CHECK(parseEndpoint("10.1.2.3:4711", s, len));
  CHECK(s.ss_family == AF_INET && len == sizeof(sockaddr_in));
  CHECK(endpointText(reinterpret_cast<const sockaddr*>(&s)) == "10.1.2.3:4711");
  CHECK(parseEndpoint("[fd00::2]:65535", s, len));
  CHECK(s.ss_family == AF_INET6 && len == sizeof(sockaddr_in6));
  CHECK(endpointText(reinterpret_cast<const sockaddr*>(&s)) == "[fd00::2]:65535");
  CHECK(addressText(reinterpret_cast<const sockaddr*>(&s)) == "fd00::2");
  CHECK(endpointText("fd00::2", 80) == "[fd00::2]:80");
  CHECK(endpointText("10.0.0.1", 80) == "10.0.0.1:80");
  // Malformed: no port, port 0 or out of range, IPv6 without brackets, IPv4 in brackets, names.
  for (const char* bad : {"10.1.2.3", "10.1.2.3:0", "10.1.2.3:65536", "10.1.2.3:x", "fd00::2:80",
                          "[10.1.2.3]:80", "[fd00::2]", "host:80", ":80", "[]:80"})
    CHECK(!parseEndpoint(bad, s, len));
  CHECK(isLoopbackAddress("127.0.0.1") && isLoopbackAddress("127.5.0.1") &&
        isLoopbackAddress("::1"));
  CHECK(!isLoopbackAddress("10.0.0.1") && !isLoopbackAddress("fd00::1") &&
        !isLoopbackAddress("lo"));
}

}  // namespace

int main() {
  checkEndpoints();

  // An address is taken as it is; an interface name gives that interface's address.
  CHECK(chooseListenAddress("127.0.0.1", "").address == "127.0.0.1");
  CHECK(chooseListenAddress("10.1.2.3", "somewhere").address == "10.1.2.3");
  CHECK(chooseListenAddress("fd00::7", "").address == "fd00::7");
  CHECK(chooseListenAddress("lo", "").address == "127.0.0.1");  // IPv4 before IPv6
  CHECK(chooseListenAddress("lo", "").reason.find("lo") != std::string::npos);
  bool threw = false;
  try {
    chooseListenAddress("nosuchif0", "");
  } catch (const InvalidArgument& e) {
    threw = true;
    const std::string m = e.what();
    CHECK(m.find("RESIDENT_TCP_ADDR") != std::string::npos);
    CHECK(m.find("'nosuchif0'") != std::string::npos);
    CHECK(m.find("lo 127.0.0.1") != std::string::npos);  // the interfaces there are
  }
  CHECK(threw);
  // Wildcards (every address: not one peers connect to) and an IPv6 link-local address (it
  // needs its interface with every use).
  CHECK_THROWS(chooseListenAddress("0.0.0.0", ""));
  CHECK_THROWS(chooseListenAddress("::", ""));
  CHECK_THROWS(chooseListenAddress("fe80::1", ""));

  // The route to a host: loopback for this host's loopback address, nothing for no host.
  CHECK(routeSourceAddress("127.0.0.1") == "127.0.0.1");
  CHECK(routeSourceAddress("").empty());
  if (hasIPv6Loopback()) CHECK(routeSourceAddress("::1") == "::1");

  // Unset: a loopback route (a store on this host's loopback) falls back to the first
  // non-loopback interface; a route through an interface gives that interface's address.
  const std::string first = firstNonLoopbackAddress();
  CHECK(chooseListenAddress("", "127.0.0.1").address == first);
  CHECK(chooseListenAddress("", "::1").address == first);
  CHECK(chooseListenAddress("", "").address == first);
  if (first != "127.0.0.1") {
    const ListenAddress routed = chooseListenAddress("", first);
    CHECK(routed.address == first);
    CHECK(routed.reason.find("route") != std::string::npos);
  }
  std::puts("test_tcp_address: ok");
  return 0;
}
