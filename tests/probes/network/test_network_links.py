"""network.links on veth pairs inside a network namespace the test creates, set down and flapped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.netservers import Netns
from support.system import require_root, require_tool

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Sample, Status
from probes.network.links import CarrierHistory, LinksProbe, LinkState, is_physical, link_findings
from probes.network.netns import choose_netns
from probes.runtime.host import Host


@pytest.fixture
def netns() -> Iterator[Netns]:
    require_root()
    require_tool("ip")
    ns = Netns("nhlink")
    try:
        ns.ip("link", "add", "ha0", "type", "veth", "peer", "name", "hb0")
        ns.ip("link", "add", "ha1", "type", "veth", "peer", "name", "hb1")
        for name in ("ha0", "hb0", "ha1", "hb1"):
            ns.ip("link", "set", name, "up")
        ns.ip("addr", "add", "192.0.2.10/24", "dev", "ha0")
        ns.ip("addr", "add", "198.51.100.10/24", "dev", "ha1")
        ns.ip("route", "add", "default", "via", "192.0.2.1", "dev", "ha0")
        yield ns
    finally:
        ns.close()


def run_links(probe: LinksProbe, links: dict, host: Host | None = None) -> tuple[dict[str, Finding], list[Sample]]:
    config = parse_config({"network": {"links": links}})
    out = probe.run(ProbeContext(host or Host(), config, 5))
    return {f.subject: f for f in out if isinstance(f, Finding)}, [s for s in out if isinstance(s, Sample)]


@pytest.mark.system
def test_links_up_and_default_route_in_the_namespace(netns: Netns) -> None:
    findings, samples = run_links(LinksProbe(), {"netns": netns.path, "interfaces": ["ha0", "hb0", "ha1"]})
    for name in ("ha0", "hb0", "ha1"):
        assert findings[name].status is Status.OK, findings[name]
        assert findings[name].observed["carrier"] == 1
    summary = findings[""]
    assert summary.observed["default_route_interface"] == "ha0"
    assert summary.observed["netns"] == netns.path
    # veth devices have no bus device: not physical, so not multi-NIC candidates.
    assert summary.observed["physical_interfaces"] == []
    assert summary.observed["multi_nic"] is False
    up = {s.labels["interface"]: s.value for s in samples if s.name == "nodehealth_network_link_up"}
    assert up == {"ha0": 1.0, "hb0": 1.0, "ha1": 1.0}
    counters = [s for s in samples if s.name == "nodehealth_network_link_carrier_changes_total"]
    assert counters and all(s.kind == "counter" for s in counters)


@pytest.mark.system
def test_admin_down_and_no_carrier(netns: Netns) -> None:
    netns.ip("link", "set", "hb0", "down")  # its peer ha0 loses carrier
    findings, samples = run_links(LinksProbe(), {"netns": netns.path, "interfaces": ["ha0", "hb0", "ha1", "eth9"]})
    hb0, ha0 = findings["hb0"], findings["ha0"]
    assert (hb0.status, hb0.reason) == (Status.FAIL, "LinkDown")
    assert "administratively down" in hb0.message and hb0.observed["admin_up"] is False
    assert (ha0.status, ha0.reason) == (Status.FAIL, "LinkDown")
    assert "no carrier" in ha0.message and ha0.observed["carrier"] == 0
    assert findings["ha1"].status is Status.OK
    assert (findings["eth9"].reason, findings["eth9"].status) == ("LinkDown", Status.FAIL)
    assert "does not exist" in findings["eth9"].message
    up = {s.labels["interface"]: s.value for s in samples if s.name == "nodehealth_network_link_up"}
    assert up["ha0"] == 0.0 and up["hb0"] == 0.0 and up["ha1"] == 1.0


@pytest.mark.system
def test_flapping_is_detected_from_carrier_changes_across_runs(netns: Netns) -> None:
    probe = LinksProbe()  # keeps the history between runs, as the scheduler's instance does
    settings = {"netns": netns.path, "interfaces": ["ha0", "ha1"], "max_carrier_changes_per_hour": 6}
    first, _ = run_links(probe, settings)
    assert first["ha0"].status is Status.OK
    assert "carrier_changes_in_window" not in first["ha0"].observed  # no baseline yet
    for _ in range(4):  # each down/up of the peer is two carrier changes of ha0
        netns.ip("link", "set", "hb0", "down")
        netns.ip("link", "set", "hb0", "up")
    second, samples = run_links(probe, settings)
    flapping = second["ha0"]
    assert (flapping.status, flapping.reason) == (Status.FAIL, "LinkFlapping")
    assert flapping.observed["carrier_changes_in_window"] == 8
    assert second["ha1"].status is Status.OK and second["ha1"].observed["carrier_changes_in_window"] == 0
    counter = next(s for s in samples if s.name.endswith("carrier_changes_total") and s.labels["interface"] == "ha0")
    assert counter.value == first["ha0"].observed["carrier_changes"] + 8
    # A fresh probe instance has no history: no flapping verdict from one sample.
    fresh, _ = run_links(LinksProbe(), settings)
    assert fresh["ha0"].status is Status.OK


@pytest.mark.system
def test_recreated_interface_resets_its_history(netns: Netns) -> None:
    probe = LinksProbe()
    settings = {"netns": netns.path, "interfaces": ["ha1"], "max_carrier_changes_per_hour": 1}
    run_links(probe, settings)
    netns.ip("link", "del", "ha1")
    netns.ip("link", "add", "ha1", "type", "veth", "peer", "name", "hb1")
    netns.ip("link", "set", "hb1", "up")
    netns.ip("link", "set", "ha1", "up")
    findings, _ = run_links(probe, settings)
    assert findings["ha1"].status is Status.OK
    assert "carrier_changes_in_window" not in findings["ha1"].observed


def test_unreadable_netns_is_unknown(tmp_path: Path) -> None:
    findings, _ = run_links(LinksProbe(), {"netns": str(tmp_path / "missing"), "interfaces": ["x"]})
    assert (findings[""].status, findings[""].reason) == (Status.UNKNOWN, "NetlinkFailed")


def test_default_selection_is_physical_nics_of_own_namespace_when_host_ns_is_unreadable() -> None:
    # The agent's own namespace: physical NICs are those with a bus device (virtio, PCI).
    findings, _ = run_links(LinksProbe(), {})
    summary = findings[""]
    physical = summary.observed["physical_interfaces"]
    for name in physical:
        assert Path("/sys/class/net", name, "device").exists()
    assert set(physical) <= set(findings)
    assert "lo" not in findings


def test_choose_netns(tmp_path: Path) -> None:
    assert choose_netns(Host(), "/run/netns/x") == ("/run/netns/x", "/run/netns/x")
    # A proc tree whose pid 1 is this process: same namespace, no setns needed.
    (tmp_path / "1").symlink_to(f"/proc/{os.getpid()}")
    assert choose_netns(Host(proc=tmp_path), "") == (None, "host (hostNetwork)")
    (tmp_path / "1").unlink()
    (tmp_path / "1").mkdir()
    path, label = choose_netns(Host(proc=tmp_path), "")
    assert path is None and "cannot open" in label


def link(**kw: object) -> LinkState:
    base = dict(
        name="eth0",
        index=2,
        admin_up=True,
        operstate="UP",
        carrier=1,
        carrier_changes=2,
        kind=None,
        parent_device="0000:3b:00.0",
    )
    base.update(kw)
    return LinkState(**base)  # type: ignore[arg-type]


def test_link_findings_rules() -> None:
    assert link_findings(link(), None, 6, 3600)[0].status is Status.OK
    # lo and virtual devices report UNKNOWN operstate with carrier: that is up.
    assert link_findings(link(operstate="UNKNOWN"), None, 6, 3600)[0].status is Status.OK
    assert link_findings(link(operstate="LOWERLAYERDOWN", carrier=0), None, 6, 3600)[0].reason == "LinkDown"
    assert link_findings(link(admin_up=False, carrier=0), 50, 6, 3600)[0].message.endswith("administratively down")
    assert link_findings(link(), 6, 6, 3600)[0].status is Status.OK
    assert link_findings(link(), 7, 6, 3600)[0].reason == "LinkFlapping"


def test_carrier_history_window() -> None:
    history = CarrierHistory(index=2)
    assert history.add(0.0, 10, 3600) is None
    assert history.add(1000.0, 14, 3600) == 4
    assert history.add(3000.0, 20, 3600) == 10
    # At 4700 the baseline is the newest sample at or before 4700 - 3600 = 1100: the one at 1000.
    assert history.add(4700.0, 21, 3600) == 7
    # At 8000 the baseline is the sample at 3000 (the one at 4700 is inside the window): the change between
    # 3000 and 4700 may have been inside the window, so it still counts.
    assert history.add(8000.0, 21, 3600) == 1
    assert history.add(9000.0, 21, 3600) == 0
    assert history.add(8001.0, 3, 3600) is None  # counter went back: device re-created


def test_is_physical(tmp_path: Path) -> None:
    (tmp_path / "eth1").mkdir()
    (tmp_path / "eth1" / "device").mkdir()
    assert is_physical(link(name="eth1", parent_device=None), tmp_path)
    assert is_physical(link(name="ens3"), tmp_path)  # IFLA_PARENT_DEV_NAME
    assert not is_physical(link(name="veth0", parent_device=None, kind="veth"), tmp_path)
    assert not is_physical(link(name="eth2", parent_device=None), tmp_path)
