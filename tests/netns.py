"""Network namespaces, veth pairs and bridges without iproute2: rtnetlink from Python.

The tests that play hosts with network namespaces need what `ip netns add`, `ip link add ...
type veth|bridge`, `ip link set ... master|up|down` and `ip addr add` do. Machines without
iproute2 (the GPU machine's image) still let root make them, so this module speaks rtnetlink
itself (NETLINK_ROUTE messages over an AF_NETLINK socket) and makes named namespaces the way
`ip netns` does: a file under /var/run/netns with the namespace bind-mounted on it, so that a
process enters it with setns(2) on that file (`enter`) and `ip netns` sees it.

Work inside a namespace runs on the calling thread only, between setns(2) into the namespace
and back (`inside(name)`): a netlink socket belongs to the namespace of the thread that opened
it, and a network namespace is per thread, so no fork is needed.

Failures raise NetnsError with what was asked and the kernel's errno text.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import socket
import struct

NETNS_DIR = "/var/run/netns"

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MNT_DETACH = 2

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR = 16, 17, 20
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
IFLA_IFNAME, IFLA_MASTER, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 10, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
VETH_INFO_PEER = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02  # an IPv6 address usable at once, without duplicate address detection
IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(OSError):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise NetnsError(e, f"{what}: {os.strerror(e)}")


def _setns(fd: int, what: str) -> None:
    _check(_libc.setns(fd, CLONE_NEWNET), f"setns({what})")


def path_of(name: str) -> str:
    return name if name.startswith("/") else os.path.join(NETNS_DIR, name)


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def add_netns(name: str) -> None:
    """A new network namespace, kept alive by a bind mount on /var/run/netns/<name>."""
    os.makedirs(NETNS_DIR, mode=0o755, exist_ok=True)
    path = path_of(name)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    except FileExistsError:
        raise NetnsError(errno.EEXIST, f"network namespace {name} exists") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        try:
            _check(_libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", MS_BIND,
                               None), f"bind mount of the new namespace on {path}")
        finally:
            _setns(home, "back to this thread's namespace")
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(home)


def del_netns(name: str) -> None:
    """What `ip netns del` does; the namespace ends once no process is in it (its veth ends
    go with it). A name that is not there is not an error."""
    path = path_of(name)
    _libc.umount2(path.encode(), MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def enter(name: str) -> None:
    """This thread into namespace `name` (a name under /var/run/netns, or a path such as
    /proc/<pid>/ns/net), for good: what `ip netns exec` does before it runs its command."""
    fd = os.open(path_of(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, path_of(name))
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(name: str | None):
    """This thread in namespace `name` for the block (None: stays where it is)."""
    if name is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter(name)
        try:
            yield
        finally:
            _setns(home, "back to this thread's namespace")
    finally:
        os.close(home)


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _name(s: str) -> bytes:
    return s.encode() + b"\0"


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


def _request(kind: int, flags: int, body: bytes, what: str, netns: str | None) -> None:
    """One request, answered by the kernel's acknowledgement or its error."""
    with inside(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
    with sock:
        sock.bind((0, 0))
        msg = struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, 1,
                          0) + body
        sock.send(msg)
        while True:
            data = sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, mtype, _f, seq, _pid = struct.unpack_from("=IHHII", data, off)
                if mtype == NLMSG_ERROR and seq == 1:
                    (err,) = struct.unpack_from("=i", data, off + 16)
                    if err:
                        raise NetnsError(-err, f"{what}: {os.strerror(-err)}")
                    return
                off += (length + 3) & ~3


def index_of(link: str, netns: str | None = None) -> int:
    with inside(netns):
        try:
            return socket.if_nametoindex(link)
        except OSError:
            raise NetnsError(errno.ENODEV, f"no link {link}"
                             f"{' in namespace ' + netns if netns else ''}") from None


def links(netns: str | None = None) -> list[str]:
    with inside(netns):
        return [n for _i, n in socket.if_nameindex()]


def add_bridge(name: str) -> None:
    info = _attr(IFLA_INFO_KIND, _name("bridge"))
    _request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL,
             _ifinfo() + _attr(IFLA_IFNAME, _name(name)) + _attr(IFLA_LINKINFO, info),
             f"add bridge {name}", None)


def add_veth(outer: str, inner: str, inner_netns: str) -> None:
    """A veth pair: `outer` here, `inner` in namespace `inner_netns`."""
    fd = os.open(path_of(inner_netns), os.O_RDONLY)
    try:
        peer = _ifinfo() + _attr(IFLA_IFNAME, _name(inner)) + _attr(IFLA_NET_NS_FD,
                                                                     struct.pack("=I", fd))
        info = _attr(IFLA_INFO_KIND, _name("veth")) + _attr(IFLA_INFO_DATA,
                                                            _attr(VETH_INFO_PEER, peer))
        _request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL,
                 _ifinfo() + _attr(IFLA_IFNAME, _name(outer)) + _attr(IFLA_LINKINFO, info),
                 f"add veth {outer} (peer {inner} in {inner_netns})", None)
    finally:
        os.close(fd)


def set_master(link: str, bridge: str) -> None:
    _request(RTM_NEWLINK, 0,
             _ifinfo(index_of(link)) + _attr(IFLA_MASTER, struct.pack("=I", index_of(bridge))),
             f"set {link} master {bridge}", None)


def set_up(link: str, up: bool = True, netns: str | None = None) -> None:
    _request(RTM_NEWLINK, 0, _ifinfo(index_of(link, netns), IFF_UP if up else 0, IFF_UP),
             f"set {link} {'up' if up else 'down'}", netns)


def add_address(link: str, cidr: str, netns: str | None = None) -> None:
    """An IPv4 or IPv6 address (an IPv6 one usable at once: no duplicate address detection)."""
    iface = ipaddress.ip_interface(cidr)
    v6 = iface.version == 6
    body = struct.pack("=BBBBI", socket.AF_INET6 if v6 else socket.AF_INET,
                       iface.network.prefixlen, IFA_F_NODAD if v6 else 0, 0, index_of(link, netns))
    body += _attr(IFA_LOCAL, iface.ip.packed) + _attr(IFA_ADDRESS, iface.ip.packed)
    _request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body, f"add address {cidr} to {link}",
             netns)


def del_link(link: str) -> None:
    _request(RTM_DELLINK, 0, _ifinfo(index_of(link)), f"delete link {link}", None)
