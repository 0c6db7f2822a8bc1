"""The alert rules against the docs they link to and the page that describes them (docs/observability.md).

- Every alert's runbook_url resolves to a heading: docs/troubleshooting.md (its generated reason sections, as
  agent/reference.py writes them) for every reason the alert can carry, or the alert's own section of
  docs/observability.md; every reason an alert's expression names is one a probe or the agent declares.
- `render.py --runbook-base URL` prints rules that promtool accepts, with every link absolute; without it the links
  go to this release's docs in the project's repository.
- The page's alert table, scrape config and family links say what the rules, promtool and the families say.
The live checks (metrics, dashboard, joins) are in tests/deploy/test_observability.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.system import REPO, require_tool

from agent.reasons import AGENT_REASONS
from agent.reference import generated_blocks, refresh
from agent.version import __version__
from probes import all_families, all_probes
from probes.base import COMMON_REASONS, Status

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "node-health-rules.yaml"
OBSERVABILITY = REPO / "docs" / "observability.md"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
REASON_TEMPLATE = "{{ $labels.reason | toLower }}"
BASE = "https://git.example.com/you/node-health/blob/main/"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    binary = require_tool("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            out.add(re.sub(r"[^a-z0-9 _-]", "", match.group(1).strip().lower()).replace(" ", "-"))
    return out


def troubleshooting_page() -> str:
    """docs/troubleshooting.md with its generated blocks as agent/reference.py writes them."""
    text, unknown = refresh(TROUBLESHOOTING.read_text(), generated_blocks())
    assert unknown == []
    return text


def declared_reasons() -> dict[str, set[str]]:
    """Reason code → the statuses it may carry, over every probe and the agent."""
    out: dict[str, set[str]] = {}
    for reason in (*AGENT_REASONS, *COMMON_REASONS, *(r for cls in all_probes().values() for r in cls.reasons)):
        out.setdefault(reason.code, set()).update(status.value for status in reason.statuses)
    return out


def reasons_of(rule: dict[str, Any]) -> set[str]:
    """Every reason the alert's series can carry: its reason matcher, else the problems its checks can report."""
    expr = rule["expr"]
    if "reason" in rule.get("labels", {}):
        return {rule["labels"]["reason"]}
    matcher = re.search(r'reason=(~?)"([^"]+)"', expr)
    if matcher:
        return set(matcher.group(2).split("|")) if matcher.group(1) else {matcher.group(2)}
    check = re.search(r'check="([^"]+)"', expr)
    assert check, f"{rule['alert']}: a reason link needs a reason or check matcher to know its reasons"
    problems = (Status.FAIL, Status.WARN)
    return {
        reason.code
        for cls in all_probes().values()
        if check.group(1) in cls.checks
        for reason in cls.reasons
        if any(status in problems for status in reason.statuses)
    }


def test_every_alert_names_severity_summary_description_hint_and_runbook() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in alerts():
        assert rule["alert"].startswith("NodeHealth"), rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        for key in ("summary", "description", "hint", "runbook_url"):
            assert rule["annotations"].get(key, "").strip(), f"{rule['alert']}: no {key}"


def test_every_reason_an_alert_names_is_declared() -> None:
    declared = declared_reasons()
    for rule in alerts():
        for reason in re.findall(r'reason=~?"([^"]+)"', rule["expr"]):
            for code in reason.split("|"):
                assert code in declared, f"{rule['alert']}: {code} is not a declared reason"
                assert declared[code] & {"fail", "warn"}, f"{rule['alert']}: {code} is never a problem"


def test_every_runbook_link_resolves_for_every_reason_the_alert_carries() -> None:
    pages = {
        "docs/troubleshooting.md": anchors(troubleshooting_page()),
        "docs/observability.md": anchors(OBSERVABILITY.read_text()),
    }
    for rule in alerts():
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page in pages, f"{rule['alert']}: {url}"
        if anchor == REASON_TEMPLATE:
            assert page == "docs/troubleshooting.md", rule["alert"]
            reasons = reasons_of(rule)
            assert reasons, f"{rule['alert']}: carries no declared reason"
            missing = sorted(code for code in reasons if code.lower() not in pages[page])
            assert missing == [], f"{rule['alert']}: no section in {page} for {missing}"
        else:
            assert anchor in pages[page], f"{rule['alert']}: {url}"
            if page == "docs/observability.md":
                assert anchor == rule["alert"].lower(), f"{rule['alert']}: links another alert's section"


@pytest.mark.system
def test_render_with_a_runbook_base_makes_every_link_absolute(tmp_path: Path) -> None:
    for extra in ([], ["--rules-file"]):
        result = subprocess.run(
            [sys.executable, str(PROMETHEUS_DIR / "render.py"), "--runbook-base", BASE, *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        document = yaml.safe_load(result.stdout)
        groups = document["groups"] if extra else document["spec"]["groups"]
        if not extra:
            assert document["kind"] == "PrometheusRule"
        urls = [rule["annotations"]["runbook_url"] for group in groups for rule in group["rules"]]
        relative = [rule["annotations"]["runbook_url"] for rule in alerts()]
        assert urls == [BASE + url for url in relative]
        rules_file = tmp_path / f"rendered{len(extra)}.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": groups}))
        checked = promtool("check", "rules", str(rules_file))
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # Without --runbook-base: absolute all the same, into this release's docs in the project's repository.
    default = subprocess.run(
        [sys.executable, str(PROMETHEUS_DIR / "render.py"), "--rules-file"], capture_output=True, text=True, timeout=60
    )
    assert default.returncode == 0, default.stderr
    source = re.search(r'^Source = "(https://[^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert source is not None, "pyproject.toml names the repository: [project.urls] Source"
    base = f"{source.group(1)}/blob/v{__version__}/"
    urls = [
        rule["annotations"]["runbook_url"]
        for group in yaml.safe_load(default.stdout)["groups"]
        for rule in group["rules"]
    ]
    assert urls == [base + rule["annotations"]["runbook_url"] for rule in alerts()]


def test_alert_table_says_what_the_rules_say() -> None:
    text = OBSERVABILITY.read_text()
    rows = re.findall(r"^\| `(NodeHealth\w+)` \| (.+?) \| (\S+) \| (\w+) \|$", text, re.M)
    table = {name: (duration, severity) for name, _, duration, severity in rows}
    no_for = "\N{EN DASH}"  # the table's mark for an alert that fires at once
    rules = {rule["alert"]: (rule.get("for", no_for), rule["labels"]["severity"]) for rule in alerts()}
    assert table == rules
    for rule in alerts():
        if rule["annotations"]["runbook_url"].startswith("docs/observability.md#"):
            assert f"\n### {rule['alert']}\n" in text, rule["alert"]


@pytest.mark.system
def test_documented_scrape_config_passes_promtool_and_adds_the_podmonitors_labels(tmp_path: Path) -> None:
    """docs/observability.md's scrape config for Prometheus without the Operator: valid, same labels."""
    block = re.search(r"```yaml\n(# prometheus.yml\n.*?)```", OBSERVABILITY.read_text(), re.S)
    assert block, "docs/observability.md lost its prometheus.yml example"
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


def test_metrics_reference_points_at_every_familys_page() -> None:
    text = OBSERVABILITY.read_text()
    section = text[text.index("### Per probe family") : text.index("### Joining")]
    links = set(re.findall(r"\]\((probes/[^)]+\.md)\)", section))
    assert links == {family.doc.removeprefix("docs/") for family in all_families().values()}
