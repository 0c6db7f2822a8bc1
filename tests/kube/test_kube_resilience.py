"""Resilience and least privilege against the API double: an Event the API refuses never holds back a taint;
a config that would evict pods or make every agent reconcile one Node is refused; no command line reaches
the Node."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import yaml
from support.kube_double import ApiDouble
from support.kube_helpers import Clock, all_ok, health_state, make_agent, our_taints, record

from agent.cli import main
from agent.config import ConfigError, parse_config
from probes.base import Event, Finding, Status

EVENTS = r"^/api/v1/namespaces/default/events$"


def event_errors(agent: object) -> dict[str, float]:
    samples = agent.samples()  # type: ignore[attr-defined]
    return {s.labels["kind"]: s.value for s in samples if s.name == "nodehealth_kube_event_errors_total" and s.value}


@pytest.mark.system
@pytest.mark.parametrize(("status", "kind"), [(403, "forbidden"), (404, "not_found")])
def test_a_refused_event_is_dropped_and_never_holds_back_a_taint(double: ApiDouble, status: int, kind: str) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock)
    all_ok(state)
    agent.step()
    double.inject(EVENTS, method="POST", status=status, times=-1)

    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.step()
    assert our_taints(double.node("n1")) == {"storage": ("MountMissing", "NoSchedule")}
    assert agent.status()["errors"] == {} and agent.status()["backoff_seconds"] == 0.0, "the pass did not fail"
    assert event_errors(agent) == {kind: 1.0}
    assert agent.status()["events"]["dropped"] == 1 and agent.status()["events"]["queued"] == 0

    clock.advance(1)  # the next poll: recovery is applied at once, no backoff in the way
    record(state, "storage", "storage.mounts", "ok")
    agent.step()
    assert our_taints(double.node("n1")) == {}
    assert double.events() == []
    assert event_errors(agent) == {kind: 2.0}


@pytest.mark.system
def test_an_event_the_api_cannot_take_now_waits_on_its_own_backoff(double: ApiDouble) -> None:
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock)
    agent = make_agent(double, state, clock, backoff_initial_seconds=10, backoff_max_seconds=40)
    all_ok(state)
    agent.step()
    fault = double.inject(EVENTS, method="POST", status=500, times=-1)
    record(state, "storage", "storage.mounts", "fail", "MountMissing")
    agent.step()
    assert our_taints(double.node("n1")) == {"storage": ("MountMissing", "NoSchedule")}
    assert agent.status()["events"]["queued"] == 1 and agent.status()["errors"] == {}

    posts = sum(1 for r in double.log if r.method == "POST")
    for _ in range(4):  # polled every second: the event queue waits 5-10 s before trying again
        clock.advance(1)
        agent.step()
    assert sum(1 for r in double.log if r.method == "POST") == posts, "no retry inside the backoff"
    record(state, "storage", "storage.mounts", "ok")
    agent.step()
    assert our_taints(double.node("n1")) == {}, "the taint went while the events wait"

    double._faults.remove(fault)
    clock.advance(60)
    agent.step()
    assert [e["reason"] for e in double.events()] == ["MountMissing", "Healthy"]
    stamps = [datetime.datetime.fromisoformat(e["firstTimestamp"]).timestamp() for e in double.events()]
    assert stamps == [Clock().now, Clock().now + 4], "stamped when it happened, not when sent"
    assert event_errors(agent)["server"] >= 1 and agent.status()["events"]["queued"] == 0


def write_config(tmp_path: Path, document: dict[str, object]) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_noexecute_is_refused_unless_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused = write_config(tmp_path, {"kubernetes": {"default_effect": "NoExecute"}})
    assert main(["config", "--validate", refused]) == 2
    err = capsys.readouterr().err
    assert "config key kubernetes.default_effect" in err and "kubernetes.allow_noexecute: true" in err
    refused = write_config(tmp_path, {"kubernetes": {"effects": {"NpuHealthCritical": "NoExecute"}}})
    assert main(["config", "--validate", refused]) == 2
    assert "config key kubernetes.effects" in capsys.readouterr().err
    allowed = write_config(
        tmp_path, {"kubernetes": {"allow_noexecute": True, "effects": {"NpuHealthCritical": "NoExecute"}}}
    )
    assert main(["config", "--validate", allowed]) == 0
    assert parse_config({}).kubernetes.allow_noexecute is False


def test_node_name_must_match_node_name_from_the_downward_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-1")
    with pytest.raises(ConfigError, match=r"config key node_name: .*differs from \$NODE_NAME \('gpu-1'\)"):
        parse_config({"node_name": "gpu-2"})
    assert main(["config", "--validate", write_config(tmp_path, {"node_name": "gpu-2"})]) == 2
    assert "node_name" in capsys.readouterr().err
    assert parse_config({"node_name": "gpu-1"}).resolved_node_name == "gpu-1"
    assert parse_config({}).resolved_node_name == "gpu-1"
    monkeypatch.delenv("NODE_NAME")
    assert parse_config({"node_name": "gpu-2"}).resolved_node_name == "gpu-2", "outside a pod it names the node"


@pytest.mark.system
def test_no_command_line_reaches_the_api(double: ApiDouble) -> None:
    secret = "--hf-token=hf_SECRETSECRET"
    clock = Clock()
    double.add_node("n1")
    state = health_state("n1", clock, {"npu": ("npu.holders",)})
    agent = make_agent(double, state, clock)
    holder = Finding(
        "npu.holders",
        "0",
        Status.FAIL,
        "DeviceHeldOutsidePod",
        "pid 4242 (python3) outside any pod holds /dev/davinci0",
        "stop it",
        {"pid": 4242, "cmdline": f"python3 train.py {secret}"},
        device=0,
        event=Event("DeviceHolderFound", "pid 4242 (python3) holds /dev/davinci0"),
    )
    state.record("npu", [holder])
    agent.reconcile_once()
    clock.advance(700)  # and a heartbeat, which rewrites every message
    state.record("npu", [holder])
    agent.reconcile_once()
    assert double.writes, "the agent wrote"
    assert secret not in json.dumps([w.body for w in double.writes])
    assert secret not in json.dumps(agent.status())
    assert "pid 4242 (python3)" in json.dumps([w.body for w in double.writes]), "the redacted message is there"
