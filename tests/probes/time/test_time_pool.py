"""An NTP pool judged by its answering members: SNTP servers on loopback addresses of the test's own, all on one
port, behind a pool name the fake host root's /etc/hosts resolves to them, the first member decommissioned (a
socket that never answers). The node's clock is 3 s off the members that answer: that fails, told with the
skew, and the dead member is a warning naming it, never an unknown that hides the skew."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.netservers import SilentUdpPort, SntpTestServer, servers

from agent.config import parse_config
from agent.scheduler import probe_context
from probes.base import Finding, Sample, Status
from probes.runtime.host import Host
from probes.time.ntp_sources import parse_chrony_conf
from probes.time.time import TimeProbe

POOL = "pool.ntp.example"
DEAD = "127.83.8.10"
MEMBERS = ("127.83.8.11", "127.83.8.12", "127.83.8.13")


@dataclass
class Lab:
    port: int
    members: list[SntpTestServer]


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with servers() as started:
        first = SntpTestServer(skew=3.0, host=MEMBERS[0])
        members = [first, *(SntpTestServer(skew=3.0, host=host, port=first.port) for host in MEMBERS[1:])]
        started.extend(members)
        started.append(SilentUdpPort(DEAD, first.port))  # decommissioned: takes the query, never answers
        yield Lab(first.port, members)


def host_root(tmp_path: Path, chrony_conf: str, hosts: list[str]) -> Path:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "chrony.conf").write_text(chrony_conf)
    (root / "etc" / "hosts").write_text("".join(f"{address} {POOL}\n" for address in hosts))
    return root


def run_time(root: Path, **time_settings: Any) -> tuple[dict[str, Finding], list[Sample]]:
    data = {
        "host": {"root": str(root)},
        "time": {"chronyc_command": [], **time_settings},
        "network": {"dns": {"nameservers": ["127.0.0.1:9"]}},  # never asked: the hosts file knows the name
    }
    output = TimeProbe().run(probe_context(Host(root=root), parse_config(data), 8.0))
    return {f.subject: f for f in output if isinstance(f, Finding)}, [s for s in output if isinstance(s, Sample)]


@pytest.mark.system
def test_a_pool_with_a_dead_first_member_fails_on_the_skew_of_the_others(lab: Lab, tmp_path: Path) -> None:
    root = host_root(tmp_path, f"pool {POOL} iburst port {lab.port} maxsources 4\n", [DEAD, *MEMBERS])
    found, samples = run_time(root)
    entry = f"{POOL}:{lab.port}"
    dead = found[f"{entry} ({DEAD})"]
    assert (dead.status, dead.reason) == (Status.WARN, "NtpNoAnswer"), dead
    assert DEAD in dead.message and "judged by the servers that answered" in dead.message
    assert DEAD in dead.hint and POOL in dead.hint and not dead.required
    for address in MEMBERS:
        member = found[f"{entry} ({address})"]
        assert (member.status, member.reason) == (Status.FAIL, "ClockSkew"), member
        assert abs(member.observed["offset_seconds"] - 3.0) < 0.3 and "s behind" in member.message
        assert (member.observed["name"], member.observed["members"], member.observed["max_sources"]) == (entry, 4, 4)
        assert member.observed["resolved_from"] == "/etc/hosts"
    assert not any(f.status is Status.UNKNOWN for f in found.values()), found
    offsets = {s.labels["server"] for s in samples if s.name == "nodehealth_time_offset_seconds"}
    assert offsets == {f"{entry} ({address})" for address in MEMBERS}


@pytest.mark.system
def test_maxsources_bounds_the_members_that_judge_and_a_server_name_counts_its_addresses(
    lab: Lab, tmp_path: Path
) -> None:
    root = host_root(tmp_path, f"pool {POOL} port {lab.port} maxsources 2\n", [DEAD, *MEMBERS])
    found, _ = run_time(root)
    entry = f"{POOL}:{lab.port}"
    judged = [f for f in found.values() if f.reason == "ClockSkew"]
    assert [f.subject for f in judged] == [f"{entry} ({address})" for address in MEMBERS[:2]]
    assert found[f"{entry} ({DEAD})"].status is Status.WARN
    # The same name as time.ntp_servers (a server with several addresses): up to 4 answering ones judge.
    found, _ = run_time(root, ntp_servers=[entry])
    assert sorted(f.subject for f in found.values() if f.reason == "ClockSkew") == [
        f"{entry} ({address})" for address in MEMBERS
    ]


@pytest.mark.system
def test_a_pool_whose_members_are_all_dead_is_unknown_and_required(lab: Lab, tmp_path: Path) -> None:
    with servers() as started:
        other_dead = SilentUdpPort("127.83.8.14", lab.port)
        started.append(other_dead)
        root = host_root(tmp_path, f"pool {POOL} port {lab.port}\n", [DEAD, other_dead.host])
        found, _ = run_time(root, ntp_timeout_seconds=1.0)
    members = [f for f in found.values() if f.subject.startswith(POOL)]
    assert {f.subject for f in members} == {f"{POOL}:{lab.port} ({DEAD})", f"{POOL}:{lab.port} (127.83.8.14)"}
    assert all((f.status, f.reason, f.required) == (Status.UNKNOWN, "NtpNoAnswer", True) for f in members)


def test_chrony_pool_maxsources_is_read() -> None:
    servers_, _ = parse_chrony_conf(
        "pool a.example iburst maxsources 2\npool b.example\nserver c.example maxsources 9\npool d maxsources 99\n",
        "/etc/chrony.conf",
    )
    assert [(s.entry, s.directive, s.max_sources) for s in servers_] == [
        ("a.example", "pool", 2),
        ("b.example", "pool", 4),
        ("c.example", "server", 4),
        ("d", "pool", 16),
    ]
