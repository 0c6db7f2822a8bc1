"""network.dns against real DNS servers (dnslib) on loopback addresses started by the tests."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.netservers import DnsTestServer, SilentUdpPort, ZoneResolver, servers
from support.system import require, require_root

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, Sample, Status
from probes.network.legacy import DnsProbe, parse_hosts_file
from probes.runtime.host import Host

ZONE = {"mirror.test": "127.0.0.1", "github.test": "127.0.0.9"}


@pytest.fixture
def dns_server() -> Iterator[DnsTestServer]:
    with servers() as started:
        server = DnsTestServer(ZoneResolver(ZONE, nxdomain=("gone.test",), servfail=("broken.test",)))
        started.append(server)
        yield server


def run_dns(dns: dict, timeout: float = 8.0, root: Path | None = None) -> tuple[list[Finding], list[Sample], float]:
    config = parse_config({"network": {"dns": dns}})
    host = Host(root=root) if root is not None else Host()
    started = time.monotonic()
    out = DnsProbe().run(ProbeContext(host, config, timeout))
    elapsed = time.monotonic() - started
    return [f for f in out if isinstance(f, Finding)], [s for s in out if isinstance(s, Sample)], elapsed


def by_subject(findings: list[Finding]) -> dict[str, Finding]:
    return {f.subject: f for f in findings}


def test_resolves_names_and_tells_nxdomain_servfail_apart(dns_server: DnsTestServer) -> None:
    findings, samples, _ = run_dns(
        {"names": ["mirror.test", "github.test", "gone.test", "broken.test"], "nameservers": [dns_server.address]}
    )
    found = by_subject(findings)
    assert found["mirror.test"].status is Status.OK
    assert found["mirror.test"].observed["addresses"] == ["127.0.0.1"]
    assert found["github.test"].observed["addresses"] == ["127.0.0.9"]
    nx, sf = found["gone.test"], found["broken.test"]
    assert (nx.status, nx.reason, nx.observed["error"]) == (Status.FAIL, "DnsFailed", "nxdomain")
    assert "NXDOMAIN" in nx.message and "SERVFAIL" not in nx.message
    assert (sf.status, sf.reason, sf.observed["error"]) == (Status.FAIL, "DnsFailed", "servfail")
    assert "SERVFAIL" in sf.message and dns_server.address in sf.message
    assert nx.hint and sf.hint and nx.hint != sf.hint
    latency = {s.labels["name"]: s.value for s in samples if s.name == "nodehealth_network_dns_lookup_seconds"}
    assert set(latency) == {"mirror.test", "github.test", "gone.test", "broken.test"}
    assert all(0 < v < 2 for v in latency.values())


def test_silent_nameserver_is_a_timeout_within_the_lifetime() -> None:
    with servers() as started:
        silent = SilentUdpPort()
        started.append(silent)
        findings, samples, elapsed = run_dns(
            {"names": ["mirror.test"], "nameservers": [silent.address], "timeout_seconds": 0.3, "lifetime_seconds": 1.0}
        )
    (finding,) = findings
    assert (finding.status, finding.reason, finding.observed["error"]) == (Status.FAIL, "DnsFailed", "timeout")
    assert "timeout" in finding.message and silent.address in finding.message
    assert "NXDOMAIN" not in finding.message and "SERVFAIL" not in finding.message
    # dnspython overshoots its lifetime by its backoff sleep; the probe keeps headroom for that.
    assert 0.9 <= elapsed < 1.6
    assert samples[0].value >= 0.9


def test_probe_deadline_bounds_the_lifetime() -> None:
    with servers() as started:
        silent = SilentUdpPort()
        started.append(silent)
        findings, _, elapsed = run_dns(
            {"names": ["a.test", "b.test", "c.test"], "nameservers": [silent.address], "lifetime_seconds": 5.0},
            timeout=1.5,
        )
    assert [f.observed["error"] for f in findings] == ["timeout"] * 3
    assert elapsed < 1.5  # three names in parallel, each cut to deadline - headroom


def test_slow_answer_is_dns_slow() -> None:
    with servers() as started:
        slow = DnsTestServer(ZoneResolver(ZONE, delay=0.4))
        started.append(slow)
        findings, _, _ = run_dns({"names": ["mirror.test"], "nameservers": [slow.address], "slow_seconds": 0.2})
    (finding,) = findings
    assert (finding.status, finding.reason) == (Status.WARN, "DnsSlow")
    assert finding.observed["seconds"] >= 0.4
    assert finding.observed["addresses"] == ["127.0.0.1"]


def test_no_nameserver_in_host_resolv_conf(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text("search example.internal\noptions ndots:5\n")
    findings, _, _ = run_dns({"names": ["mirror.test"]}, root=tmp_path)
    (finding,) = findings
    assert (finding.status, finding.observed["error"]) == (Status.FAIL, "no_nameserver")
    assert "no nameserver" in finding.message and "resolv.conf" in finding.message

    (tmp_path / "etc" / "resolv.conf").unlink()
    findings, _, _ = run_dns({"names": ["mirror.test"]}, root=tmp_path)
    assert findings[0].observed["error"] == "no_nameserver"


@pytest.fixture
def port53_server() -> Iterator[DnsTestServer]:
    """A DNS server on port 53 of a private loopback address: resolv.conf has no port syntax."""
    require_root()
    address = "127.83.14.7"
    try:
        server = DnsTestServer(ZoneResolver(ZONE), address=address, port=53)
    except OSError as exc:
        require(exc.errno != errno.EADDRINUSE, f"port 53 on {address} free")
        raise
    try:
        yield server
    finally:
        server.close()


def test_host_resolv_conf_under_host_root(tmp_path: Path, port53_server: DnsTestServer) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text(f"# node\nnameserver {port53_server.host}\noptions timeout:1\n")
    findings, _, _ = run_dns({"names": ["mirror.test"]}, root=tmp_path)
    (finding,) = findings
    assert finding.status is Status.OK
    assert finding.observed["source"] == str(tmp_path / "etc" / "resolv.conf")
    assert finding.observed["nameservers"] == [port53_server.host]


def test_systemd_resolved_stub_uses_the_upstream_list(tmp_path: Path, port53_server: DnsTestServer) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text("nameserver 127.0.0.53\noptions edns0 trust-ad\n")
    upstream = tmp_path / "run" / "systemd" / "resolve" / "resolv.conf"
    upstream.parent.mkdir(parents=True)
    upstream.write_text(f"nameserver {port53_server.host}\n")
    findings, _, _ = run_dns({"names": ["github.test"]}, root=tmp_path)
    (finding,) = findings
    assert finding.status is Status.OK and finding.observed["addresses"] == ["127.0.0.9"]
    assert finding.observed["source"] == str(upstream)


def test_cluster_names_only_inside_a_pod(dns_server: DnsTestServer, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {"names": ["mirror.test"], "nameservers": [dns_server.address], "cluster_names": ["gone.test"]}
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    findings, _, _ = run_dns(settings)
    assert [f.subject for f in findings] == ["mirror.test"]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    findings, _, _ = run_dns(settings)
    assert by_subject(findings)["gone.test"].observed["error"] == "nxdomain"


def test_not_applicable_without_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ctx = ProbeContext(Host(), parse_config({}), 5)
    assert DnsProbe().applicable(ctx) == "no names configured in network.dns.names"
    ctx = ProbeContext(Host(), parse_config({"network": {"dns": {"names": ["x.test"]}}}), 5)
    assert DnsProbe().applicable(ctx) is None


@pytest.mark.parametrize("entry", ["dns.google", "10.0.0.1:0", "10.0.0.1:x", "[::1"])
def test_nameserver_must_be_ip_and_port(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"network\.dns\.nameservers"):
        parse_config({"network": {"dns": {"nameservers": [entry]}}})


def test_nameserver_forms_accepted() -> None:
    config = parse_config({"network": {"dns": {"nameservers": ["10.0.0.10", "10.0.0.10:5353", "::1", "[::1]:53"]}}})
    assert len(config.network.dns.nameservers) == 4


def test_parse_hosts_file() -> None:
    text = (
        "127.0.0.1\tlocalhost\n::1 localhost ip6-localhost\n# comment\n10.1.2.3 mirror.internal Mirror  # pypi\n"
        "not-an-ip bogus\n\n"
    )
    hosts = parse_hosts_file(text)
    assert hosts["localhost"] == ["127.0.0.1", "::1"]
    assert hosts["mirror"] == ["10.1.2.3"] and hosts["mirror.internal"] == ["10.1.2.3"]
    assert "bogus" not in hosts
