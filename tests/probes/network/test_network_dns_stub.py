"""network.dns and the node's own stub resolver, and glibc's order of nameservers, against real DNS servers on
port 53 of loopback addresses (resolv.conf has no port syntax): systemd-resolved's 127.0.0.53 dead or alive
beside a working upstream, a dnsmasq-style cache on a loopback address of its own, and a first nameserver
answering SERVFAIL."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.netservers import DnsTestServer, Netns, SilentUdpPort, ZoneResolver, servers
from support.system import require, require_root, require_tool

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.dns import DnsProbe
from probes.runtime.host import Host

ZONE = {"mirror.test": "127.0.0.1"}
STUB = "127.0.0.53"
UPSTREAM = "127.83.14.41"
CACHE = "127.83.14.42"  # a dnsmasq-style local cache: any loopback address
SERVFAIL_NS, ANSWERING_NS = "127.83.14.43", "127.83.14.44"

pytestmark = pytest.mark.system


def port53(address: str, resolver: ZoneResolver) -> DnsTestServer:
    require_root()
    try:
        return DnsTestServer(resolver, address=address, port=53)
    except OSError as exc:
        require(exc.errno != errno.EADDRINUSE, f"port 53 on {address} free")
        raise


def silent53(address: str) -> SilentUdpPort:
    require_root()
    try:
        return SilentUdpPort(address, 53)
    except OSError as exc:
        require(exc.errno != errno.EADDRINUSE, f"port 53 on {address} free")
        raise


@pytest.fixture
def upstream() -> Iterator[DnsTestServer]:
    with servers() as started:
        server = port53(UPSTREAM, ZoneResolver(ZONE))
        started.append(server)
        yield server


def resolved_root(tmp_path: Path) -> Path:
    """A host whose resolv.conf names systemd-resolved's stub, its upstream list naming UPSTREAM."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text(f"nameserver {STUB}\noptions edns0 trust-ad timeout:1 attempts:1\n")
    upstream = tmp_path / "run" / "systemd" / "resolve" / "resolv.conf"
    upstream.parent.mkdir(parents=True)
    upstream.write_text(f"nameserver {UPSTREAM}\noptions timeout:1 attempts:1\n")
    return tmp_path


def run_dns(root: Path, names: list[str]) -> dict[str, Finding]:
    """The probe on a host whose root is `root` and whose init's network namespace is this test's own (the
    fake /proc/1 is this process's), where the servers listen."""
    proc = root / "proc"
    if not proc.exists():
        proc.mkdir()
        (proc / "1").symlink_to("/proc/self")
    config = parse_config({"network": {"dns": {"names": names}}})
    out = DnsProbe().run(ProbeContext(Host(root=root, proc=proc), config, 8.0))
    return {f.subject: f for f in out if isinstance(f, Finding)}


@pytest.mark.parametrize("dead", ["nothing listening", "a listener that never answers"])
def test_a_dead_systemd_resolved_stub_fails_beside_a_working_upstream(
    dead: str, upstream: DnsTestServer, tmp_path: Path
) -> None:
    with servers() as started:
        if dead != "nothing listening":
            started.append(silent53(STUB))
        found = run_dns(resolved_root(tmp_path), ["mirror.test"])
    name = found["mirror.test"]
    assert name.status is Status.OK and name.observed["answered_by"] == UPSTREAM  # the upstreams work
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.reason, stub.observed["error"]) == (Status.FAIL, "DnsStubFailed", "timeout"), stub
    assert stub.observed["service"] == "systemd-resolved"
    assert f"local stub resolver {STUB} (systemd-resolved)" in stub.message and "does not answer" in stub.message
    assert "every lookup on the node" in stub.message
    assert "systemctl restart systemd-resolved" in stub.hint


def test_a_live_stub_is_ok(upstream: DnsTestServer, tmp_path: Path) -> None:
    with servers() as started:
        started.append(port53(STUB, ZoneResolver({"mirror.test": "127.0.0.7"})))
        found = run_dns(resolved_root(tmp_path), ["mirror.test", "gone.test"])
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.observed["asked"]) == (Status.OK, "mirror.test")
    assert "127.0.0.7" in stub.message
    assert found["mirror.test"].observed["addresses"] == ["127.0.0.1"]  # names themselves: from the upstreams


def test_a_dead_local_cache_fails_names_and_the_stub_with_the_service(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text(f"nameserver {CACHE}\noptions timeout:1 attempts:1\n")
    found = run_dns(tmp_path, ["mirror.test"])
    stub = found[f"stub:{CACHE}"]
    assert (stub.status, stub.reason) == (Status.FAIL, "DnsStubFailed")
    assert "dnsmasq" in stub.observed["service"] and "dnsmasq" in stub.hint and CACHE in stub.hint
    name = found["mirror.test"]
    assert (name.status, name.reason) == (Status.FAIL, "DnsFailed")
    assert f"local DNS cache (dnsmasq, unbound, nscd-style or NodeLocal DNSCache) at {CACHE}" in name.hint
    # The same cache answering: both are ok.
    with servers() as started:
        started.append(port53(CACHE, ZoneResolver(ZONE)))
        found = run_dns(tmp_path, ["mirror.test"])
    assert found["mirror.test"].status is Status.OK and found[f"stub:{CACHE}"].status is Status.OK


def test_servfail_from_the_first_nameserver_moves_on_to_the_next_as_glibc_does(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text(
        f"nameserver {SERVFAIL_NS}\nnameserver {ANSWERING_NS}\noptions timeout:1\n"
    )
    with servers() as started:
        started.append(port53(SERVFAIL_NS, ZoneResolver(ZONE, servfail=("mirror.test", "both.test"))))
        started.append(port53(ANSWERING_NS, ZoneResolver(ZONE, servfail=("both.test",))))
        found = run_dns(tmp_path, ["mirror.test", "both.test"])
    answered = found["mirror.test"]
    assert (answered.status, answered.observed["addresses"]) == (Status.OK, ["127.0.0.1"]), answered
    assert answered.observed["answered_by"] == ANSWERING_NS
    both = found["both.test"]  # only when every nameserver fails is it DnsFailed
    assert (both.status, both.reason, both.observed["error"]) == (Status.FAIL, "DnsFailed", "servfail")
    assert (
        f"{SERVFAIL_NS} SERVFAIL" in both.observed["detail"] and f"{ANSWERING_NS} SERVFAIL" in both.observed["detail"]
    )


def test_the_stub_is_asked_in_the_hosts_network_namespace_not_the_agents(tmp_path: Path) -> None:
    """The agent runs in its pod's network namespace; 127.0.0.53 listens in the host's. Here the host's is a
    namespace of the test's own where nothing listens, the agent's (this process's) has a live stub: the stub
    must be found dead, so it was asked where the host's lookups go (a forked child entered the namespace)."""
    require_tool("ip")
    ns = Netns()
    try:
        (tmp_path / "proc" / "1" / "ns").mkdir(parents=True)
        (tmp_path / "proc" / "1" / "ns" / "net").symlink_to(ns.path)
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "resolv.conf").write_text(f"nameserver {STUB}\noptions timeout:1 attempts:1\n")
        with servers() as started:
            started.append(port53(STUB, ZoneResolver(ZONE)))  # alive, but in the wrong namespace
            found = run_dns(tmp_path, ["mirror.test"])
    finally:
        ns.close()
    stub = found[f"stub:{STUB}"]
    assert (stub.status, stub.reason) == (Status.FAIL, "DnsStubFailed"), stub
    assert found["mirror.test"].reason == "DnsFailed"  # resolv.conf names only the stub: every lookup fails
    assert "systemd-resolved at 127.0.0.53" in found["mirror.test"].hint
