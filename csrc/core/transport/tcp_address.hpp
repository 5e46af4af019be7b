// Which IPv4 address of this host the tcp transport listens on, and peers connect to.
#pragma once

#include <string>

namespace resident {

struct ListenAddress {
  std::string address;  // dotted IPv4
  std::string reason;   // how it was chosen, for the log
};

// `setting` (RESIDENT_TCP_ADDR): an IPv4 address of this host, or the name of an interface whose
// first IPv4 address is taken; InvalidArgument naming the interfaces when it is neither. Unset:
// the address this host reaches `rendezvous_host` from (the TCPStore's host: every rank reaches
// it, so the interface that routes to it is one the peers share), unless that is a loopback
// address; else the first non-loopback IPv4 of an interface that is up, container and virtual
// machine bridges (docker*, virbr*) last; "127.0.0.1" when there is none.
ListenAddress chooseListenAddress(const std::string& setting, const std::string& rendezvous_host);

// The source address of the route to `host` (a name or dotted IPv4), found by connecting a UDP
// socket (no packet is sent); empty when it does not resolve or no route leads there.
std::string routeSourceAddress(const std::string& host);

// The host's (network namespace's) first non-loopback IPv4 address that is up, interfaces named
// docker* or virbr* only when there is no other; "127.0.0.1" if there is none.
std::string firstNonLoopbackIPv4();

}  // namespace resident
