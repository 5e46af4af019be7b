"""Hosts for the tcp tests, played by Linux network namespaces (test_tcp_netns.py,
test_tcp_netns_torchrun.py, test_tcp_netns_faults.py, test_cuda_tcp.py), and the settings those
modules share.

hosts_for_module makes one namespace per "host", each joined by a veth pair to a bridge in the
root namespace, and removes them afterwards, also when a test fails; each module's fixture gives
it names and a subnet of its own (the kernel removes a module's namespaces asynchronously, so
the next module cannot take the same names at once). A rank enters its host's namespace first
thing in its process (rank_process: RESIDENT_TEST_NETNS). Made over rtnetlink (netns.py: no
iproute2 needed); without root or the right to create namespaces the tests that need them skip,
saying why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re

import pytest

import netns as N

# Shared by the tcp test modules: their groups' timeout in the fault cases and the slack a
# test allows on top of it, an error text that names rank 1, tcp forced on one host.
GROUP_TIMEOUT_S = 5
SLACK_S = 10
NAMES_RANK_1 = re.compile(r"rank\D{0,3}1\b", re.IGNORECASE)
ONE_HOST_TCP = {"RESIDENT_TRANSPORT": "tcp"}


class Hosts:
    def __init__(self, names, bridge_ip, ips):
        self.names = names
        self.bridge_ip = bridge_ip
        self.ips = ips

    def env(self, layout=None, **extra):
        """Environment of the ranks: rank r in namespace names[layout[r]] (default: its own)."""
        names = self.names if layout is None else [self.names[i] for i in layout]
        env = {"RESIDENT_TEST_NETNS": ",".join(names), "RESIDENT_TEST_STORE_HOST": self.bridge_ip}
        env.update(extra)
        return env


def remove_stale():
    """Namespaces and bridges of earlier runs whose process is gone (a killed pytest)."""
    for name in N.list_netns():
        m = re.fullmatch(r"rpn(\d+)-\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            N.del_netns(name)
    for name in N.links():
        m = re.fullmatch(r"rp[a-z0-9](\d+)", name)  # any module's bridge: "rp", one character, the pid
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            with contextlib.suppress(OSError):
                N.del_link(name)


def make_hosts(count, net, bridge, names, decoy):
    """Namespaces `names` on `bridge` (addresses net.2, net.3, ... on an interface named
    "eth1" in each; the bridge net.1; `net` an IPv6 prefix "fdXX:...::" instead: those hosts have
    IPv6 addresses alone, loopback aside). With `decoy`, each first gets an interface "decoy0"
    whose address no other host reaches."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (these tests play hosts with them)")
    v6 = net.endswith("::")
    bridge_ip = f"{net}1" if v6 else f"{net}.1"
    ips = [f"{net}{i + 2}" if v6 else f"{net}.{i + 2}" for i in range(count)]
    prefix = "/64" if v6 else "/24"
    try:
        remove_stale()
        N.add_bridge(bridge)
        N.add_address(bridge, bridge_ip + prefix)
        N.set_up(bridge)
        for i, name in enumerate(names):
            N.add_netns(name)
            if decoy:  # made first, so listed first; its other end goes nowhere
                N.add_veth(f"{bridge}x{i}", "decoy0", name)
                N.add_address("decoy0", f"10.211.{i}.2/24", name)
                N.set_up("decoy0", netns=name)
            outer = f"{bridge}v{i}"
            N.add_veth(outer, "eth1", name)
            N.set_master(outer, bridge)
            N.set_up(outer)
            N.add_address("eth1", ips[i] + prefix, name)
            N.set_up("eth1", netns=name)
            N.set_up("lo", netns=name)
    except OSError as e:
        teardown(bridge, names)
        if e.errno == errno.EEXIST:  # another fixture's names still there: a test bug
            pytest.fail(f"network namespace hosts: a name is taken ({e}); each module's hosts "
                        "need names of their own", pytrace=False)
        reason = "not permitted (EPERM)" if e.errno == errno.EPERM else "failed"
        pytest.skip(f"cannot create network namespaces here ({reason}): {e}")
    return Hosts(names, bridge_ip, ips)


def hosts_for_module(count, subnet, bridge_prefix, first_index, decoy, ipv6=False):
    """A module fixture's body: the namespaces made, yielded, then removed."""
    pid = os.getpid()
    bridge = f"{bridge_prefix}{pid}"
    names = [f"rpn{pid}-{first_index + i}" for i in range(count)]
    net = f"fd{subnet:02x}:{pid % 65536:x}::" if ipv6 else f"10.{subnet}.{20 + pid % 200}"
    made = make_hosts(count, net, bridge, names, decoy)
    try:
        yield made
    finally:
        teardown(bridge, names)


def teardown(bridge, names):
    for name in names:
        N.del_netns(name)  # its veth pair goes with the namespace
    with contextlib.suppress(OSError):
        N.del_link(bridge)


# What a group spanning hosts gets by default, the mode multi-host users run: each peer's
# transport and path chosen per peer (shm and direct stores within a host, tcp through the proxy
# between hosts) in one group. Mode ids name the hosts of the ranks in order; the mode's
# environment only carries that layout to the spawn (an unknown variable to the backend).
NETNS_MIX_MODES = [("hosts-001", {"OPMIX_NETNS_LAYOUT": "0,0,1"}),
                   ("hosts-0011", {"OPMIX_NETNS_LAYOUT": "0,0,1,1"})]


def mix_layout(mode_env) -> list:
    """The hosts of the ranks, in rank order, of a NETNS_MIX_MODES mode."""
    return [int(i) for i in mode_env["OPMIX_NETNS_LAYOUT"].split(",")]


class NetnsMixEnv:
    """spawn_env of an op-mix job whose ranks play hosts: each rank in the namespace of its
    host in the mode's layout, on the `hosts` fixture of the test that runs the job (the tests
    set `hosts` first: each module makes its own namespaces), plus `extra`."""

    def __init__(self, extra=None):
        self.hosts = None
        self.extra = dict(extra or {})

    def __call__(self, mode_env):
        return {**self.extra, **self.hosts.env(layout=mix_layout(mode_env))}
