// Which address of this host the tcp transport listens on, and how endpoints are written and
// parsed: IPv4 ("10.0.0.2:4711") or IPv6 ("[fd00::2]:4711").
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

namespace resident {

struct ListenAddress {
  std::string address;  // an IPv4 or IPv6 literal
  std::string reason;   // how it was chosen, for the log
};

// `setting` (RESIDENT_TCP_ADDR): an IPv4 or IPv6 address of this host (not a wildcard, not an
// IPv6 link-local one), or the name of an interface whose first IPv4 address is taken (its first
// global IPv6 address when it has no IPv4); InvalidArgument naming the interfaces when it is
// neither. Unset: the address this host reaches `rendezvous_host` from (the TCPStore's host:
// every rank reaches it, so the interface that routes to it is one the peers share), unless that
// is a loopback address; else firstNonLoopbackAddress().
ListenAddress chooseListenAddress(const std::string& setting, const std::string& rendezvous_host);

// The source address of the route to `host` (a name or a literal of either family, the first
// address it resolves to), found by connecting a UDP socket (no packet is sent); empty when it
// does not resolve or no route leads there.
std::string routeSourceAddress(const std::string& host);

// The host's (network namespace's) first non-loopback IPv4 address that is up, interfaces named
// docker* or virbr* only when there is no other; without one, its first global IPv6 address
// that is up; "127.0.0.1" if there is neither.
std::string firstNonLoopbackAddress();

bool isLoopbackAddress(const std::string& literal);

// A socket address of `literal` (IPv4 or IPv6) and `port`; false if `literal` is neither.
bool socketAddress(const std::string& literal, uint16_t port, sockaddr_storage& out,
                   socklen_t& len);
// "address:port", an IPv6 address in brackets.
std::string endpointText(const std::string& literal, uint16_t port);
std::string endpointText(const sockaddr* address);
std::string addressText(const sockaddr* address);  // the literal alone
uint16_t portOf(const sockaddr* address);          // in host order
// Parses what endpointText writes; false if malformed (or port 0).
bool parseEndpoint(const std::string& endpoint, sockaddr_storage& out, socklen_t& len);

}  // namespace resident
