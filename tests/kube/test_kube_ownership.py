"""Property: whatever other controllers put on the Node, and however they race the agent, the agent changes
only the taints, label and conditions it owns."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kube_double import ApiDouble, running_double
from support.kube_helpers import Clock, conditions, foreign_taints, health_state, labels, make_agent, our_taints, record

PROBES = {"storage": ("storage.mounts",), "npu": ("npu.health",)}
OURS = {
    "StorageHealthy",
    "NPUHealthy",
    "GPUHealthy",
    "NetworkHealthy",
    "InterconnectHealthy",
    "ClockSynced",
    "HostHealthy",
}
_names = itertools.count()

label_keys = st.sampled_from(["team", "example.com/pool", "topology.kubernetes.io/zone", "node-healthy", "a.b/c"])
label_values = st.sampled_from(["", "x", "ml-1", "A.b_c"])
foreign_taint = st.builds(
    lambda key, value, effect: {"key": key, "value": value, "effect": effect},
    st.sampled_from(["nvidia.com/gpu", "node.kubernetes.io/unschedulable", "huawei.com/Ascend910", "dedicated"]),
    st.sampled_from(["", "true", "infer"]),
    st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
)
foreign_condition = st.builds(
    lambda kind, status: {"type": kind, "status": status, "reason": "Other", "message": "not ours"},
    st.sampled_from(["Ready", "MemoryPressure", "KernelDeadlock", "FrequentKubeletRestart"]),
    st.sampled_from(["True", "False", "Unknown"]),
)


def unique(items: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    seen, out = set(), []
    for item in items:
        ident = tuple(item[k] for k in keys)
        if ident not in seen:
            seen.add(ident)
            out.append(item)
    return out


step = st.fixed_dictionaries(
    {
        "storage": st.sampled_from(["ok", "fail", "warn"]),
        "npu": st.sampled_from(["ok", "fail"]),
        # A foreign writer edits the Node between the agent's read and its write (the agent gets a 409).
        "race": st.none() | st.tuples(label_keys, label_values, foreign_taint, foreign_condition),
    }
)


@pytest.fixture(scope="module")
def double() -> Iterator[ApiDouble]:
    with running_double() as api:
        yield api


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial_labels=st.dictionaries(label_keys, label_values, max_size=4),
    initial_taints=st.lists(foreign_taint, max_size=4),
    initial_conditions=st.lists(foreign_condition, max_size=3),
    steps=st.lists(step, min_size=1, max_size=5),
)
@pytest.mark.system
def test_foreign_state_survives_every_operation(
    double: ApiDouble,
    initial_labels: dict[str, str],
    initial_taints: list[dict[str, Any]],
    initial_conditions: list[dict[str, Any]],
    steps: list[dict[str, Any]],
) -> None:
    name = f"prop-{next(_names)}"
    taints = unique(initial_taints, "key", "effect")
    foreign_conditions = unique(initial_conditions, "type")
    double.add_node(name, labels=initial_labels, taints=taints, conditions=foreign_conditions)
    expected: dict[str, Any] = {
        "labels": dict(initial_labels),
        "taints": [dict(t) for t in taints],
        "conditions": {c["type"]: c for c in foreign_conditions},
    }
    clock = Clock()
    state = health_state(name, clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="1000", warn_effect="PreferNoSchedule")
    try:
        for item in steps:
            clock.advance(30)
            record(state, "storage", "storage.mounts", item["storage"], "DiskLow" if item["storage"] == "warn" else "")
            record(state, "npu", "npu.health", item["npu"])
            race = item["race"]
            if race is not None:
                double.before_write = _racer(double, name, race, expected)
            try:
                agent.reconcile_once()
            finally:
                double.before_write = None
            assert agent.status()["errors"].keys() <= {"conflict"}
            node = double.node(name)
            foreign_labels = {k: v for k, v in labels(node).items() if not k.startswith("node-health/")}
            assert foreign_labels == expected["labels"]
            assert foreign_taints(node) == expected["taints"]
            assert {t: c for t, c in conditions(node).items() if t not in OURS} == expected["conditions"]
            wanted = {}
            if item["storage"] != "ok":
                wanted["storage"] = (
                    ("Broken", "NoSchedule") if item["storage"] == "fail" else ("DiskLow", "PreferNoSchedule")
                )
            if item["npu"] == "fail":
                wanted["npu"] = ("Broken", "NoSchedule")
            assert our_taints(node) == wanted
            blocking = any(effect == "NoSchedule" for _, effect in wanted.values())
            assert labels(node).get("node-health/tainted") == ("true" if blocking else None)
            assert labels(node)["node-health/ready"] == (
                "false" if "fail" in (item["storage"], item["npu"]) else "true"
            )
            ours = {t: c["status"] for t, c in conditions(node).items() if t in OURS}
            assert ours == {
                "StorageHealthy": "False" if item["storage"] == "fail" else "True",
                "NPUHealthy": "False" if item["npu"] == "fail" else "True",
            }
    finally:
        agent.stop()


def _racer(
    double: ApiDouble, name: str, race: tuple[str, str, dict[str, Any], dict[str, Any]], expected: dict[str, Any]
):  # type: ignore[no-untyped-def]
    label_key, label_value, taint, condition = race
    fired = [False]

    def before_write(method: str, path: str) -> None:
        if fired[0] or not path.startswith(f"/api/v1/nodes/{name}"):
            return
        fired[0] = True

        def change(node: dict[str, Any]) -> None:
            node["metadata"].setdefault("labels", {})[label_key] = label_value
            taints = [
                t
                for t in (node.get("spec") or {}).get("taints") or []
                if (t["key"], t["effect"]) != (taint["key"], taint["effect"])
            ]
            node.setdefault("spec", {})["taints"] = [*taints, dict(taint)]
            others = [c for c in node.get("status", {}).get("conditions", []) if c["type"] != condition["type"]]
            node.setdefault("status", {})["conditions"] = [*others, dict(condition)]

        double.mutate("nodes", "", name, change)
        expected["labels"][label_key] = label_value
        expected["taints"] = [
            t for t in expected["taints"] if (t["key"], t["effect"]) != (taint["key"], taint["effect"])
        ] + [dict(taint)]
        expected["conditions"][condition["type"]] = dict(condition)

    return before_write


@pytest.mark.system
def test_concurrent_foreign_writer_causes_conflicts_that_lose_nothing(double: ApiDouble) -> None:
    """A real concurrent writer (another controller's loop) against the agent flipping a taint."""
    name = f"race-{next(_names)}"
    double.add_node(name)
    clock = Clock()
    state = health_state(name, clock, PROBES)
    agent = make_agent(double, state, clock, max_unhealthy="1000", conflict_retries=50)
    stop = threading.Event()
    written: list[int] = []

    def foreign_controller() -> None:
        i = 0
        while not stop.is_set():
            i += 1

            def change(node: dict[str, Any], i: int = i) -> None:
                node["metadata"].setdefault("labels", {})[f"example.com/seq-{i % 7}"] = str(i)
                taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t["key"] != "example.com/seq"]
                node.setdefault("spec", {})["taints"] = [
                    *taints,
                    {"key": "example.com/seq", "value": str(i), "effect": "NoSchedule"},
                ]

            double.mutate("nodes", "", name, change)
            written.append(i)
            time.sleep(0.02)  # a busy controller; one writing every millisecond would starve any client

    # Every other write by the agent is preceded by a foreign write: each change conflicts at least once.
    patches = itertools.count()

    def interpose(method: str, path: str) -> None:
        if path == f"/api/v1/nodes/{name}" and next(patches) % 2 == 0:
            double.mutate("nodes", "", name, lambda n: n["metadata"].setdefault("labels", {}).update(last="x"))

    double.before_write = interpose
    writer = threading.Thread(target=foreign_controller, daemon=True)
    writer.start()
    try:
        for flip in range(6):
            clock.advance(30)
            record(state, "storage", "storage.mounts", "fail" if flip % 2 == 0 else "ok")
            record(state, "npu", "npu.health", "ok")
            agent.reconcile_once()
            assert our_taints(double.node(name)) == ({"storage": ("Broken", "NoSchedule")} if flip % 2 == 0 else {})
    finally:
        stop.set()
        writer.join(5)
        double.before_write = None
    node = double.node(name)
    last = written[-1]
    assert labels(node)[f"example.com/seq-{last % 7}"] == str(last)
    assert labels(node)["last"] == "x"
    assert [t for t in foreign_taints(node) if t["key"] == "example.com/seq"] == [
        {"key": "example.com/seq", "value": str(last), "effect": "NoSchedule"}
    ]
    assert agent.status()["errors"].get("conflict", 0) >= 6
    agent.stop()
