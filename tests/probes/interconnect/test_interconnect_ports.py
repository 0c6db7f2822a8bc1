"""interconnect.ports on an 8-HCA fake sysfs tree under the host's /sys: every reason raised and cleared, the
counter windows kept across an agent restart (the state file) and a counter reset that is not a burst."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.fake_infiniband import InfinibandTree, node

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, ProbeParseError, Sample, Status
from probes.interconnect.ports import InterconnectPortsProbe
from probes.interconnect.sysfs import parse_rate, parse_state
from probes.runtime.host import Host

ALL = [f"mlx5_{i}/1" for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def ctx(tree: InfinibandTree, tmp: Path, **section: object) -> ProbeContext:
    section.setdefault("state_dir", str(tmp / "state"))
    return ProbeContext(Host(sys=tree.sys), parse_config({"interconnect": section}), 5.0)


def findings(output: list[Finding | Sample]) -> dict[str, Finding]:
    return {item.subject: item for item in output if isinstance(item, Finding)}


def reasons(output: list[Finding | Sample]) -> dict[str, str]:
    return {subject: finding.reason for subject, finding in findings(output).items()}


def healthy(output: list[Finding | Sample]) -> bool:
    return all(f.status == Status.OK for f in findings(output).values()) and len(findings(output)) == 8


@pytest.fixture
def tree(tmp_path: Path) -> InfinibandTree:
    return node(tmp_path / "sys")


def test_eight_healthy_ports_are_ok_in_the_interconnect_category(tree: InfinibandTree, tmp_path: Path) -> None:
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path, expected_ports=ALL, expected_rate_gbps=400))
    assert healthy(out)
    finding = findings(out)["mlx5_3/1"]
    assert finding.category == "interconnect" and finding.device is None
    assert finding.observed["rate_gbps"] == 400 and finding.observed["state"] == "ACTIVE"


def test_down_and_init_ports_fail_and_clear(tree: InfinibandTree, tmp_path: Path) -> None:
    probe = InterconnectPortsProbe(Clock())
    tree.set_state("mlx5_2/1", "DOWN", "Polling")
    tree.set_state("mlx5_5/1", "INIT", "LinkUp")  # no subnet manager yet
    out = probe.run(ctx(tree, tmp_path))
    assert reasons(out)["mlx5_2/1"] == "HcaPortDown" and reasons(out)["mlx5_5/1"] == "HcaPortDown"
    assert findings(out)["mlx5_2/1"].status == Status.FAIL
    assert "DOWN/Polling" in findings(out)["mlx5_2/1"].message
    assert {s for s, r in reasons(out).items() if r != "OK"} == {"mlx5_2/1", "mlx5_5/1"}
    tree.set_state("mlx5_2/1", "ACTIVE", "LinkUp")
    tree.set_state("mlx5_5/1", "ACTIVE", "LinkUp")
    assert healthy(probe.run(ctx(tree, tmp_path)))


def test_missing_expected_port_fails(tree: InfinibandTree, tmp_path: Path) -> None:
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path, expected_ports=[*ALL, "mlx5_8/1"]))
    assert reasons(out)["mlx5_8/1"] == "HcaPortMissing"
    assert findings(out)["mlx5_8/1"].status == Status.FAIL


@pytest.mark.parametrize("status", ["warn", "fail"])
def test_port_below_the_expected_rate_is_degraded_per_config(tree: InfinibandTree, tmp_path: Path, status: str) -> None:
    probe = InterconnectPortsProbe(Clock())
    tree.set_rate("mlx5_7/1", "200 Gb/sec (2X NDR)")
    out = probe.run(ctx(tree, tmp_path, expected_rate_gbps=400, degraded_status=status))
    finding = findings(out)["mlx5_7/1"]
    assert finding.reason == "HcaPortDegraded" and finding.status == Status(status)
    assert "200 Gb/s, expected 400 Gb/s" in finding.message
    assert {s for s, r in reasons(out).items() if r != "OK"} == {"mlx5_7/1"}
    tree.set_rate("mlx5_7/1", "400 Gb/sec (4X NDR)")
    assert healthy(probe.run(ctx(tree, tmp_path, expected_rate_gbps=400, degraded_status=status)))


def test_link_downed_within_the_window_flaps_then_clears(tree: InfinibandTree, tmp_path: Path) -> None:
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    tree.set_counter("mlx5_1/1", "link_downed", 7)  # since the driver loaded: only the baseline
    assert healthy(probe.run(ctx(tree, tmp_path, window_seconds=600)))
    clock.now += 30
    tree.set_counter("mlx5_1/1", "link_downed", 8)
    out = probe.run(ctx(tree, tmp_path, window_seconds=600))
    assert reasons(out)["mlx5_1/1"] == "HcaPortFlapping"
    assert findings(out)["mlx5_1/1"].observed["link_downed_in_window"] == 1
    clock.now += 300
    assert reasons(probe.run(ctx(tree, tmp_path, window_seconds=600)))["mlx5_1/1"] == "HcaPortFlapping"
    clock.now += 301  # the window passed quietly
    assert healthy(probe.run(ctx(tree, tmp_path, window_seconds=600)))


def test_error_counters_warn_past_the_threshold_and_clear(tree: InfinibandTree, tmp_path: Path) -> None:
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    settings = {"window_seconds": 600, "error_threshold": 50}
    probe.run(ctx(tree, tmp_path, **settings))
    clock.now += 30
    tree.set_counter("mlx5_4/1", "symbol_error", 30)
    assert healthy(probe.run(ctx(tree, tmp_path, **settings)))  # 30 < 50
    clock.now += 30
    tree.set_counter("mlx5_4/1", "port_rcv_errors", 25)
    out = probe.run(ctx(tree, tmp_path, **settings))
    finding = findings(out)["mlx5_4/1"]
    assert finding.reason == "HcaPortErrors" and finding.status == Status.WARN
    assert "symbol_error +30" in finding.message and "port_rcv_errors +25" in finding.message
    clock.now += 601
    assert healthy(probe.run(ctx(tree, tmp_path, **settings)))


def test_a_counter_reset_is_a_new_baseline_not_a_burst(tree: InfinibandTree, tmp_path: Path) -> None:
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    tree.set_counter("mlx5_0/1", "symbol_error", 100_000)
    tree.set_counter("mlx5_0/1", "link_downed", 40)
    probe.run(ctx(tree, tmp_path))
    clock.now += 30
    tree.set_counter("mlx5_0/1", "symbol_error", 3)  # driver reloaded: counters restart
    tree.set_counter("mlx5_0/1", "link_downed", 0)
    assert healthy(probe.run(ctx(tree, tmp_path)))
    clock.now += 30
    tree.set_counter("mlx5_0/1", "link_downed", 1)  # a real flap after the reset is one
    assert reasons(probe.run(ctx(tree, tmp_path)))["mlx5_0/1"] == "HcaPortFlapping"


def test_the_window_survives_an_agent_restart(tree: InfinibandTree, tmp_path: Path) -> None:
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    probe.run(ctx(tree, tmp_path))
    clock.now += 30
    tree.set_counter("mlx5_6/1", "link_error_recovery", 2)
    assert reasons(probe.run(ctx(tree, tmp_path)))["mlx5_6/1"] == "HcaPortFlapping"
    state = json.loads((tmp_path / "state" / "interconnect-ports.json").read_text())
    assert state["counters"]["mlx5_6/1 link_error_recovery"]["last"] == 2
    clock.now += 60
    restarted = InterconnectPortsProbe(clock)  # a new agent: the increase is still within the window
    assert reasons(restarted.run(ctx(tree, tmp_path)))["mlx5_6/1"] == "HcaPortFlapping"
    # and a counter that rose while the agent was away is an increase, not a new baseline
    tree.set_counter("mlx5_3/1", "link_downed", 1)
    clock.now += 30
    again = InterconnectPortsProbe(clock)
    assert reasons(again.run(ctx(tree, tmp_path)))["mlx5_3/1"] == "HcaPortFlapping"


@pytest.mark.parametrize("content", ["", "{", "[]", '{"counters": {"x": {"last": -1, "events": []}}}', "\x00\xff"])
def test_a_broken_state_file_is_an_empty_baseline(tree: InfinibandTree, tmp_path: Path, content: str) -> None:
    state = tmp_path / "state" / "interconnect-ports.json"
    state.parent.mkdir()
    state.write_text(content, errors="surrogateescape")
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path))
    assert healthy(out)
    assert json.loads(state.read_text())["version"] == 1  # rewritten whole


def test_ethernet_ports_are_roce_and_checked_unless_left_out(tmp_path: Path) -> None:
    tree = InfinibandTree(tmp_path / "sys")
    tree.add("mlx5_0/1", "100 Gb/sec (2X EDR)", link_layer="Ethernet")
    tree.set_state("mlx5_0/1", "DOWN", "Disabled")
    assert reasons(InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path))) == {"mlx5_0/1": "HcaPortDown"}
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path, link_layers=["InfiniBand"]))
    assert findings(out) == {}


def test_no_hca_skips_with_a_reason(tmp_path: Path) -> None:
    probe = InterconnectPortsProbe(Clock())
    context = ProbeContext(Host(sys=tmp_path / "nosys"), parse_config({}), 5.0)
    why = probe.applicable(context)
    assert why is not None and "no InfiniBand/RoCE HCA port" in why
    (finding,) = probe.run(context)
    assert isinstance(finding, Finding) and finding.reason == "NotApplicable" and finding.status == Status.SKIP


def test_unparseable_port_is_unknown_and_others_still_judged(tree: InfinibandTree, tmp_path: Path) -> None:
    (tree.port_dir("mlx5_2/1") / "state").write_text("garbage\n")
    tree.set_counter("mlx5_3/1", "symbol_error", 0)
    (tree.port_dir("mlx5_4/1") / "counters" / "symbol_error").write_text("lots\n")
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path))
    assert reasons(out)["mlx5_2/1"] == "ParseError" and findings(out)["mlx5_2/1"].status == Status.UNKNOWN
    assert reasons(out)["mlx5_4/1"] == "ParseError"
    assert sum(1 for r in reasons(out).values() if r == "OK") == 6


def test_samples_carry_node_exporter_labels(tree: InfinibandTree, tmp_path: Path) -> None:
    tree.set_counter("mlx5_0/1", "symbol_error", 12)
    out = InterconnectPortsProbe(Clock()).run(ctx(tree, tmp_path))
    samples = [s for s in out if isinstance(s, Sample)]
    rate = [s for s in samples if s.name == "nodehealth_interconnect_port_rate_bytes_per_second"]
    assert len(rate) == 8 and rate[0].value == 50e9 and dict(rate[0].labels) == {"device": "mlx5_0", "port": "1"}
    (symbol,) = [s for s in samples if s.labels.get("counter") == "symbol_error" and s.labels["device"] == "mlx5_0"]
    assert symbol.value == 12 and symbol.kind == "counter"


def test_parsers() -> None:
    assert parse_state("4: ACTIVE\n", "state") == (4, "ACTIVE")
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 2.5 and parse_rate("") is None
    with pytest.raises(ProbeParseError):
        parse_rate("fast")
    with pytest.raises(ProbeParseError):
        parse_state("ACTIVE", "state")


def test_bad_expected_port_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"interconnect\.expected_ports"):
        parse_config({"interconnect": {"expected_ports": ["mlx5_0"]}})


def test_ready_checks_can_ask_for_the_interconnect_category_or_leave_it_out() -> None:
    from agent.ready import parse_checks, selects

    known = ["interconnect.ports", "gpu.nvlink", "network.dns"]
    assert parse_checks("interconnect", known) == ("interconnect",)
    assert parse_checks("gpu,network", known) == ("gpu", "network")
    assert selects("interconnect", "interconnect.ports")
    assert not selects("gpu", "interconnect.ports") and not selects("network", "interconnect.ports")
    assert not selects("interconnect", "gpu.nvlink")  # an NVLink is its GPU's: /ready?checks=gpu


@pytest.mark.parametrize(
    ("counter", "reason", "status"),
    [
        ("link_downed", "HcaPortFlapping", Status.FAIL),
        ("link_error_recovery", "HcaPortFlapping", Status.FAIL),
        ("symbol_error", "HcaPortErrors", Status.WARN),
        ("port_rcv_errors", "HcaPortErrors", Status.WARN),
        ("local_link_integrity_errors", "HcaPortErrors", Status.WARN),
        ("excessive_buffer_overrun_errors", "HcaPortErrors", Status.WARN),
    ],
)
def test_each_counter_the_issue_names_is_judged_by_its_increase(
    tree: InfinibandTree, tmp_path: Path, counter: str, reason: str, status: Status
) -> None:
    clock = Clock()
    probe = InterconnectPortsProbe(clock)
    settings = {"window_seconds": 600, "error_threshold": 10, "link_down_threshold": 1}
    tree.set_counter("mlx5_7/1", counter, 1_000)  # since the driver loaded: a baseline
    assert healthy(probe.run(ctx(tree, tmp_path, **settings)))
    clock.now += 60
    tree.set_counter("mlx5_7/1", counter, 1_010)
    finding = findings(probe.run(ctx(tree, tmp_path, **settings)))["mlx5_7/1"]
    assert (finding.reason, finding.status) == (reason, status)
    assert finding.observed[f"{counter}_in_window"] == 10
    clock.now += 601
    assert healthy(probe.run(ctx(tree, tmp_path, **settings)))
