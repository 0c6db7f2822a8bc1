"""network.collective in a real network namespace the test creates: an `ib0`-like training interface, a
management `eth0`, a `docker0`; NCCL_SOCKET_IFNAME's syntax; each reason raised and cleared."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.netservers import Netns
from support.system import require_root, require_tool

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.collective import CollectiveProbe, nccl_default, parse_ifname
from probes.network.links import LinkState
from probes.runtime.host import Host


@pytest.fixture
def netns() -> Iterator[Netns]:
    require_root()
    require_tool("ip")
    ns = Netns("nhcoll")
    try:
        # veth pairs named like a node's NICs: the training interface, the management one, docker's bridge.
        for name, peer in (("ib0", "ibpeer"), ("eth0", "ethpeer"), ("docker0", "dockpeer")):
            ns.ip("link", "add", name, "type", "veth", "peer", "name", peer)
            ns.ip("link", "set", name, "up")
            ns.ip("link", "set", peer, "up")
        ns.ip("addr", "add", "10.20.0.5/16", "dev", "ib0")
        ns.ip("addr", "add", "192.0.2.10/24", "dev", "eth0")
        ns.ip("addr", "add", "172.17.0.1/16", "dev", "docker0")
        ns.ip("route", "add", "default", "via", "192.0.2.1", "dev", "eth0")
        yield ns
    finally:
        ns.close()


def run(ns: Netns, dev: Path | None = None, **section: Any) -> dict[str, Finding]:
    """The probe on a node with one GPU device node (dev/nvidia0: a regular file is enough to be listed)."""
    config = parse_config({"interconnect": {"collective_netns": ns.path, **section}})
    if dev is None:
        dev = Path(tempfile.mkdtemp(prefix="nh-coll-dev-"))
        (dev / "nvidia0").write_text("")
    out = CollectiveProbe().run(ProbeContext(Host(dev=dev), config, 10))
    found = {f.subject: f for f in out if isinstance(f, Finding)}
    assert all(f.category == "interconnect" for f in found.values())
    return found


@pytest.mark.system
def test_the_configured_interface_up_with_its_route_is_ok(netns: Netns) -> None:
    found = run(netns, collective_ifname="ib", collective_peer_subnets=["10.20.0.0/16"])
    assert found["ib0"].status == Status.OK and found["ib0"].observed["addresses"] == ["10.20.0.5"]
    assert found["10.20.0.0/16"].status == Status.OK


@pytest.mark.system
def test_missing_down_no_address_and_wrong_route_each_fail_and_clear(netns: Netns) -> None:
    assert run(netns, collective_ifname="=ib1")["=ib1"].reason == "CollectiveIfaceMissing"
    netns.ip("link", "set", "ib0", "down")
    found = run(netns, collective_ifname="ib0")
    assert (found["ib0"].reason, found["ib0"].status) == ("CollectiveIfaceDown", Status.FAIL)
    netns.ip("link", "set", "ib0", "up")
    netns.ip("addr", "flush", "dev", "ib0")
    found = run(netns, collective_ifname="ib0", collective_peer_subnets=["10.20.0.0/16"])
    assert found["ib0"].reason == "CollectiveIfaceDown" and "no address" in found["ib0"].message
    # without its address, the peers' subnet is reached through the default route on eth0
    route = found["10.20.0.0/16"]
    assert route.reason == "CollectiveRouteMismatch" and "leaves by eth0, not by ib0" in route.message
    netns.ip("addr", "add", "10.20.0.5/16", "dev", "ib0")
    found = run(netns, collective_ifname="ib0", collective_peer_subnets=["10.20.0.0/16"])
    assert {f.status for f in found.values()} == {Status.OK}


@pytest.mark.system
def test_unset_on_a_multi_nic_node_warns_with_nccl_pick(netns: Netns) -> None:
    (finding,) = run(netns).values()
    assert (finding.reason, finding.status) == ("CollectiveIfaceAmbiguous", Status.WARN)
    assert finding.observed["nccl_pick"] == "ib0" and "docker0" not in finding.observed["candidates"]
    assert "NCCL would bootstrap on ib0" in finding.message
    netns.ip("link", "del", "ib0")  # no ib*: NCCL takes the first but docker*, lo, virbr*
    (finding,) = run(netns).values()
    assert finding.status == Status.OK and finding.observed["nccl_pick"] == "eth0"


def link(name: str, address: str = "10.0.0.1") -> LinkState:
    return LinkState(name, 1, True, "UP", 1, 0, None, None, 1500, (address,) if address else ())


def test_nccl_syntax_and_default_order() -> None:
    assert parse_ifname("^docker,lo").matches("eth0") and not parse_ifname("^docker,lo").matches("docker0")
    assert parse_ifname("=eth0").matches("eth0") and not parse_ifname("=eth0").matches("eth01")
    assert parse_ifname("eth").matches("eth01") and not parse_ifname("ib").matches("eth0")
    assert parse_ifname("^=eth0").matches("eth01") and not parse_ifname("^=eth0").matches("eth0")
    links = [link("lo", "127.0.0.1"), link("docker0"), link("eth0"), link("ib1", ""), link("virbr0")]
    assert [x.name for x in nccl_default(links)] == ["eth0"]  # ib1 has no address
    assert [x.name for x in nccl_default([link("lo", "127.0.0.1"), link("docker0")])] == ["docker0"]


def test_a_bad_peer_subnet_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"interconnect\.collective_peer_subnets"):
        parse_config({"interconnect": {"collective_peer_subnets": ["10.20.0.0/99"]}})


def test_a_node_without_accelerators_hcas_or_config_skips(tmp_path: Path) -> None:
    probe = CollectiveProbe()
    context = ProbeContext(Host(dev=tmp_path, sys=tmp_path), parse_config({}), 5)
    (finding,) = probe.run(context)
    assert isinstance(finding, Finding) and finding.reason == "NotApplicable" and finding.status == Status.SKIP
