"""time.sync with time.ntp_servers empty (the default): the servers come from the host's own time daemon
config under host.root (chrony with its include/confdir/sourcedir files, ntpd or ntpsec, systemd-timesyncd
with drop-ins), and the clock is measured against them with real SNTP servers on loopback."""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.netservers import SntpTestServer, servers
from support.system import require, require_root

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.runtime.host import Host
from probes.time.ntp_sources import ntp_sources, parse_chrony_conf, parse_ntp_conf, parse_timesyncd_conf
from probes.time.time import TimeProbe

# Port 123 of a private loopback address: ntp.conf and timesyncd.conf have no port syntax.
NTP_ADDRESS = "127.83.14.123"


def write(root: Path, host_path: str, text: str) -> Path:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def sources(root: Path, configured: list[str] | None = None) -> list[tuple[str, str, int, str, str]]:
    found = ntp_sources(configured or [], Host(root=root).paths)
    return [(s.entry, s.host, s.port, s.source, s.directive) for s in found.servers]


# --- parsers -------------------------------------------------------------------------------------------


def test_parse_chrony_conf() -> None:
    text = (
        "# Debian's default\n"
        "pool 2.debian.pool.ntp.org iburst maxsources 4\n"
        "! server commented.example iburst\n"
        "; also a comment\n"
        "Server ntp1.example port 11123 iburst\n"
        "peer 10.0.0.2 key 1\n"
        "refclock PHC /dev/ptp0 poll 2\n"
        "sourcedir /run/chrony-dhcp /etc/chrony/sources.d\n"
        "confdir /etc/chrony/conf.d\n"
        "include /etc/chrony/extra/*.conf\n"
        "server\n"
    )
    found, includes = parse_chrony_conf(text, "/etc/chrony/chrony.conf")
    assert [(s.entry, s.port, s.directive) for s in found] == [
        ("2.debian.pool.ntp.org", 123, "pool"),
        ("ntp1.example:11123", 11123, "server"),
        ("10.0.0.2", 123, "peer"),
    ]
    assert includes == [
        ("sourcedir", ["/run/chrony-dhcp", "/etc/chrony/sources.d"]),
        ("confdir", ["/etc/chrony/conf.d"]),
        ("include", ["/etc/chrony/extra/*.conf"]),
    ]


def test_parse_ntp_conf() -> None:
    text = (
        "driftfile /var/lib/ntp/ntp.drift\n"
        "server 127.127.1.0  # the local clock driver, not a server\n"
        "server -4 ntp1.example iburst\n"
        "pool 0.pool.ntp.org iburst\n"
        "peer 10.0.0.3\n"
        "restrict default kod nomodify\n"
        "#server old.example\n"
    )
    found = parse_ntp_conf(text, "/etc/ntp.conf")
    assert [(s.entry, s.directive, s.source) for s in found] == [
        ("ntp1.example", "server", "/etc/ntp.conf"),
        ("0.pool.ntp.org", "pool", "/etc/ntp.conf"),
        ("10.0.0.3", "peer", "/etc/ntp.conf"),
    ]


def test_parse_timesyncd_conf_assignments_add_and_empty_resets() -> None:
    current: dict[str, list[str]] = {}
    parse_timesyncd_conf("[Time]\n#NTP=\nNTP=a.example b.example\nFallbackNTP=f.example\n", current)
    parse_timesyncd_conf("[Time]\nNTP=c.example\n[Other]\nNTP=not-time.example\n", current)
    assert current == {"NTP": ["a.example", "b.example", "c.example"], "FallbackNTP": ["f.example"]}
    parse_timesyncd_conf("[Time]\nNTP=\nNTP=d.example\n", current)
    assert current["NTP"] == ["d.example"]


# --- discovery under host.root -------------------------------------------------------------------------


def test_configured_servers_win_and_host_files_are_not_read(tmp_path: Path) -> None:
    write(tmp_path, "/etc/chrony/chrony.conf", "server from-chrony.example\n")
    assert sources(tmp_path, ["10.0.0.1", "ntp.example:1123"]) == [
        ("10.0.0.1", "10.0.0.1", 123, "time.ntp_servers", ""),
        ("ntp.example:1123", "ntp.example", 1123, "time.ntp_servers", ""),
    ]


def test_chrony_with_confdir_sourcedir_and_include(tmp_path: Path) -> None:
    write(
        tmp_path,
        "/etc/chrony/chrony.conf",
        "sourcedir /run/chrony-dhcp\nsourcedir /etc/chrony/sources.d\nconfdir /etc/chrony/conf.d\n"
        "include /etc/chrony/extra/*.conf\n",
    )
    write(tmp_path, "/etc/chrony/sources.d/b.sources", "server 10.1.0.2 iburst\n")
    write(tmp_path, "/etc/chrony/sources.d/a.sources", "pool pool.example iburst\n")
    write(tmp_path, "/etc/chrony/sources.d/ignored.conf", "server not-a-sources-file.example\n")
    write(tmp_path, "/etc/chrony/conf.d/10-site.conf", "server 10.1.0.3 port 1123\n")
    write(tmp_path, "/etc/chrony/extra/x.conf", "peer 10.1.0.4\n")
    found = ntp_sources([], Host(root=tmp_path).paths)
    assert found.origin == "chrony"
    assert [(s.entry, s.source) for s in found.servers] == [
        ("pool.example", "/etc/chrony/sources.d/a.sources"),
        ("10.1.0.2", "/etc/chrony/sources.d/b.sources"),
        ("10.1.0.3:1123", "/etc/chrony/conf.d/10-site.conf"),
        ("10.1.0.4", "/etc/chrony/extra/x.conf"),
    ]
    assert found.files[0] == "/etc/chrony/chrony.conf" and "/etc/chrony/extra/x.conf" in found.files


def test_chrony_rhel_path_and_include_loops_end(tmp_path: Path) -> None:
    write(tmp_path, "/etc/chrony.conf", "server 10.2.0.1 iburst\ninclude /etc/chrony.conf\n")
    found = ntp_sources([], Host(root=tmp_path).paths)
    assert [s.entry for s in found.servers] == ["10.2.0.1"]
    assert found.files == ["/etc/chrony.conf"]  # including itself does not loop


def test_ntpd_and_ntpsec(tmp_path: Path) -> None:
    write(tmp_path, "/etc/ntpsec/ntp.conf", "pool 0.debian.pool.ntp.org iburst\n")
    assert sources(tmp_path) == [
        ("0.debian.pool.ntp.org", "0.debian.pool.ntp.org", 123, "/etc/ntpsec/ntp.conf", "pool")
    ]
    write(tmp_path, "/etc/ntp.conf", "server 10.3.0.1 iburst\n")
    assert sources(tmp_path)[0] == ("10.3.0.1", "10.3.0.1", 123, "/etc/ntp.conf", "server")


def test_timesyncd_with_dropins_and_fallback(tmp_path: Path) -> None:
    # Debian's shipped file: everything commented, nothing to measure against.
    write(tmp_path, "/etc/systemd/timesyncd.conf", "[Time]\n#NTP=\n#FallbackNTP=0.debian.pool.ntp.org\n")
    assert ntp_sources([], Host(root=tmp_path).paths).servers == []
    write(tmp_path, "/etc/systemd/timesyncd.conf", "[Time]\nFallbackNTP=fallback.example\n")
    assert sources(tmp_path) == [
        ("fallback.example", "fallback.example", 123, "/etc/systemd/timesyncd.conf", "FallbackNTP")
    ]
    write(tmp_path, "/usr/lib/systemd/timesyncd.conf.d/50-vendor.conf", "[Time]\nNTP=vendor.example\n")
    write(tmp_path, "/etc/systemd/timesyncd.conf.d/60-site.conf", "[Time]\nNTP=\nNTP=10.4.0.1 10.4.0.2\n")
    assert sources(tmp_path) == [
        ("10.4.0.1", "10.4.0.1", 123, "/etc/systemd/timesyncd.conf.d/60-site.conf", "NTP"),
        ("10.4.0.2", "10.4.0.2", 123, "/etc/systemd/timesyncd.conf.d/60-site.conf", "NTP"),
    ]


def test_first_daemon_with_servers_wins(tmp_path: Path) -> None:
    write(tmp_path, "/etc/systemd/timesyncd.conf", "[Time]\nNTP=timesyncd.example\n")
    write(tmp_path, "/etc/ntp.conf", "server ntpd.example\n")
    write(tmp_path, "/etc/chrony/chrony.conf", "# chrony installed, no source configured\n")
    found = ntp_sources([], Host(root=tmp_path).paths)
    assert (found.origin, [s.entry for s in found.servers]) == ("ntpd", ["ntpd.example"])


def test_many_pool_lines_are_capped(tmp_path: Path) -> None:
    write(tmp_path, "/etc/chrony/chrony.conf", "".join(f"server 10.5.0.{i}\n" for i in range(1, 20)))
    assert len(ntp_sources([], Host(root=tmp_path).paths).servers) == 8


# --- measured against the host's servers -------------------------------------------------------------


@pytest.fixture
def port123_server() -> Iterator[SntpTestServer]:
    """A real SNTP server 0.3 s ahead, on port 123 of a private loopback address."""
    require_root()
    try:
        server = SntpTestServer(skew=0.3, host=NTP_ADDRESS, port=123)
    except OSError as exc:
        require(exc.errno != errno.EADDRINUSE, f"UDP port 123 on {NTP_ADDRESS} free")
        raise
    with servers() as started:
        started.append(server)
        yield server


def run_time(root: Path) -> dict[str, Finding]:
    config = parse_config({"time": {"chronyc_command": []}})  # time.ntp_servers empty: the default
    out = TimeProbe().run(ProbeContext(Host(root=root), config, 6.0))
    return {f.subject: f for f in out if isinstance(f, Finding)}


@pytest.mark.system
@pytest.mark.parametrize(
    ("host_path", "text", "origin", "directive"),
    [
        ("/etc/chrony/chrony.conf", f"server {NTP_ADDRESS} iburst\n", "chrony", "server"),
        ("/etc/chrony.conf", f"pool {NTP_ADDRESS} iburst maxsources 2\n", "chrony", "pool"),
        ("/etc/ntp.conf", f"server 127.127.1.0\nserver -4 {NTP_ADDRESS} iburst\n", "ntpd", "server"),
        ("/etc/systemd/timesyncd.conf", f"[Time]\nNTP={NTP_ADDRESS}\n", "systemd-timesyncd", "NTP"),
    ],
)
def test_host_daemon_servers_are_measured(
    port123_server: SntpTestServer, tmp_path: Path, host_path: str, text: str, origin: str, directive: str
) -> None:
    write(tmp_path, host_path, text)
    findings = run_time(tmp_path)
    finding = findings[NTP_ADDRESS]
    assert (finding.status, finding.reason) == (Status.WARN, "ClockSkew")
    # The offset is measured over loopback on a loaded machine: the message shows it, within a few ms of 0.3 s.
    assert re.search(rf"0\.(?:29\d|3[0-4]\d) s behind {re.escape(NTP_ADDRESS)}", finding.message), finding.message
    assert finding.observed["source"] == host_path and finding.observed["directive"] == directive
    assert finding.observed["offset_seconds"] == pytest.approx(0.3, abs=0.05)
    assert port123_server.queries >= 1
    kernel = findings["kernel"]
    assert kernel.observed["ntp_servers_from"] == origin and host_path in kernel.observed["ntp_config_files"]


@pytest.mark.system
def test_chrony_server_with_a_port_option(tmp_path: Path) -> None:
    with servers() as started:
        server = SntpTestServer(skew=-0.02)
        started.append(server)
        write(tmp_path, "/etc/chrony/chrony.conf", "confdir /etc/chrony/conf.d\n")
        write(tmp_path, "/etc/chrony/conf.d/site.conf", f"server 127.0.0.1 port {server.port} iburst\n")
        findings = run_time(tmp_path)
    finding = findings[server.address]
    assert (finding.status, finding.reason) == (Status.OK, "OK")
    assert finding.observed["source"] == "/etc/chrony/conf.d/site.conf"
    assert finding.observed["offset_seconds"] == pytest.approx(-0.02, abs=0.05)
