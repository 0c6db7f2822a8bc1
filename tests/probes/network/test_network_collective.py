"""network.collective in a real network namespace the test creates: an `ib0`-like training interface, a
management `eth0`, a `docker0`; NCCL_SOCKET_IFNAME's syntax; each reason raised and cleared."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_infiniband import node as ib_node
from support.netservers import Netns
from support.system import require_root, require_tool

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.collective import CollectiveProbe, judge_ib_hca, nccl_default, parse_ib_hca, parse_ifname
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


# --- NCCL_IB_HCA (interconnect.collective_ib_hca) -----------------------------------------------------------------


def test_nccl_ib_hca_syntax_as_nccl_documents_it() -> None:
    prefix = parse_ib_hca("mlx5_1")  # without `=`, mlx5_1 is a prefix: mlx5_10..19 too (NCCL's own warning)
    assert prefix.matches("mlx5_1", 1) and prefix.matches("mlx5_12", 1) and not prefix.matches("mlx5_2", 1)
    exact = parse_ib_hca("=mlx5_0:1,mlx5_1:1")
    assert exact.matches("mlx5_0", 1) and not exact.matches("mlx5_0", 2) and not exact.matches("mlx5_10", 1)
    excluded = parse_ib_hca("^=mlx5_1,mlx5_4")
    assert excluded.matches("mlx5_0", 1) and not excluded.matches("mlx5_4", 1) and excluded.matches("mlx5_10", 1)
    assert parse_ib_hca("mlx5").matches("mlx5_7", 2)


@pytest.mark.parametrize("value", ["mlx5_0:x", "=", "mlx5_0;rm", "mlx5_0,,mlx5_1", "mlx5 0"])
def test_a_bad_nccl_ib_hca_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"interconnect\.collective_ib_hca"):
        parse_config({"interconnect": {"collective_ib_hca": value}})


def test_nccl_ib_hca_must_select_an_active_port_of_this_node(tmp_path: Path) -> None:
    tree = ib_node(tmp_path / "sys", 4)
    ok = judge_ib_hca(tree.sys, "=mlx5_0:1,mlx5_1:1")
    assert ok.status == Status.OK and ok.observed["active"] == ["mlx5_0/1", "mlx5_1/1"]
    assert ok.subject == "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" and ok.category == "interconnect"
    # a typo, a renamed card (mlx5_bond_0), a port the card lacks: NCCL would use fewer rails or sockets
    for value, named in (("=mlx5_0,mlx5_9", "mlx5_9"), ("mlx5_bond", "mlx5_bond"), ("=mlx5_0:2", "mlx5_0:2")):
        missing = judge_ib_hca(tree.sys, value)
        assert missing.reason == "CollectiveHcaMissing" and missing.status == Status.FAIL, value
        assert f"names {named}, which this node lacks" in missing.message and "mlx5_3/1" in missing.message
    # an exclude list that leaves nothing
    assert judge_ib_hca(tree.sys, "^mlx5").reason == "CollectiveHcaMissing"
    # every selected port down: sockets; one of two down: NCCL uses the other (interconnect.ports fails that port)
    tree.set_state("mlx5_2/1", "DOWN", "Polling")
    down = judge_ib_hca(tree.sys, "=mlx5_2")
    assert down.reason == "CollectiveHcaDown" and down.status == Status.FAIL and "mlx5_2/1" in down.message
    assert judge_ib_hca(tree.sys, "=mlx5_2,mlx5_3").status == Status.OK
    tree.set_state("mlx5_2/1", "ACTIVE", "LinkUp")
    assert judge_ib_hca(tree.sys, "=mlx5_2").status == Status.OK
    # no HCA at all
    assert judge_ib_hca(tmp_path / "nosys", "mlx5").reason == "CollectiveHcaMissing"


@pytest.mark.system
def test_nccl_ib_hca_is_judged_beside_the_socket_interface(netns: Netns, tmp_path: Path) -> None:
    tree = ib_node(tmp_path / "sys", 2)
    config = parse_config(
        {"interconnect": {"collective_netns": netns.path, "collective_ifname": "ib", "collective_ib_hca": "=mlx5_7"}}
    )
    out = CollectiveProbe().run(ProbeContext(Host(dev=tmp_path, sys=tree.sys), config, 10))
    found = {f.subject: f for f in out if isinstance(f, Finding)}
    assert found["NCCL_IB_HCA==mlx5_7"].reason == "CollectiveHcaMissing"
    assert found["ib0"].status == Status.OK  # the socket interface is judged as before
    # asked only for NCCL_IB_HCA, on a node with nothing else that makes the probe apply: applies
    alone = parse_config({"interconnect": {"collective_netns": netns.path, "collective_ib_hca": "mlx5"}})
    out = CollectiveProbe().run(ProbeContext(Host(dev=tmp_path / "nodev", sys=tree.sys), alone, 10))
    assert {f.subject: f.reason for f in out if isinstance(f, Finding)}["NCCL_IB_HCA=mlx5"] == "OK"
