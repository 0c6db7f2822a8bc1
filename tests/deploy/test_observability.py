"""The Grafana dashboard and the Prometheus alert rules, checked with the real tools.

- promtool: `check rules` on the rules file and on the PrometheusRule's groups, `test rules` on
  deploy/prometheus/tests.yaml (a firing and a not-firing case for every alert), `check metrics` on the
  agent's real /metrics.
- A real Prometheus (Debian package) on 127.0.0.1 scrapes a running agent on a fake accelerator node
  (tests/support/fake_node.py) every second and evaluates the rules, next to stand-ins for node-problem-detector,
  npu-exporter and dcgm-exporter that serve their metric names for the same node: every query of the dashboard,
  its template variables substituted, must parse and return data, and its job variable must keep
  node-problem-detector's series out; the join queries of docs/observability.md return data; every core metric
  the page lists is exported and every agent-level metric exported is listed; every rule must evaluate without
  error; a fatal PCIe AER error the kernel counts on the fake node must end up as a firing alert.
The runbook links and the page's tables against the rules: tests/deploy/test_observability_docs.py.
"""

from __future__ import annotations

import copy
import http.server
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.fake_node import FakeNode
from support.processes import free_port
from support.system import REPO, require_fixtures, require_root, require_tool

from agent.version import __version__

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "node-health-rules.yaml"
PROMETHEUS_RULE = PROMETHEUS_DIR / "prometheusrule.yaml"
UNIT_TESTS = PROMETHEUS_DIR / "tests.yaml"
PODMONITOR = PROMETHEUS_DIR / "podmonitor.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "node-health.json"
# The project's repository (pyproject.toml, [project.urls] Source): where the rendered runbook links point.
SOURCE = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]["Source"]

CLUSTER = "e2e"
JOB = "node-health"
AGENT_POD = {"namespace": "node-health", "pod": "node-health-x7k2p", "container": "agent"}
OBSERVABILITY_DOC = REPO / "docs" / "observability.md"
# Metric names other exporters use too: node-problem-detector's, and every scrape job's `up`.
SHARED_NAMES = re.compile(r"\b(problem_gauge|problem_counter|up)\{")
NPD_REASON = "DockerHung"  # a reason only the node-problem-detector stand-in reports
# Metric name prefixes of the probe families (documented on docs/probes/*.md); every other metric is the agent's.
FAMILY_PREFIXES = ("nodehealth_host_", "nodehealth_npu_", "nodehealth_pcie_", "nodehealth_gpu_")
FAMILY_PREFIXES += ("nodehealth_storage_", "nodehealth_network_", "nodehealth_time_", "nodehealth_kernel_log_")
FAMILY_PREFIXES += ("nodehealth_interconnect_",)
# Lint findings that node-problem-detector's metric names cause: dashboards built for NPD query exactly
# these names (docs/observability.md, core metrics), so they stay. Every other finding fails the test.
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


@pytest.mark.system
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
    """The same groups, with each runbook link absolute: this release's docs (render.py's default base)."""
    document = yaml.safe_load(PROMETHEUS_RULE.read_text())
    base = f"{SOURCE}/blob/v{__version__}/"
    groups = copy.deepcopy(document["spec"]["groups"])
    for rule in alerts_of(groups):
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(base), url
        rule["annotations"]["runbook_url"] = url[len(base) :]
    assert groups == rules_groups()
    check = subprocess.run(
        [sys.executable, str(PROMETHEUS_DIR / "render.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stderr


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
    assert exprs["NodeHealthConfigUnknownKeys"] == "nodehealth_config_unknown_keys > 0"
    # issue 29: the fleet alert for interconnect problems (HCA ports, NVLink, fabric, the collective's interface)
    for check in ("interconnect", "gpu\\\\.nvlink", "gpu\\\\.fabric", "network\\\\.collective"):
        assert check in exprs["NodeHealthInterconnectProblems"], check
    for reason in ("Mlx5ModuleError", "Mlx5CableUnplugged", "Mlx5LinkDown", "Mlx5InsufficientPower"):  # the mlx5 rules
        assert reason in exprs["NodeHealthInterconnectProblems"], reason
    not_ready = next(r for r in alerts_of(rules_groups()) if r["alert"] == "NodeHealthNodeNotReady")
    assert not_ready["for"] == "10m"


@pytest.mark.system
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


@pytest.mark.system
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
    # Device series' pod, namespace and container (the allocated pod's) must not become exported_pod etc.
    assert monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    # kube-prometheus-stack's default podMonitorSelector and ruleSelector (docs/observability.md, Install).
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert yaml.safe_load(PROMETHEUS_RULE.read_text())["metadata"]["labels"]["release"] == "prometheus"


# --- dashboard, statically -------------------------------------------------------------------------------


def test_dashboard_variables_and_datasources() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(nodehealth_ready, cluster)" in variables["cluster"]["definition"]
    assert variables["node"]["definition"] == 'label_values(nodehealth_ready{cluster=~"$cluster"}, node)'
    assert variables["job"]["definition"] == 'label_values(nodehealth_ready{cluster=~"$cluster"}, job)'
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    for title, target in dashboard_targets():
        assert target["datasource"]["uid"] == "${datasource}", title
        assert 'cluster=~"$cluster"' in target["expr"], f"{title}: every query selects the cluster"
    shared_names = [
        (title, target["expr"]) for title, target in dashboard_targets() if SHARED_NAMES.search(target["expr"])
    ]
    assert shared_names, "the dashboard lost its node-problem-detector and up queries"
    for title, expr in shared_names:
        for selector in re.findall(r"\b(?:problem_gauge|problem_counter|up)\{([^}]*)\}", expr):
            assert 'job=~"$job"' in selector, f"{title}: {expr} must select the job"


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
        "Isolated devices, fleet-wide",
        "Isolated devices per node",
    ):
        assert title in titles


# --- a real Prometheus scraping an agent on a fake accelerator node ------------------------------------------


class StandInExporters:
    """node-problem-detector, npu-exporter and dcgm-exporter as Prometheus sees them: their metric names and labels
    for the fake node's devices (read from the agent's own series), one path each, on 127.0.0.1."""

    def __init__(self, agent_metrics: str, node: str) -> None:
        families = {family.name: family for family in text_string_to_metric_families(agent_metrics)}
        chips = (
            [s.labels for s in families["nodehealth_npu_health"].samples] if "nodehealth_npu_health" in families else []
        )
        gpu_memory = families.get("nodehealth_gpu_memory_used_bytes")
        gpus = [(s.labels, s.value) for s in gpu_memory.samples] if gpu_memory else []
        # npu-exporter's card labels (id: the physical id; namespace, pod_name, container_name of the chip's pod),
        # dcgm-exporter's (gpu, UUID, pci_bus_id, device, modelName, Hostname; pod, namespace, container).
        npu_lines = [
            f'npu_chip_info_process_info_num{{container_name="{c["container"]}",id="{c["id"]}",'
            f'model_name="{c["name"]}",namespace="{c["namespace"]}",pcie_bus_info="{c.get("pci_bus_id", "")}",'
            f'pod_name="{c["pod"]}",vdie_id=""}} 1'
            for c in chips
        ]
        dcgm_lines = [
            f'DCGM_FI_DEV_FB_USED{{gpu="{g["gpu"]}",UUID="{g["UUID"]}",pci_bus_id="{g["pci_bus_id"]}",'
            f'device="nvidia{g["gpu"]}",modelName="{g["name"]}",Hostname="{node}",container="{g["container"]}",'
            f'namespace="{g["namespace"]}",pod="{g["pod"]}"}} {used / 2**20:.0f}'
            for g, used in gpus
        ]
        self.bodies = {
            "/npd": "# TYPE problem_counter counter\n"
            f'problem_counter{{reason="{NPD_REASON}"}} 3\n'
            "# TYPE problem_gauge gauge\n"
            f'problem_gauge{{reason="{NPD_REASON}",type="KernelDeadlock"}} 1\n',
            "/npu-exporter": "# TYPE npu_chip_info_process_info_num gauge\n" + "".join(f"{x}\n" for x in npu_lines),
            "/dcgm-exporter": "# TYPE DCGM_FI_DEV_FB_USED gauge\n" + "".join(f"{x}\n" for x in dcgm_lines),
        }
        bodies = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = bodies.get(self.path, "").encode()
                self.send_response(200 if self.path in bodies else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def jobs(self, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [
            {"job_name": name, "metrics_path": path, "static_configs": [{"targets": [self.address], "labels": labels}]}
            for name, path in (
                ("node-problem-detector", "/npd"),
                ("npu-exporter", "/npu-exporter"),
                ("dcgm-exporter", "/dcgm-exporter"),
            )
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Prometheus:
    def __init__(self, workdir: Path, scrape_target: str, node: str, others: list[dict[str, Any]]) -> None:
        binary = require_tool("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    # What the PodMonitor gives in a cluster: `node` from the pod's node name, the agent pod's
                    # namespace, pod and container, honorLabels; `cluster` as a Thanos/Mimir querier presents it.
                    "honor_labels": True,
                    "static_configs": [
                        {"targets": [scrape_target], "labels": {"node": node, "cluster": CLUSTER, **AGENT_POD}}
                    ],
                },
                *others,
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
        stand_ins = StandInExporters(node.metrics_text(), node.node_name)
        others = stand_ins.jobs({"node": node.node_name, "cluster": CLUSTER})
        # The metrics port, as the PodMonitor scrapes it (port `metrics`, http.metrics_port).
        prometheus = Prometheus(workdir, f"127.0.0.1:{node.metrics_port}", node.node_name, others)
        try:
            prometheus.wait_ready()
            yield node, prometheus
        finally:
            prometheus.close()
            stand_ins.close()


def substitute(expr: str, node: str) -> str:
    """Grafana's substitution for one selected cluster, job and node; $__rate_interval as for a 1 s scrape."""
    return (
        expr.replace("$cluster", CLUSTER)
        .replace("$job", JOB)
        .replace("$node", node)  # node names are DNS labels: nothing to escape but ".", harmless in a regex
        .replace("$__rate_interval", "15s")
        .replace("$__interval", "1s")
    )


def without_fallback(expr: str) -> str:
    """`... or vector(0)` always returns data: the part before it must return data on its own."""
    return re.sub(r"\s+or\s+vector\(0\)\s*$", "", expr)


@pytest.mark.system
def test_agent_metrics_pass_promtool_lint(live: tuple[FakeNode, Prometheus]) -> None:
    node, _ = live
    text = node.metrics_text()
    assert "nodehealth_ready" in text
    result = promtool("check", "metrics", stdin=text)
    problems = {line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()}
    assert problems - NPD_COMPAT_LINT == set()


@pytest.mark.system
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


@pytest.mark.system
def test_dashboard_variables_list_the_cluster_job_and_node(live: tuple[FakeNode, Prometheus]) -> None:
    node, prometheus = live
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    for name, expected in (("cluster", CLUSTER), ("job", JOB), ("node", node.node_name)):
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


@pytest.mark.system
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
    # One node: a warning (a ticket); the fleet alert is the one that pages, and one node of one is 5% of this
    # one-node cluster, so it is pending for its 10 minutes.
    assert alert["labels"]["severity"] == "warning"
    assert "lspci -vvv -s 0000:01:00.0" in alert["annotations"]["hint"]
    fleet = [a for a in alerts_now(prometheus) if a["labels"]["alertname"] == "NodeHealthFleetProblem"]
    assert {(a["labels"]["reason"], a["state"]) for a in fleet} >= {("PcieFatalErrors", "pending")}, fleet

    # Every rule evaluated against the live data without an error.
    answer = prometheus.api("rules")
    for group in answer["data"]["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def wait_for_data(prometheus: Prometheus, expr: str, seconds: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + seconds
    while True:
        answer = prometheus.query(expr)
        assert answer.get("status") == "success", f"{expr}: {answer.get('error')}"
        if answer["data"]["result"] or time.monotonic() > deadline:
            return list(answer["data"]["result"])
        time.sleep(0.5)


@pytest.mark.system
def test_job_variable_keeps_node_problem_detectors_series_out(live: tuple[FakeNode, Prometheus]) -> None:
    node, prometheus = live
    shared = [
        (title, t["expr"]) for title, t in dashboard_targets() if re.search(r"\bproblem_(gauge|counter)\{", t["expr"])
    ]
    assert shared
    for title, expr in shared:
        ours = wait_for_data(prometheus, substitute(expr, node.node_name))
        assert ours, f"{title}: no data"
        assert NPD_REASON not in {series["metric"].get("reason") for series in ours}, title
        # Without the job matcher the stand-in's series are counted: the matcher is what keeps them out.
        unfiltered = substitute(expr.replace('job=~"$job", ', ""), node.node_name)
        deadline = time.monotonic() + 30
        reasons: set[str | None] = set()
        while NPD_REASON not in reasons and time.monotonic() < deadline:
            reasons = {series["metric"].get("reason") for series in wait_for_data(prometheus, unfiltered)}
            time.sleep(0.5)
        assert NPD_REASON in reasons, f"{title}: the node-problem-detector stand-in was not scraped"


@pytest.mark.system
def test_documented_join_queries_return_data(live: tuple[FakeNode, Prometheus]) -> None:
    """The joins of docs/observability.md, on series shaped like npu-exporter's and dcgm-exporter's, without
    label_replace: npu-exporter's chips on `id`, dcgm-exporter's GPUs on `UUID`, PCIe series on `pci_bus_id`."""
    _, prometheus = live
    text = OBSERVABILITY_DOC.read_text()
    queries = re.findall(r"```promql\n(.*?)```", text, re.S)
    assert len(queries) == 4, "docs/observability.md lost its join examples"
    assert not [q for q in queries if "label_replace" in q]
    results = [wait_for_data(prometheus, expr) for expr in queries]
    for expr, result in zip(queries, results, strict=True):
        assert result, f"no data: {expr} (the agent's device series must carry id / UUID / pci_bus_id)"
    held, npu_pods, gpu_pods, pcie = results
    # The fake node's davinci0 is held outside Kubernetes: npu-exporter's chip with id 0.
    assert [s["metric"]["id"] for s in held] == ["0"]
    # npu-exporter's chip 1 gets the pod the device plugin's ledger allocated it to (tests/support/fake_node.py).
    allocated = {s["metric"]["id"]: s["metric"].get("pod") for s in npu_pods}
    assert allocated["1"] == "train-0" and allocated["0"] is None and len(allocated) == 8
    assert {s["metric"].get("pod") for s in gpu_pods} == {"infer-0", None} and len(gpu_pods) == 8
    assert {(s["metric"]["pci_bus_id"], s["metric"]["chip"]) for s in pcie} == {("0000:01:00.0", "1")}, pcie


@pytest.mark.system
def test_device_series_carry_the_allocated_pod_beside_the_agents_own(live: tuple[FakeNode, Prometheus]) -> None:
    """As the PodMonitor scrapes (honorLabels, the agent pod's labels on the target): a device series names the pod
    its device is allocated to; a free device's names no pod (not the agent's); every other series the agent's."""
    _, prometheus = live
    allocated = wait_for_data(prometheus, 'nodehealth_device_allocated{chip="1"}')
    assert [(s["metric"]["pod"], s["metric"]["namespace"], s["metric"]["container"]) for s in allocated] == [
        ("train-0", "team-a", "worker")
    ]
    assert allocated[0]["metric"]["resource"] == "huawei.com/Ascend910" and allocated[0]["value"][1] == "1"
    free = wait_for_data(prometheus, 'nodehealth_device_allocated{chip="0"}')
    assert free and "pod" not in free[0]["metric"] and free[0]["value"][1] == "0", free
    gpu = wait_for_data(prometheus, 'nodehealth_gpu_memory_used_bytes{gpu="0"}')
    assert gpu[0]["metric"]["pod"] == "infer-0" and gpu[0]["metric"]["UUID"].startswith("GPU-")
    ready = wait_for_data(prometheus, "nodehealth_ready")
    assert {k: ready[0]["metric"][k] for k in AGENT_POD} == AGENT_POD
    assert "exported_pod" not in json.dumps(wait_for_data(prometheus, '{__name__=~"nodehealth_.*", pod="train-0"}'))


def sample_names(metrics_text: str) -> set[str]:
    names = set()
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return {name.removesuffix("_created") for name in names}


@pytest.mark.system
def test_core_metrics_are_the_documented_ones(live: tuple[FakeNode, Prometheus]) -> None:
    node, _ = live
    text = OBSERVABILITY_DOC.read_text()
    section = text[text.index("### Core metrics") : text.index("### Per probe family")]
    documented = re.findall(r"^\| `([a-z_*]+)` \|", section, re.M)
    assert len(documented) >= 15
    exported = sample_names(node.metrics_text())
    agent_source = "\n".join(path.read_text() for path in sorted((REPO / "agent").rglob("*.py")))

    def listed(name: str) -> bool:
        return any(name == d or (d.endswith("*") and name.startswith(d[:-1])) for d in documented)

    for name in documented:
        stem = name.rstrip("*")
        seen = any(e == stem or e.startswith(stem) for e in exported)
        # A labelled counter has no series until its first event (an API error): then the agent's code names it.
        assert seen or (not name.endswith("*") and f'"{name.removesuffix("_total")}' in agent_source), name
    agent_level = {name for name in exported if not name.startswith(FAMILY_PREFIXES)}
    assert sorted(name for name in agent_level if not listed(name)) == []
