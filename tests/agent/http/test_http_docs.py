"""docs/http.md states the server's limits and the text format: each stated value is the code's."""

from __future__ import annotations

import re

import pytest
from support.system import REPO

from agent import metrics, ready
from agent.http import answers, limits, pod, routes, server, wire
from agent.http.limits import FD_RESERVE, MAX_CONNECTIONS, Limits
from agent.http.routes import ready_text
from agent.snapshot import Verdict
from probes.base import Finding, Status

PAGE = REPO / "docs" / "http.md"
UNITS = {"": 1, "KiB": 1024, "s": 1}


def limits_table() -> dict[str, str]:
    """Name → stated default, from the Limits table."""
    text = PAGE.read_text()
    section = text.split("## Limits", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| `(\w+)` \| ([^|]+) \|", section, re.M)
    assert rows, "no limits table in docs/http.md"
    return {name: default.strip() for name, default in rows}


def stated_number(text: str) -> float:
    match = re.fullmatch(r"(\d+) ?(KiB|s)?", text)
    assert match, f"not a plain value: {text!r}"
    return int(match.group(1)) * UNITS[match.group(2) or ""]


def code_value(name: str) -> float:
    if name in Limits.__dataclass_fields__:
        return float(getattr(Limits(), name))
    for module in (routes, answers, server, limits, wire, metrics, ready, pod):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise AssertionError(f"docs/http.md names {name}, which the code does not have")


def test_every_limit_in_the_docs_is_the_code_default() -> None:
    table = limits_table()
    derived = {"max_connections", "backlog"}
    for name, stated in table.items():
        if name in derived:
            continue
        assert stated_number(stated) == code_value(name), name
    assert set(Limits.__dataclass_fields__) - {"sweep_every"} <= set(table), "a limit is missing from the docs"
    # The fd-derived ones: stated as their ceiling and formula.
    assert table["max_connections"].startswith(str(MAX_CONNECTIONS))
    assert f"RLIMIT_NOFILE - {FD_RESERVE}" in table["max_connections"]
    assert table["backlog"].startswith("1024") and f"(RLIMIT_NOFILE - {FD_RESERVE}) / 4" in table["backlog"]


@pytest.mark.parametrize(
    ("soft", "connections", "backlog"),
    [(1 << 20, 1024, 1024), (20000, 1024, 1024), (1500, 717, 311), (1024, 360, 192), (300, 16, 64)],
)
def test_the_fd_derived_limits_follow_the_stated_formula(soft: int, connections: int, backlog: int) -> None:
    """Every port's listen queue comes out of the fd budget (the main, metrics and health ports'), and so do the
    health port's own slots."""
    assert limits.default_backlog(soft) == backlog == max(64, min(1024, (soft - FD_RESERVE) // 4))
    assert limits.default_max_connections(soft) == connections
    budget = soft - FD_RESERVE - backlog - limits.SECONDARY_BACKLOG - limits.HEALTH_FDS
    assert connections == max(16, min(MAX_CONNECTIONS, budget))


def test_the_fd_derived_limits_in_force_here() -> None:
    in_force = Limits()
    assert in_force.backlog == limits.default_backlog() <= 1024
    assert in_force.max_connections == limits.default_max_connections() <= MAX_CONNECTIONS


def test_the_text_example_is_what_the_agent_writes() -> None:
    example = PAGE.read_text().split("### Text answers", 1)[1].split("```\n", 2)[1]
    reasons = (
        Finding(
            "gpu.health",
            "gpu3",
            Status.FAIL,
            "XidError",
            "Xid 79 (GPU has fallen off the bus) on GPU 3",
            "drain the node and reset or replace the GPU",
            device=3,
        ),
        Finding(
            "host.memory",
            "",
            Status.UNKNOWN,
            "HostMemoryBelowRequest",
            "available host memory not known (host.memory is WarmingUp), cannot vouch for min_host_mem_mib=4096",
            "see the host probe in /status",
        ),
    )
    assert ready_text("gpu-node-07", Verdict(False, reasons, 1.0)).decode() == example


def anchors(page: str) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    headings = re.findall(r"^#+ (.+)$", page, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_links_resolve() -> None:
    text = PAGE.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        target, _, anchor = link.partition("#")
        page = PAGE.parent / target if target else PAGE
        assert page.is_file(), link
        assert not anchor or anchor in anchors(page.read_text()), link
    readme = (REPO / "README.md").read_text()
    assert "docs/http.md" in readme and "benchmarks" in anchors(text)
