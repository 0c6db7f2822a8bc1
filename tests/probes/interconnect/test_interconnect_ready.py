"""/ready?checks=interconnect over real HTTP (the agent's HttpServer and HealthState on 127.0.0.1): the category
selects its own checks (interconnect.ports) and every result that carries it by a per-check override
(network.collective, the mlx5 kernel.log rules), while `network` still selects network.collective by its name;
the same selection serves kubernetes.disabled_checks and `node-health check --only`."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.cli import probe_selected
from agent.config import KubernetesConfig
from agent.http.routes import HttpServer
from agent.kube.node.policy import category_intents
from agent.metrics import MetricsRenderer
from agent.ready import matches_finding, selects
from agent.snapshot import CheckState
from agent.state import HealthSettings, HealthState, ProbeSpec
from probes import all_probes
from probes.base import Finding, Status
from probes.interconnect.ports import PORTS
from probes.interconnect.reasons import HCA_PORT_DOWN
from probes.network.collective import COLLECTIVE, COLLECTIVE_IFACE_DOWN

CHECKS = ("interconnect.ports", "network.collective", "network.dns", "kernel.log", "storage.space")


def port_down() -> Finding:
    return PORTS.report(HCA_PORT_DOWN, "mlx5_0/1", "mlx5_0 port 1: state DOWN", {"state": "DOWN"})


def collective_down() -> Finding:
    return COLLECTIVE.report(COLLECTIVE_IFACE_DOWN, "ib0", "ib0 (NCCL_SOCKET_IFNAME=ib0) is down")


def mlx5_link_down() -> Finding:
    return Finding(
        "kernel.log",
        "Mlx5LinkDown",
        Status.WARN,
        "Mlx5LinkDown",
        "mlx5_core 0000:3b:00.0 ens1np0: Link down",
        "check the cable",
        category_override="interconnect",
    )


class Served:
    def __init__(self) -> None:
        self.state = HealthState("node-a", HealthSettings(fail_threshold=1, recovery_threshold=1))
        self.state.configure(
            [
                ProbeSpec("interconnect.ports", ("interconnect.ports",), 10.0, 5.0),
                ProbeSpec("network.collective", ("network.collective",), 10.0, 5.0),
                ProbeSpec("network.dns", ("network.dns",), 10.0, 5.0),
                ProbeSpec("kernel.log", ("kernel.log",), 10.0, 5.0),
                ProbeSpec("storage.space", ("storage.space",), 10.0, 5.0),
            ]
        )
        self.server = HttpServer(
            self.state,
            MetricsRenderer(self.state.current).render,
            lambda: (True, {"problems": []}),
            lambda: CHECKS,
            address="127.0.0.1",
            port=0,
            max_wait=30.0,
            max_long_polls=3,
        )

    def reasons(self, path: str) -> tuple[int, list[tuple[str, str]]]:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=10)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body: dict[str, Any] = json.loads(response.read())
        finally:
            connection.close()
        return response.status, sorted((r["check"], r["reason"]) for r in body["reasons"])


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served()
    served.server.start()
    try:
        yield served
    finally:
        served.server.stop()


def feed(served: Served, ports: Finding, collective: Finding, kernel: Finding) -> None:
    served.state.record("interconnect.ports", [ports])
    served.state.record("network.collective", [collective])
    served.state.record("network.dns", [Finding("network.dns", "", Status.OK, "OK", "resolves")])
    served.state.record("kernel.log", [kernel])
    served.state.record("storage.space", [Finding("storage.space", "/data", Status.OK, "OK", "40% used")])


def test_ready_checks_interconnect_selects_the_category_overrides_included(served: Served) -> None:
    feed(served, port_down(), collective_down(), mlx5_link_down())
    status, reasons = served.reasons("/ready?checks=interconnect")
    assert status == 503
    # the kernel.log warn does not block (a warn never does), the two fails do, both in the category
    assert reasons == [("interconnect.ports", "HcaPortDown"), ("network.collective", "CollectiveIfaceDown")]
    # network.collective is still a network check by its name; interconnect.ports is not
    assert served.reasons("/ready?checks=network") == (503, [("network.collective", "CollectiveIfaceDown")])
    assert served.reasons("/ready?checks=storage") == (200, [])
    # clears: an ok collective and port leave /ready?checks=interconnect ready
    ok_ports = PORTS.ok("mlx5_0/1", "ACTIVE")
    ok_collective = COLLECTIVE.ok("ib0", "up, 10.0.0.5/24, routes the peers")
    feed(served, ok_ports, ok_collective, mlx5_link_down())
    assert served.reasons("/ready?checks=interconnect") == (200, [])


def test_only_the_category_override_is_what_selects_network_collective() -> None:
    finding = collective_down()
    assert finding.category == "interconnect"
    assert matches_finding(finding, ["interconnect"]) and matches_finding(finding, ["network"])
    assert not selects("interconnect", "network.collective")  # its name alone is network's
    assert selects("interconnect", "network.collective", "interconnect")
    assert not matches_finding(finding, ["gpu", "storage", "host"])
    assert not matches_finding(mlx5_link_down(), ["host"])  # kernel.log's default category, overridden
    assert selects("host", "kernel.log")  # without an override, kernel.log is a host check
    assert matches_finding(mlx5_link_down(), ["kernel", "interconnect"])


def test_disabled_checks_by_category_leave_the_override_out_of_the_node_condition() -> None:
    states = [CheckState(collective_down(), "network.collective", time.time(), time.time())]
    taint, condition = category_intents("interconnect", states, KubernetesConfig())
    assert taint.action == "set" and condition.status == "False"
    disabled = KubernetesConfig(disabled_checks=["interconnect"])
    taint, condition = category_intents("interconnect", states, disabled)
    assert taint.action == "none" and condition.action == "absent"


def test_check_only_interconnect_runs_the_probes_whose_results_carry_it() -> None:
    probes = {name: cls() for name, cls in all_probes().items()}
    selected = sorted(name for name, probe in probes.items() if probe_selected(probe, ("interconnect",)))
    assert {"interconnect.ports", "network.collective", "kernel.log"} <= set(selected)
    assert "gpu.links" not in selected and "network.dns" not in selected  # an NVLink is its GPU's
    assert sorted(n for n, p in probes.items() if probe_selected(p, ("network.collective",))) == ["network.collective"]
