"""NTP server names resolved the way the host's time daemon resolves them (NSS): the host's /etc/hosts, then DNS,
in nsswitch.conf's order, under a fake host root whose chrony.conf names a loopback SNTP server known only to
/etc/hosts (air-gapped clusters), while the node's DNS answers NXDOMAIN. A 3 s skew then fails the node; a name
resolved nowhere is unknown and, servers being configured, blocks /ready (time.required)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.cli import check_json
from support.netservers import DnsTestServer, SntpTestServer, ZoneResolver, servers

from agent.config import parse_config
from agent.scheduler import probe_context
from probes.base import Finding, Status
from probes.runtime.host import Host
from probes.runtime.resolver import parse_nsswitch_hosts
from probes.time.time import TimeProbe

NAME = "ntp.airgap.example"
# Loopback addresses of this test's own, so that a server here is never taken for another test's.
SKEWED_ADDRESS = "127.83.7.123"
GOOD_ADDRESS = "127.83.7.124"


@dataclass
class Lab:
    skewed: SntpTestServer  # 3 s ahead of the node: what the host's /etc/hosts names
    good: SntpTestServer  # what DNS would name, when DNS is asked first
    nxdomain: DnsTestServer  # the datacenter resolver: knows nothing of the air-gapped name
    dns_knows: DnsTestServer


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with servers() as started:
        skewed = SntpTestServer(skew=3.0, host=SKEWED_ADDRESS)
        good = SntpTestServer(host=GOOD_ADDRESS, port=skewed.port)
        lab = Lab(skewed, good, DnsTestServer(ZoneResolver({})), DnsTestServer(ZoneResolver({NAME: GOOD_ADDRESS})))
        started.extend(vars(lab).values())
        yield lab


def host_root(tmp_path: Path, lab: Lab, hosts: str, nsswitch: str | None = None) -> Path:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "chrony.conf").write_text(f"server {NAME} iburst port {lab.skewed.port}\n")
    (root / "etc" / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
    if nsswitch is not None:
        (root / "etc" / "nsswitch.conf").write_text(nsswitch)
    return root


def config(root: Path, dns: DnsTestServer, **time_settings: Any) -> dict[str, Any]:
    return {
        "host": {"root": str(root)},
        "time": {"chronyc_command": [], **time_settings},
        "network": {"dns": {"nameservers": [dns.address]}},
        "kubernetes": {"enabled": False},
    }


def run_time(data: dict[str, Any]) -> dict[str, Finding]:
    parsed = parse_config(data)
    output = TimeProbe().run(probe_context(Host(root=data["host"]["root"]), parsed, 6.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}


def check(data: dict[str, Any], directory: Path) -> dict[str, Any]:
    """`node-health check --only time.sync`, as an operator runs it."""
    return check_json(data, directory, "--only", "time.sync")


@pytest.mark.system
def test_a_server_named_only_in_the_hosts_file_is_measured_and_its_skew_fails(lab: Lab, tmp_path: Path) -> None:
    root = host_root(tmp_path, lab, f"{SKEWED_ADDRESS} {NAME}\n")
    data = config(root, lab.nxdomain)
    subject = f"{NAME}:{lab.skewed.port}"
    finding = run_time(data)[subject]
    assert (finding.status, finding.reason) == (Status.FAIL, "ClockSkew"), finding
    assert finding.observed["address"] == SKEWED_ADDRESS and finding.observed["resolved_from"] == "/etc/hosts"
    assert finding.observed["source"] == "/etc/chrony.conf"
    assert "s behind" in finding.message and abs(finding.observed["offset_seconds"] - 3.0) < 0.2
    assert "chronyc makestep" in finding.hint
    report = check(data, tmp_path)
    assert report["ready"] is False
    assert [(r["check"], r["reason"]) for r in report["reasons"]] == [("time.sync", "ClockSkew")]


@pytest.mark.system
def test_a_server_resolved_nowhere_is_unknown_and_blocks_ready_unless_not_required(lab: Lab, tmp_path: Path) -> None:
    root = host_root(tmp_path, lab, "")
    data = config(root, lab.nxdomain)
    subject = f"{NAME}:{lab.skewed.port}"
    finding = run_time(data)[subject]
    assert (finding.status, finding.reason) == (Status.UNKNOWN, "NtpNoAnswer"), finding
    assert f"cannot resolve {NAME}: not in /etc/hosts; DNS: NXDOMAIN" in finding.message
    assert "/etc/hosts" in finding.hint and "time.ntp_servers" in finding.hint
    assert finding.required is True
    report = check(data, tmp_path)
    assert report["ready"] is False
    assert [(r["subject"], r["reason"], r["status"]) for r in report["reasons"]] == [
        (subject, "NtpNoAnswer", "unknown")
    ]
    relaxed = config(root, lab.nxdomain, required=False)
    assert run_time(relaxed)[subject].required is False
    assert check(relaxed, tmp_path)["ready"] is True
    # Required again, but named in health.required_checks: the operator's own list still counts.
    listed = {**relaxed, "health": {"required_checks": ["time.sync"]}}
    assert check(listed, tmp_path)["ready"] is False


@pytest.mark.system
def test_one_server_resolved_nowhere_beside_one_that_answers_only_warns(lab: Lab, tmp_path: Path) -> None:
    root = host_root(tmp_path, lab, "")
    good = f"{GOOD_ADDRESS}:{lab.good.port}"
    data = config(root, lab.nxdomain, ntp_servers=[good, "gone.airgap.example"])
    findings = run_time(data)
    assert findings[good].status == Status.OK, findings[good]
    gone = findings["gone.airgap.example"]
    assert (gone.status, gone.reason, gone.required) == (Status.WARN, "NtpNoAnswer", False), gone
    assert "judged by the servers that answered" in gone.message
    assert check(data, tmp_path)["ready"] is True


@pytest.mark.system
def test_nsswitch_order_decides_between_the_hosts_file_and_dns(lab: Lab, tmp_path: Path) -> None:
    """`hosts: dns files` asks DNS first (here: the good server); `hosts: files` never asks DNS."""
    subject = f"{NAME}:{lab.skewed.port}"
    dns_first = host_root(tmp_path / "a", lab, f"{SKEWED_ADDRESS} {NAME}\n", "hosts: dns [!UNAVAIL=return] files\n")
    finding = run_time(config(dns_first, lab.dns_knows))[subject]
    assert finding.status == Status.OK and finding.observed["address"] == GOOD_ADDRESS, finding
    assert finding.observed["resolved_from"] == "dns"
    files_only = host_root(tmp_path / "b", lab, "", "hosts: files myhostname\n")
    unresolved = run_time(config(files_only, lab.dns_knows))[subject]
    assert unresolved.reason == "NtpNoAnswer" and unresolved.message.endswith(
        f"cannot resolve {NAME}: not in /etc/hosts"
    )


@pytest.mark.system
def test_a_node_without_any_ntp_server_stays_ready(lab: Lab, tmp_path: Path) -> None:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    data = config(root, lab.nxdomain)
    findings = run_time(data)
    assert set(findings) == {"kernel"}
    assert check(data, tmp_path)["ready"] is True


def test_nsswitch_hosts_line() -> None:
    assert parse_nsswitch_hosts("passwd: files\nhosts:          files dns\n") == ("files", "dns")
    assert parse_nsswitch_hosts("hosts: files mdns4_minimal [NOTFOUND=return] dns myhostname # x\n") == (
        "files",
        "dns",
    )
    assert parse_nsswitch_hosts("hosts: resolve [!UNAVAIL=return] files myhostname dns\n") == ("files", "dns")
    assert parse_nsswitch_hosts("hosts: dns files\n") == ("dns", "files")
    assert parse_nsswitch_hosts("hosts: myhostname\n") == ()
    assert parse_nsswitch_hosts("# hosts: dns\npasswd: files\n") is None
