// Which address the tcp transport listens on: RESIDENT_TCP_ADDR as an IPv4 address or an
// interface name (an unknown name is an error listing the interfaces), else the source address
// of the route to the rendezvous host unless that is loopback, else the first non-loopback
// interface.
#include <string>

#include "check.hpp"
#include "core/error.hpp"
#include "core/transport/tcp_address.hpp"

using namespace resident;

int main() {
  // An address is taken as it is; an interface name gives that interface's address.
  CHECK(chooseListenAddress("127.0.0.1", "").address == "127.0.0.1");
  CHECK(chooseListenAddress("10.1.2.3", "somewhere").address == "10.1.2.3");
  CHECK(chooseListenAddress("lo", "").address == "127.0.0.1");
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
  CHECK_THROWS(chooseListenAddress("0.0.0.0", ""));  // every address: not one peers connect to

  // The route to a host: loopback for this host's loopback address, nothing for no host.
  CHECK(routeSourceAddress("127.0.0.1") == "127.0.0.1");
  CHECK(routeSourceAddress("").empty());

  // Unset: a loopback route (a store on this host's loopback) falls back to the first
  // non-loopback interface; a route through an interface gives that interface's address.
  const std::string first = firstNonLoopbackIPv4();
  CHECK(chooseListenAddress("", "127.0.0.1").address == first);
  CHECK(chooseListenAddress("", "").address == first);
  if (first != "127.0.0.1") {
    const ListenAddress routed = chooseListenAddress("", first);
    CHECK(routed.address == first);
    CHECK(routed.reason.find("route") != std::string::npos);
  }
  std::puts("test_tcp_address: ok");
  return 0;
}
