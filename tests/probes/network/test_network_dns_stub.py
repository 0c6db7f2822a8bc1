"""network.dns and the node's own stub resolver, and glibc's order of nameservers, against real DNS servers on
port 53 of loopback addresses (resolv.conf has no port syntax): systemd-resolved's 127.0.0.53 dead or alive
beside a working upstream, a dnsmasq-style cache on a loopback address of its own, and a first nameserver
answering SERVFAIL.

The node is a network namespace of the test's own (its fake /proc/1/ns/net), where the servers listen: the
probe asks from there (a forked child enters it), and 127.0.0.53 is the test's whatever this machine runs."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.netservers import DnsTestServer, Netns, SilentUdpPort, ZoneResolver, made_in_netns, servers
from support.system import require_root, require_tool

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.dns import DnsProbe
from probes.runtime.host import Host
from probes.runtime.resolver import resolve_name, resolver_from_nameservers

ZONE = {"mirror.test": "127.0.0.1"}
STUB = "127.0.0.53"
UPSTREAM = "127.83.14.41"
CACHE = "127.83.14.42"  # a dnsmasq-style local cache: any loopback address
SERVFAIL_NS, ANSWERING_NS = "127.83.14.43", "127.83.14.44"

pytestmark = pytest.mark.system


@dataclass
class Node:
    root: Path  # the host root: etc/resolv.conf, and proc/1/ns/net naming the namespace
    ns: Netns

    def port53(self, address: str, resolver: ZoneResolver) -> DnsTestServer:
        return made_in_netns(self.ns.path, lambda: DnsTestServer(resolver, address=address, port=53))

    def silent53(self, address: str) -> SilentUdpPort:
        return made_in_netns(self.ns.path, lambda: SilentUdpPort(address, 53))

    def resolv_conf(self, text: str) -> None:
        (self.root / "etc" / "resolv.conf").write_text(text)

    def run_dns(self, names: list[str]) -> dict[str, Finding]:
        config = parse_config({"network": {"dns": {"names": names}}})
        out = DnsProbe().run(ProbeContext(Host(root=self.root, proc=self.root / "proc"), config, 8.0))
        return {f.subject: f for f in out if isinstance(f, Finding)}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    require_root()
    require_tool("ip")
    ns = Netns()
    try:
        (tmp_path / "proc" / "1" / "ns").mkdir(parents=True)
        (tmp_path / "proc" / "1" / "ns" / "net").symlink_to(ns.path)
        (tmp_path / "etc").mkdir()
        yield Node(tmp_path, ns)
    finally:
        ns.close()


@pytest.fixture
def upstream(node: Node) -> Iterator[DnsTestServer]:
    with servers() as started:
        server = node.port53(UPSTREAM, ZoneResolver(ZONE))
        started.append(server)
        yield server


def resolved(node: Node) -> Node:
    """The node's resolv.conf names systemd-resolved's stub; its upstream list names UPSTREAM."""
    node.resolv_conf(f"nameserver {STUB}\noptions edns0 trust-ad timeout:1 attempts:1\n")
    upstream = node.root / "run" / "systemd" / "resolve" / "resolv.conf"
    upstream.parent.mkdir(parents=True)
    upstream.write_text(f"nameserver {UPSTREAM}\noptions timeout:1 attempts:1\n")
    return node


@pytest.mark.parametrize("dead", ["nothing listening", "a listener that never answers"])
def test_a_dead_systemd_resolved_stub_fails_beside_a_working_upstream(
    dead: str, node: Node, upstream: DnsTestServer
) -> None:
    with servers() as started:
        if dead != "nothing listening":
            started.append(node.silent53(STUB))
        found = resolved(node).run_dns(["mirror.test"])
    name = found["mirror.test"]
    assert name.status is Status.OK and name.observed["answered_by"] == UPSTREAM  # the upstreams work
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.reason, stub.observed["error"]) == (Status.FAIL, "DnsStubFailed", "timeout"), stub
    assert stub.observed["service"] == "systemd-resolved"
    assert f"local stub resolver {STUB} (systemd-resolved)" in stub.message and "does not answer" in stub.message
    assert "every lookup on the node" in stub.message
    assert "systemctl restart systemd-resolved" in stub.hint


def test_a_live_stub_is_ok(node: Node, upstream: DnsTestServer) -> None:
    with servers() as started:
        started.append(node.port53(STUB, ZoneResolver({"mirror.test": "127.0.0.7"})))
        found = resolved(node).run_dns(["mirror.test", "gone.test"])
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.observed["asked"]) == (Status.OK, "mirror.test")
    assert "127.0.0.7" in stub.message
    assert found["mirror.test"].observed["addresses"] == ["127.0.0.1"]  # names themselves: from the upstreams


def test_a_dead_local_cache_fails_names_and_the_stub_with_the_service(node: Node) -> None:
    node.resolv_conf(f"nameserver {CACHE}\noptions timeout:1 attempts:1\n")
    found = node.run_dns(["mirror.test"])
    stub = found[f"stub:{CACHE}"]
    assert (stub.status, stub.reason) == (Status.FAIL, "DnsStubFailed")
    assert "dnsmasq" in stub.observed["service"] and "dnsmasq" in stub.hint and CACHE in stub.hint
    name = found["mirror.test"]
    assert (name.status, name.reason) == (Status.FAIL, "DnsFailed")
    assert f"local DNS cache (dnsmasq, unbound, nscd-style or NodeLocal DNSCache) at {CACHE}" in name.hint
    # The same cache answering: both are ok.
    with servers() as started:
        started.append(node.port53(CACHE, ZoneResolver(ZONE)))
        found = node.run_dns(["mirror.test"])
    assert found["mirror.test"].status is Status.OK and found[f"stub:{CACHE}"].status is Status.OK


def test_servfail_from_the_first_nameserver_moves_on_to_the_next_as_glibc_does(node: Node) -> None:
    node.resolv_conf(f"nameserver {SERVFAIL_NS}\nnameserver {ANSWERING_NS}\noptions timeout:1\n")
    with servers() as started:
        started.append(node.port53(SERVFAIL_NS, ZoneResolver(ZONE, servfail=("mirror.test", "both.test"))))
        started.append(node.port53(ANSWERING_NS, ZoneResolver(ZONE, servfail=("both.test",))))
        found = node.run_dns(["mirror.test", "both.test"])
    answered = found["mirror.test"]
    assert (answered.status, answered.observed["addresses"]) == (Status.OK, ["127.0.0.1"]), answered
    assert answered.observed["answered_by"] == ANSWERING_NS
    both = found["both.test"]  # only when every nameserver fails is it DnsFailed
    assert (both.status, both.reason, both.observed["error"]) == (Status.FAIL, "DnsFailed", "servfail")
    detail = both.observed["detail"]
    assert f"{SERVFAIL_NS} SERVFAIL" in detail and f"{ANSWERING_NS} SERVFAIL" in detail


def test_the_stub_is_asked_in_the_hosts_network_namespace_not_the_agents(node: Node) -> None:
    """The agent runs in its pod's network namespace; 127.0.0.53 listens in the host's. Here the host's is the
    test's namespace where nothing listens, the agent's (this process's) has a live stub (the test's, or this
    machine's own systemd-resolved): the stub must be found dead, so it was asked where the node's lookups go."""
    node.resolv_conf(f"nameserver {STUB}\noptions timeout:1 attempts:1\n")
    with servers() as started:
        try:
            started.append(DnsTestServer(ZoneResolver(ZONE), address=STUB, port=53))
        except OSError as exc:  # this machine runs a stub there already: alive in the wrong namespace too
            assert exc.errno == errno.EADDRINUSE, exc
        found = node.run_dns(["mirror.test"])
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.reason) == (Status.FAIL, "DnsStubFailed"), stub
    assert found["mirror.test"].reason == "DnsFailed"  # resolv.conf names only the stub: every lookup fails
    assert "systemd-resolved at 127.0.0.53" in found["mirror.test"].hint


def test_nameservers_that_fail_at_once_end_the_lookup_instead_of_spinning(node: Node) -> None:
    """In a namespace with no route but lo, every try to 192.0.2.53 fails at once (ENETUNREACH): the lookup ends
    with the error after one round, as glibc's does, instead of trying again and again until its lifetime."""
    setup = resolver_from_nameservers(["192.0.2.53", "192.0.2.54"])
    outcome = made_in_netns(node.ns.path, lambda: resolve_name(setup, "mirror.test", 1.0, 6.0))
    assert (outcome.kind, outcome.silent) == ("error", ()), outcome
    assert "192.0.2.53 OSError" in outcome.detail and "Network is unreachable" in outcome.detail
    assert outcome.duration < 5.0  # not the 6 s lifetime spent spinning
