"""The Grafana dashboard and the Prometheus alert rules, checked with the real tools.

- promtool: `check rules` on the rules file and on the PrometheusRule's groups, `test rules` on
  deploy/prometheus/tests.yaml (a firing and a not-firing case for every alert), `check metrics` on the
  agent's real /metrics.
- A real Prometheus (Debian package) on 127.0.0.1 scrapes a running agent on a fake accelerator node
  (tests/support/fake_node.py) every second and evaluates the rules: every query of the dashboard, its template
  variables substituted, must parse and return data; every rule must evaluate without error; a fatal PCIe
  AER error the kernel counts on the fake node must end up as a firing alert.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fake_node import FakeNode, free_port
from support.system import REPO, require_fixtures, require_root, require_tool

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "node-health-rules.yaml"
PROMETHEUS_RULE = PROMETHEUS_DIR / "prometheusrule.yaml"
UNIT_TESTS = PROMETHEUS_DIR / "tests.yaml"
PODMONITOR = PROMETHEUS_DIR / "podmonitor.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "node-health.json"

CLUSTER = "e2e"
# Lint findings that node-problem-detector's metric names cause: dashboards built for NPD query exactly
# these names (DESIGN.md, core metrics), so they stay. Every other finding fails the test.
NPD_COMPAT_LINT = {
    "problem_counter metric name should not include type 'counter'",
    "problem_gauge metric name should not include type 'gauge'",
}


def promtool(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    binary = require_tool("promtool")
    return subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def alerts_of(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def rules_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES.read_text())["groups"])


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target))
    return out


# --- alert rules -------------------------------------------------------------------------------------


def test_rules_file_and_prometheusrule_pass_promtool_check(tmp_path: Path) -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    document = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert document["apiVersion"] == "monitoring.coreos.com/v1"
    assert document["kind"] == "PrometheusRule"
    spec_only = tmp_path / "prometheusrule-groups.yaml"
    spec_only.write_text(yaml.safe_dump({"groups": document["spec"]["groups"]}))
    result = promtool("check", "rules", str(spec_only))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts_of(rules_groups()))} rules found" in result.stdout


def test_prometheusrule_holds_exactly_the_rules_file_groups() -> None:
    document = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert document["spec"]["groups"] == rules_groups()
    check = subprocess.run(
        [sys.executable, str(PROMETHEUS_DIR / "render.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stderr


def test_every_alert_names_severity_summary_description_hint_and_runbook() -> None:
    alerts = alerts_of(rules_groups())
    names = [rule["alert"] for rule in alerts]
    assert len(names) == len(set(names)), "alert names must be unique"
    readme_anchors = {
        "#" + re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in (REPO / "README.md").read_text().splitlines()
        if line.startswith("## ")
    }
    for rule in alerts:
        assert rule["alert"].startswith("NodeHealth"), rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        annotations = rule["annotations"]
        for key in ("summary", "description", "hint", "runbook_url"):
            assert annotations.get(key, "").strip(), f"{rule['alert']}: no {key}"
        page, _, anchor = annotations["runbook_url"].partition("#")
        assert page == "README.md" and "#" + anchor in readme_anchors, f"{rule['alert']}: {annotations['runbook_url']}"


def test_the_required_alerts_exist() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in alerts_of(rules_groups())}
    assert "nodehealth_ready == 0" in exprs["NodeHealthNodeNotReady"]
    assert "NpuHeldOutOfBand" in exprs["NodeHealthNpuHeldOutOfBand"]
    assert "GpuHeldOutOfBand" in exprs["NodeHealthGpuHeldOutOfBand"]
    assert "PcieFatalErrors" in exprs["NodeHealthPcieFatalErrors"]
    assert "ClockSkew" in exprs["NodeHealthClockSkew"]
    assert "StaleFileBaton" in exprs["NodeHealthStaleLocks"]
    assert 'result="timeout"' in exprs["NodeHealthProbeTimeouts"]
    assert 'up{job="node-health"} == 0' in exprs["NodeHealthAgentDown"]
    assert "absent(" in exprs["NodeHealthAgentAbsent"]
    assert "MountHung" in exprs["NodeHealthMountHung"]
    assert "DnsFailed" in exprs["NodeHealthDnsFailing"]
    assert "GpuEccUncorrectable" in exprs["NodeHealthGpuEccUncorrectable"]
    not_ready = next(r for r in alerts_of(rules_groups()) if r["alert"] == "NodeHealthNodeNotReady")
    assert not_ready["for"] == "10m"


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(UNIT_TESTS), cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_not_firing_unit_test() -> None:
    cases = [case for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in group["alert_rule_test"]]
    firing = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    alerts = {rule["alert"] for rule in alerts_of(rules_groups())}
    assert alerts - firing == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a not-firing test"
    assert (firing | quiet) - alerts == set(), "tests of alerts that do not exist"


def test_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests can fail: with one alert's reason misspelt and another's `for` dropped, they do."""
    groups = copy.deepcopy(rules_groups())
    for rule in alerts_of(groups):
        if rule["alert"] == "NodeHealthNpuHeldOutOfBand":
            rule["expr"] = rule["expr"].replace("NpuHeldOutOfBand", "NpuHeldOutOfBnad")
        if rule["alert"] == "NodeHealthNodeNotReady":
            del rule["for"]
    (tmp_path / "node-health-rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yaml").write_text(UNIT_TESTS.read_text())
    result = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "alertname: NodeHealthNpuHeldOutOfBand" in output
    assert "alertname: NodeHealthNodeNotReady" in output


def test_podmonitor_adds_the_node_label_the_rules_and_dashboard_use() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    assert monitor["kind"] == "PodMonitor"
    relabelings = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in relabelings
    assert {"targetLabel": "job", "replacement": "node-health"} in relabelings


def test_documented_scrape_config_passes_promtool_and_adds_the_same_labels(tmp_path: Path) -> None:
    """The README's scrape config for Prometheus without the Operator: valid, same labels."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```yaml\n(# prometheus.yml\n.*?)```", text, re.S)
    assert block, "README.md lost its prometheus.yml example"
    config = yaml.safe_load(block.group(1))
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    # Debian's prometheus is built without Kubernetes service discovery: check the rest with a static target.
    job_checked = {k: v for k, v in job.items() if k != "kubernetes_sd_configs"}
    job_checked["static_configs"] = [{"targets": ["127.0.0.1:9100"]}]
    config["scrape_configs"] = [job_checked]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "node-health-rules.yaml").write_text(RULES.read_text())
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert job["job_name"] == "node-health"
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"node", "namespace", "pod"} <= targets
    assert {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"} in job["relabel_configs"]


# --- dashboard, statically -------------------------------------------------------------------------------


def test_dashboard_variables_and_datasources() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(nodehealth_ready, cluster)" in variables["cluster"]["definition"]
    assert variables["node"]["definition"] == 'label_values(nodehealth_ready{cluster=~"$cluster"}, node)'
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for title, target in dashboard_targets():
        assert target["datasource"]["uid"] == "${datasource}", title
        assert 'cluster=~"$cluster"' in target["expr"], f"{title}: every query selects the cluster"


def test_dashboard_has_the_required_views() -> None:
    titles = {panel["title"] for panel in dashboard()["panels"]}
    for title in (
        "Ready nodes over time",
        "Active problems by reason",
        "Check states per node",
        "NPU free HBM per chip",
        "NPU processes held out of band",
        "GPU processes held out of band",
        "PCIe AER errors (new)",
        "Mount latency",
        "Free space",
        "DNS lookup latency",
        "Egress latency",
        "Clock offset from NTP servers",
    ):
        assert title in titles


# --- a real Prometheus scraping an agent on a fake accelerator node ------------------------------------------


class Prometheus:
    def __init__(self, workdir: Path, scrape_target: str, node: str) -> None:
        binary = require_tool("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "node-health",
                    # What the PodMonitor's relabeling gives in a cluster: `node` from the pod's node name;
                    # `cluster` as a Thanos/Mimir querier presents it.
                    "static_configs": [{"targets": [scrape_target], "labels": {"node": node, "cluster": CLUSTER}}],
                }
            ],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = workdir / "prometheus.log"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout:g}s: {self.log_path.read_text()[-2000:]}")

    def api(self, path: str, **params: str) -> dict[str, Any]:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return dict(json.loads(response.read()))
        except urllib.error.HTTPError as exc:  # 400 with the parse error in the body
            return dict(json.loads(exc.read()))

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeNode, Prometheus]]:
    require_root()  # mknod of the fake device nodes
    require_tool("prometheus")
    fixtures = require_fixtures()
    workdir = tmp_path_factory.mktemp("observability")
    (workdir / "node").mkdir()
    with FakeNode(workdir / "node", fixtures) as node:
        prometheus = Prometheus(workdir, node.address, node.node_name)
        try:
            prometheus.wait_ready()
            yield node, prometheus
        finally:
            prometheus.close()


def substitute(expr: str, node: str) -> str:
    """Grafana's substitution for one selected cluster and node; $__rate_interval as for a 1 s scrape."""
    return (
        expr.replace("$cluster", CLUSTER)
        .replace("$node", node)  # node names are DNS labels: nothing to escape but ".", harmless in a regex
        .replace("$__rate_interval", "15s")
        .replace("$__interval", "1s")
    )


def without_fallback(expr: str) -> str:
    """`... or vector(0)` always returns data: the part before it must return data on its own."""
    return re.sub(r"\s+or\s+vector\(0\)\s*$", "", expr)


def test_agent_metrics_pass_promtool_lint(live: tuple[FakeNode, Prometheus]) -> None:
    node, _ = live
    text = node.metrics_text()
    assert "nodehealth_ready" in text
    result = promtool("check", "metrics", stdin=text)
    problems = {line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()}
    assert problems - NPD_COMPAT_LINT == set()


def test_every_dashboard_query_parses_and_returns_data(live: tuple[FakeNode, Prometheus]) -> None:
    node, prometheus = live
    queries = []
    for title, target in dashboard_targets():
        expr = substitute(target["expr"], node.node_name)
        queries.append((title, expr))
        if without_fallback(expr) != expr:
            queries.append((title, without_fallback(expr)))
    assert len(queries) >= 40

    failures: dict[str, str] = {}
    deadline = time.monotonic() + 45
    while True:
        failures = {}
        for title, expr in queries:
            answer = prometheus.query(expr)
            if answer.get("status") != "success":
                failures[f"{title}: {expr}"] = f"does not parse: {answer.get('error')}"
            elif not answer["data"]["result"]:
                failures[f"{title}: {expr}"] = "no data"
        parse_errors = {k: v for k, v in failures.items() if v != "no data"}
        assert parse_errors == {}
        if not failures or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert failures == {}, f"agent status: {json.dumps(node.status()['findings'])[:3000]}"


def test_dashboard_variables_list_the_cluster_and_node(live: tuple[FakeNode, Prometheus]) -> None:
    node, prometheus = live
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    for name, expected in (("cluster", CLUSTER), ("node", node.node_name)):
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["definition"])
        assert match, variables[name]["definition"]
        selector, label = substitute(match.group(1), node.node_name), match.group(2)
        deadline = time.monotonic() + 20
        while True:
            answer = prometheus.api(f"label/{label}/values", **{"match[]": selector})
            assert answer["status"] == "success", answer
            if expected in answer["data"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert answer["data"] == [expected]


def alerts_now(prometheus: Prometheus) -> list[dict[str, Any]]:
    answer = prometheus.api("alerts")
    assert answer["status"] == "success"
    return list(answer["data"]["alerts"])


def test_rules_evaluate_in_prometheus_and_a_fatal_aer_error_fires(live: tuple[FakeNode, Prometheus]) -> None:
    node, prometheus = live
    answer = prometheus.api("rules")
    assert answer["status"] == "success"
    loaded = [rule for group in answer["data"]["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in loaded} == {rule["alert"] for rule in alerts_of(rules_groups())}

    # The fake node has a davinci0 holder outside any pod: the 2-minute alert is pending, not firing yet.
    deadline = time.monotonic() + 30
    held: list[dict[str, Any]] = []
    while not held and time.monotonic() < deadline:
        held = [a for a in alerts_now(prometheus) if a["labels"]["alertname"] == "NodeHealthNpuHeldOutOfBand"]
        time.sleep(0.5)
    assert held, alerts_now(prometheus)
    assert held[0]["state"] == "pending"
    assert held[0]["labels"]["node"] == node.node_name
    assert held[0]["labels"]["subject"] == "npu0"
    assert "outside Kubernetes" in held[0]["annotations"]["summary"]

    assert not [a for a in alerts_now(prometheus) if a["labels"]["alertname"] == "NodeHealthPcieFatalErrors"]
    # The pcie probe's first run is its baseline: raise the counter only after Prometheus saw a run.
    deadline = time.monotonic() + 20
    while not prometheus.query('nodehealth_pcie_aer_errors_total{severity="fatal"}')["data"]["result"]:
        assert time.monotonic() < deadline, "no pcie samples scraped"
        time.sleep(0.5)
    node.raise_fatal_aer()
    deadline = time.monotonic() + 30
    fired: list[dict[str, Any]] = []
    while not fired and time.monotonic() < deadline:
        fired = [
            a
            for a in alerts_now(prometheus)
            if a["labels"]["alertname"] == "NodeHealthPcieFatalErrors" and a["state"] == "firing"
        ]
        time.sleep(0.5)
    assert fired, alerts_now(prometheus)
    alert = fired[0]
    assert alert["labels"]["node"] == node.node_name
    assert alert["labels"]["subject"] == "0000:01:00.0"
    assert alert["labels"]["severity"] == "critical"
    assert "lspci -vvv -s 0000:01:00.0" in alert["annotations"]["hint"]

    # Every rule evaluated against the live data without an error.
    answer = prometheus.api("rules")
    for group in answer["data"]["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
