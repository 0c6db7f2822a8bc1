"""network.dns against real DNS servers (dnslib) on loopback addresses started by the tests."""

from __future__ import annotations

import errno
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.netservers import DnsTestServer, SilentUdpPort, ZoneResolver, servers
from support.system import require, require_root

from agent.config import ConfigError, parse_config
from agent.scheduler import execute
from probes.base import Finding, ProbeContext, Sample, Status
from probes.network.dns import DnsProbe
from probes.runtime.dnsquery import ResolvOptions, TrySchedule, parse_resolv_options
from probes.runtime.host import Host
from probes.runtime.resolver import parse_hosts_file

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
    # The loopback addresses these tests' resolv.conf files name stand for remote nameservers: the findings
    # about them as the node's local stubs (test_network_dns_stub.py) are left out here.
    findings = [f for f in out if isinstance(f, Finding) and not f.subject.startswith("stub:")]
    samples = [s for s in out if isinstance(s, Sample) and not s.labels["name"].startswith("stub:")]
    return findings, samples, elapsed


def by_subject(findings: list[Finding]) -> dict[str, Finding]:
    return {f.subject: f for f in findings}


@pytest.mark.system
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


@pytest.mark.system
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


@pytest.mark.system
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


@pytest.mark.system
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


def serve_port53(address: str, resolver: ZoneResolver) -> DnsTestServer:
    """A DNS server on port 53 of a private loopback address: resolv.conf has no port syntax."""
    require_root()
    try:
        return DnsTestServer(resolver, address=address, port=53)
    except OSError as exc:
        require(exc.errno != errno.EADDRINUSE, f"port 53 on {address} free")
        raise


@pytest.fixture
def port53_server() -> Iterator[DnsTestServer]:
    server = serve_port53("127.83.14.7", ZoneResolver(ZONE))
    try:
        yield server
    finally:
        server.close()


@pytest.mark.system
def test_host_resolv_conf_under_host_root(tmp_path: Path, port53_server: DnsTestServer) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text(f"# node\nnameserver {port53_server.host}\noptions timeout:1\n")
    findings, _, _ = run_dns({"names": ["mirror.test"]}, root=tmp_path)
    (finding,) = findings
    assert finding.status is Status.OK
    assert finding.observed["source"] == str(tmp_path / "etc" / "resolv.conf")
    assert finding.observed["nameservers"] == [port53_server.host]
    assert finding.observed["resolver"] == "host"


@pytest.mark.system
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


SILENT_NS, ANSWERING_NS = "127.83.14.21", "127.83.14.22"


@pytest.mark.system
def test_a_silent_first_nameserver_costs_what_resolv_conf_says_and_is_named(tmp_path: Path) -> None:
    """The field variant: resolv.conf lists a nameserver that stays silent first, with `options timeout:1`.
    glibc waits 1 s for it and the next one answers: the lookup takes 1.0 s, and the finding names the silent
    one (not the agent's own 2 s per try)."""
    require_root()
    with servers() as started:
        silent = SilentUdpPort(SILENT_NS, 53)
        started.append(silent)
        started.append(serve_port53(ANSWERING_NS, ZoneResolver(ZONE)))
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "resolv.conf").write_text(
            f"nameserver {SILENT_NS}\nnameserver {ANSWERING_NS}\noptions timeout:1\n"
        )
        findings, _, _ = run_dns({"names": ["mirror.test"], "slow_seconds": 0.5}, root=tmp_path)
    (slow,) = findings
    assert (slow.status, slow.reason) == (Status.WARN, "DnsSlow")
    assert slow.observed["seconds"] >= 0.95, slow.observed
    assert slow.observed["addresses"] == ["127.0.0.1"]
    assert (slow.observed["silent_nameservers"], slow.observed["answered_by"]) == ([SILENT_NS], ANSWERING_NS)
    said = re.search(
        rf"{re.escape(SILENT_NS)} \((\d+\.\d) s\) did not answer \(resolv.conf options timeout:1\), "
        rf"{re.escape(ANSWERING_NS)} answered",
        slow.message,
    )
    # Measured, so a loaded machine may add to it; the try's own wait (1 s, not the agent's 2 s) bounds it below.
    assert said is not None and float(said.group(1)) >= 0.95, slow.message
    assert f"nameserver {SILENT_NS} does not answer" in slow.hint and "resolv.conf" in slow.hint
    assert ANSWERING_NS not in slow.hint


@pytest.mark.system
def test_resolv_conf_attempts_bound_a_silent_nameserver_as_glibc_does(tmp_path: Path) -> None:
    require_root()
    with servers() as started:
        started.append(SilentUdpPort(SILENT_NS, 53))
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "resolv.conf").write_text(f"nameserver {SILENT_NS}\noptions timeout:1 attempts:2\n")
        findings, _, _ = run_dns({"names": ["mirror.test"], "lifetime_seconds": 7.0}, timeout=10.0, root=tmp_path)
    (failed,) = findings
    assert (failed.status, failed.reason, failed.observed["error"]) == (Status.FAIL, "DnsFailed", "timeout")
    # Two tries of 1 s, then glibc gives up: well before the 7 s lifetime, however loaded the machine (a
    # lifetime-bound lookup would have run 7 s). The waits are measured, so only their lower bound is exact.
    assert 1.9 <= failed.observed["seconds"] < 6.0
    waited = re.search(rf"no answer from {re.escape(SILENT_NS)} \((\d+\.\d) s\)", failed.message)
    assert waited is not None and float(waited.group(1)) >= 1.9, failed.message
    assert "(the tries resolv.conf's options allow)" in failed.message and "attempts" not in failed.hint


def test_resolv_conf_options_and_glibcs_wait_per_nameserver() -> None:
    assert parse_resolv_options("options timeout:1\noptions attempts:3 rotate\n") == ResolvOptions(1, 3)
    assert parse_resolv_options("options timeout:99 attempts:9\n# options timeout:2\n") == ResolvOptions(30, 5)
    assert parse_resolv_options("nameserver 10.0.0.1\n") == ResolvOptions(None, None)
    glibc = TrySchedule.from_options(ResolvOptions(5, None), 2.0)
    assert [glibc.wait(i, 3) for i in range(3)] == [5, 3, 6]  # res_send: (5 << i) / 3 after the first
    assert glibc.attempts == 2
    unset = TrySchedule.from_options(ResolvOptions(), 2.0)
    assert unset.source == "network.dns.timeout_seconds 2" and unset.wait(1, 2) == 2.0


# --- cluster names: the pod's resolver only ---------------------------------------------------------

CLUSTER_SEARCH = "search node-health.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"


@dataclass
class ClusterLab:
    """A node whose datacenter resolver answers NXDOMAIN for cluster.local, and a cluster DNS that serves
    kubernetes.default.svc.cluster.local, each on port 53 of its own loopback address."""

    host_root: Path  # host.root: etc/resolv.conf names the datacenter resolver
    pod_resolv_conf: Path  # the pod's own resolv.conf (ClusterFirstWithHostNet): the cluster DNS
    datacenter: ZoneResolver
    cluster: ZoneResolver


@pytest.fixture
def cluster_lab(tmp_path: Path) -> Iterator[ClusterLab]:
    datacenter = ZoneResolver({"mirror.test": "127.0.0.1"})  # every other name, cluster.local included: NXDOMAIN
    cluster = ZoneResolver({"kubernetes.default.svc.cluster.local": "10.96.0.1"})
    with servers() as started:
        started.append(serve_port53("127.83.14.8", datacenter))
        started.append(serve_port53("127.83.14.9", cluster))
        (tmp_path / "host" / "etc").mkdir(parents=True)
        (tmp_path / "host" / "etc" / "resolv.conf").write_text("search dc.example\nnameserver 127.83.14.8\n")
        pod_resolv_conf = tmp_path / "pod-resolv.conf"
        pod_resolv_conf.write_text(f"{CLUSTER_SEARCH}nameserver 127.83.14.9\n")
        yield ClusterLab(tmp_path / "host", pod_resolv_conf, datacenter, cluster)


def test_cluster_names_default_is_relative() -> None:
    # No cluster domain is assumed: the pod's search list completes the name.
    assert parse_config({}).network.dns.cluster_names == ["kubernetes.default.svc"]


@pytest.mark.system
def test_defaults_in_a_pod_are_healthy_where_the_node_resolver_lacks_cluster_local(
    cluster_lab: ClusterLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    settings = {"cluster_resolv_conf": str(cluster_lab.pod_resolv_conf)}  # every other key at its default
    findings, _, _ = run_dns(settings, root=cluster_lab.host_root)
    (finding,) = findings
    assert (finding.subject, finding.status, finding.reason) == ("kubernetes.default.svc", Status.OK, "OK")
    assert finding.observed["resolver"] == "pod"
    assert finding.observed["source"] == str(cluster_lab.pod_resolv_conf)
    assert finding.observed["resolved_as"] == "kubernetes.default.svc.cluster.local"
    assert finding.observed["addresses"] == ["10.96.0.1"]
    assert "kubernetes.default.svc" in finding.message and "10.96.0.1" in finding.message
    # The search list was walked (ndots:5) and the datacenter resolver was never asked.
    assert "kubernetes.default.svc.svc.cluster.local" in cluster_lab.cluster.queries
    assert cluster_lab.datacenter.queries == []


@pytest.mark.system
def test_defaults_outside_a_pod_do_not_apply(cluster_lab: ClusterLab, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = parse_config({"network": {"dns": {"cluster_resolv_conf": str(cluster_lab.pod_resolv_conf)}}})
    result, findings, _ = execute(DnsProbe(), Host(root=cluster_lab.host_root), config, 5.0)
    assert result == "skip"
    assert [(f.status, f.reason) for f in findings] == [(Status.SKIP, "NotApplicable")]
    assert "cluster_names are resolved only in a pod" in findings[0].message
    assert cluster_lab.datacenter.queries == [] and cluster_lab.cluster.queries == []


@pytest.mark.system
def test_listed_names_use_the_host_resolver_and_cluster_names_the_pods(
    cluster_lab: ClusterLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    settings = {"names": ["mirror.test"], "cluster_resolv_conf": str(cluster_lab.pod_resolv_conf)}
    found = by_subject(run_dns(settings, root=cluster_lab.host_root)[0])
    assert found["mirror.test"].status is Status.OK and found["mirror.test"].observed["resolver"] == "host"
    assert found["kubernetes.default.svc"].status is Status.OK
    assert cluster_lab.datacenter.queries == ["mirror.test"]
    assert "mirror.test" not in cluster_lab.cluster.queries


@pytest.mark.system
def test_explicit_nameservers_never_answer_for_cluster_names(
    cluster_lab: ClusterLab, dns_server: DnsTestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    settings = {
        "names": ["mirror.test"],
        "nameservers": [dns_server.address],
        "cluster_resolv_conf": str(cluster_lab.pod_resolv_conf),
    }
    found = by_subject(run_dns(settings, root=cluster_lab.host_root)[0])
    assert found["mirror.test"].observed["source"] == "network.dns.nameservers"
    assert found["kubernetes.default.svc"].observed["source"] == str(cluster_lab.pod_resolv_conf)
    assert found["kubernetes.default.svc"].status is Status.OK


@pytest.mark.system
def test_pod_on_the_node_resolver_fails_with_the_dns_policy_hint(
    cluster_lab: ClusterLab, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A hostNetwork pod under dnsPolicy ClusterFirst gets the node's resolv.conf: the cluster name fails,
    and the finding says which resolver and what to change."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    node_like = tmp_path / "clusterfirst-resolv.conf"
    node_like.write_text(f"{CLUSTER_SEARCH}nameserver 127.83.14.8\n")
    findings, _, _ = run_dns({"cluster_resolv_conf": str(node_like)}, root=cluster_lab.host_root)
    (finding,) = findings
    assert (finding.status, finding.reason, finding.observed["error"]) == (Status.FAIL, "DnsFailed", "nxdomain")
    assert "kubernetes.default.svc: NXDOMAIN from 127.83.14.8" in finding.message
    assert "the pod's resolver" in finding.message and str(node_like) in finding.message
    assert "ClusterFirstWithHostNet" in finding.hint


def test_missing_pod_resolv_conf_is_no_nameserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    missing = tmp_path / "no-resolv.conf"
    findings, _, _ = run_dns({"cluster_resolv_conf": str(missing)}, root=tmp_path)
    (finding,) = findings
    assert (finding.status, finding.reason, finding.observed["error"]) == (Status.FAIL, "DnsFailed", "no_nameserver")
    assert str(missing) in finding.message


def test_not_applicable_without_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ctx = ProbeContext(Host(), parse_config({}), 5)
    assert DnsProbe().applicable(ctx) == (
        "no names configured in network.dns.names (cluster_names are resolved only in a pod)"
    )
    ctx = ProbeContext(Host(), parse_config({"network": {"dns": {"names": ["x.test"]}}}), 5)
    assert DnsProbe().applicable(ctx) is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert DnsProbe().applicable(ProbeContext(Host(), parse_config({}), 5)) is None
    no_cluster = parse_config({"network": {"dns": {"cluster_names": []}}})
    assert DnsProbe().applicable(ProbeContext(Host(), no_cluster, 5)) is not None


# --- deadlines ----------------------------------------------------------------------------------------


@pytest.mark.system
def test_many_silent_names_each_get_a_timeout_inside_the_probe_deadline() -> None:
    """More names than the old worker pool had threads, each with a 5 s lifetime, under a 1.5 s probe
    deadline: every name gets its own DnsFailed timeout (not DeadlineExceeded, not a ProbeTimeout)."""
    names = [f"n{i}.test" for i in range(20)]
    with servers() as started:
        silent = SilentUdpPort()
        started.append(silent)
        config = parse_config({"network": {"dns": {"names": names, "nameservers": [silent.address]}}})
        started_at = time.monotonic()
        result, findings, _ = execute(DnsProbe(), Host(), config, 1.5)
        elapsed = time.monotonic() - started_at
    assert result == "ok"
    assert elapsed < 1.5  # inside the deadline: the scheduler keeps the result
    found = by_subject(findings)
    assert set(found) == set(names)
    for name in names:
        assert (found[name].status, found[name].reason, found[name].observed["error"]) == (
            Status.FAIL,
            "DnsFailed",
            "timeout",
        ), found[name]
        assert silent.address in found[name].message


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


def test_no_time_left_is_deadline_exceeded(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "resolv.conf").write_text("nameserver 192.0.2.53\n")
    findings, samples, elapsed = run_dns({"names": ["mirror.test", "github.test"]}, timeout=0.5, root=tmp_path)
    assert [(f.subject, f.status, f.reason) for f in findings] == [
        ("mirror.test", Status.UNKNOWN, "DeadlineExceeded"),
        ("github.test", Status.UNKNOWN, "DeadlineExceeded"),
    ]
    assert "no time left" in findings[0].message and findings[0].hint
    assert samples == [] and elapsed < 0.5
