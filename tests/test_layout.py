"""The layout holds: probes/ is a lower layer, imports have no cycle, reasons are declared and documented,
adding a probe is one file, and the config keys and defaults of 0.1 still stand."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.system import REPO

from agent.config import default_config_yaml
from agent.reference import sync
from probes import all_families, all_probes
from probes.base import Check, Probe, ProbeContext, ProbeOutput, Reason, Status, UndeclaredReason
from probes.family import family_of
from probes.kernel.default_rules import DEFAULT_RULES

PACKAGES = ("agent", "probes")


def python_files(*roots: str) -> Iterator[Path]:
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def imported_modules(path: Path) -> frozenset[str]:
    """Every module a file imports, at any level (lazy imports count: they run too). Read once per run: the
    layering tests walk the same tree."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(found)


def test_probes_import_nothing_from_agent() -> None:
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in python_files("probes")
        for name in imported_modules(path)
        if name == "agent" or name.startswith("agent.")
    ]
    assert offenders == []


def test_the_import_graph_has_no_cycle() -> None:
    modules = {module_name(path): path for path in python_files(*PACKAGES)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_modules(path) if m in modules and m != name}
    # The probes package's __init__ imports its modules dynamically (discovery), never statically.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], " ; ".join(" → ".join(c) for c in cycles)


# What readers of the health state build on, lowest first: no module imports one of its own layer or a higher
# one, so the snapshot never reaches up into the state machine, nor readiness into HTTP.
AGENT_LAYERS = (
    ("agent.timestamps", "agent.reasons"),
    ("agent.snapshot",),
    ("agent.ready",),
    ("agent.state", "agent.http.pod"),
    ("agent.http.answers",),
    ("agent.http.routes", "agent.metrics"),
)


def test_the_health_state_layers_import_only_downwards() -> None:
    offenders = []
    for index, layer in enumerate(AGENT_LAYERS):
        not_below = {name for higher in AGENT_LAYERS[index:] for name in higher}
        for name in layer:
            imported = imported_modules(REPO / (name.replace(".", "/") + ".py"))
            offenders.extend(f"{name} imports {other}" for other in sorted(imported & not_below - {name}))
    assert offenders == []


def agent_graph(packages_too: bool = True) -> dict[str, set[str]]:
    """Module → the modules of agent/ and probes/ it imports; `packages_too`: with the packages above them
    (importing a module runs its packages' __init__ too)."""
    modules = {module_name(path): path for path in python_files(*PACKAGES)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = {m for m in imported_modules(path) if m in modules}
        if packages_too:
            found |= {parent for m in set(found) for parent in parents(m) if parent in modules}
        graph[name] = found - {name}
    return graph


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start, *parents(start)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_the_daemon_never_imports_the_operators_commands() -> None:
    """agent.kube.ops (cleanup, fleet, uninstall) is the command line's: nothing the daemon imports, lazily or
    not, directly or through another module, reaches it."""
    graph = agent_graph()
    assert "agent.kube.ops.fleet" in graph and "agent.kube.reconciler" in reachable(graph, "agent.daemon")
    reached = sorted(
        m for m in reachable(graph, "agent.daemon") if m == "agent.kube.ops" or m.startswith("agent.kube.ops.")
    )
    assert reached == []


def test_the_reach_walk_follows_imports_through_packages() -> None:
    """The walk above can fail: the command line does reach the operator's commands."""
    assert "agent.kube.ops.uninstall" in reachable(agent_graph(), "agent.cli")


# The wings, lowest first: a unit imports only units of lower rows (and modules of its own package). The HTTP
# and Kubernetes wings read the snapshot and never each other, and nothing of theirs reaches back up into the
# daemon, the scheduler or the command line.
WING_ROWS = (
    ("agent.kube.client",),
    ("agent.kube.slots", "agent.kube.pods"),
    ("agent.kube.node",),
    ("agent.kube.devices",),
    ("agent.kube.reconciler", "agent.kube.ops"),
    ("agent.kube",),
)
ABOVE_THE_WINGS = ("agent.daemon", "agent.cli", "agent.scheduler", "agent.diagnose", "agent.metrics")


def wing_unit(module: str) -> str | None:
    """The unit of WING_ROWS a module of agent/kube belongs to (its subpackage, or itself)."""
    for row in WING_ROWS:
        for unit in row:
            if module == unit or (unit != "agent.kube" and module.startswith(unit + ".")):
                return unit
    return None


def wing_offenders(graph: dict[str, set[str]]) -> list[str]:
    rank = {unit: index for index, row in enumerate(WING_ROWS) for unit in row}
    offenders = []
    for name, imported in sorted(graph.items()):
        if name.startswith("agent.http"):
            offenders.extend(
                f"{name} imports {m}" for m in sorted(imported) if m.startswith("agent.kube") or m in ABOVE_THE_WINGS
            )
        unit = wing_unit(name)
        if unit is None:
            continue
        for other in sorted(imported):
            if other.startswith("agent.http") or other in ABOVE_THE_WINGS:
                offenders.append(f"{name} imports {other}")
            target = wing_unit(other)
            if target is not None and target != unit and rank[target] >= rank[unit]:
                offenders.append(f"{name} ({unit}) imports {other} ({target})")
    return offenders


def test_the_wings_import_one_way() -> None:
    assert wing_offenders(agent_graph(packages_too=False)) == []


def test_the_wing_rule_catches_an_import_back_up() -> None:
    graph = agent_graph(packages_too=False)
    graph["agent.kube.node.plan"] = graph["agent.kube.node.plan"] | {"agent.kube.devices.match"}
    graph["agent.kube.ops.fleet"] = graph["agent.kube.ops.fleet"] | {"agent.kube.reconciler"}
    graph["agent.http.routes"] = graph["agent.http.routes"] | {"agent.kube.pods"}
    assert wing_offenders(graph) == [
        "agent.http.routes imports agent.kube.pods",
        "agent.kube.node.plan (agent.kube.node) imports agent.kube.devices.match (agent.kube.devices)",
        "agent.kube.ops.fleet (agent.kube.ops) imports agent.kube.reconciler (agent.kube.reconciler)",
    ]


def package_maps() -> Iterator[tuple[Path, list[str]]]:
    """Each package under agent/ and probes/ with the modules and subpackages its docstring's map lacks."""
    for init in sorted(path for root in PACKAGES for path in (REPO / root).rglob("__init__.py")):
        package = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = {word for span in re.findall(r"`([^`]+)`", doc) for word in re.findall(r"[A-Za-z_]\w*", span)}
        members = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
        members += [d.name for d in package.iterdir() if (d / "__init__.py").is_file()]
        yield init, sorted(m for m in members if m not in named)


def test_every_package_docstring_maps_its_modules() -> None:
    """A package's __init__ docstring is its map: every module and subpackage named in backquotes."""
    missing = {str(init.relative_to(REPO)): names for init, names in package_maps() if names}
    assert missing == {}
    assert len(list(package_maps())) >= 17  # agent, http, kube and its three wings, probes and every family


def test_the_map_check_sees_a_module_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "agent" / "wing"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""The wing.\n\n- `mapped`: here.\n"""\n')
    for name in ("mapped", "forgotten"):
        (package / f"{name}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert [(str(i.relative_to(tmp_path)), names) for i, names in package_maps()] == [
        ("agent/wing/__init__.py", ["forgotten"])
    ]


def test_every_probe_belongs_to_a_family_whose_docs_page_exists() -> None:
    for name, cls in all_probes().items():
        family = family_of(cls)
        assert family is not None, f"probe {name} ({cls.__module__}) is in no family"
        assert (REPO / family.doc).is_file(), f"{family.doc} missing"
        head = name.split(".")[0]
        path = Path(sys.modules[cls.__module__].__file__ or "")
        expected = (REPO / "probes" / head / (name.split(".", 1)[1] + ".py" if "." in name else f"{head}.py")).resolve()
        assert path.resolve() == expected, f"probe {name} lives in {path}, its name says {expected}"


def test_every_probe_declares_reasons_and_the_docs_carry_them() -> None:
    for name, cls in all_probes().items():
        assert cls.reasons, f"probe {name} declares no reasons"
        for reason in cls.reasons:
            assert reason.meaning and reason.code[:1].isupper(), f"{name}: {reason}"
            assert len(reason.code) <= 63, f"{name}: {reason.code} is too long for a taint value"
    assert sync(REPO, write=False) == [], "run: python -m agent.reference --write"


def test_an_undeclared_reason_raises_in_strict_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    declared = Reason("Declared", Status.WARN, "a declared reason")
    check = Check("host.test")

    class Sloppy(Probe):
        name = "test.sloppy"
        checks = ("host.test",)
        reasons = (declared,)
        emit = declared
        status: Status | None = None

        def run(self, ctx: ProbeContext) -> ProbeOutput:
            return [check.report(self.emit, "", "message", status=self.status)]

    ctx = ProbeContext(None, None, 1.0)  # type: ignore[arg-type]
    monkeypatch.setenv("NODE_HEALTH_STRICT_REASONS", "1")
    assert Sloppy().run(ctx)[0].reason == "Declared"
    Sloppy.emit = Reason("Surprise", Status.FAIL, "never declared")
    with pytest.raises(UndeclaredReason, match="Surprise"):
        Sloppy().run(ctx)
    Sloppy.emit, Sloppy.status = declared, Status.FAIL
    with pytest.raises(UndeclaredReason, match="declared only as"):
        Sloppy().run(ctx)
    monkeypatch.setenv("NODE_HEALTH_STRICT_REASONS", "0")
    assert Sloppy().run(ctx)[0].status == Status.FAIL, "in production the finding is kept, never dropped"


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 70
SIZE_MARKER = "# Size:"  # within the first SIZE_MARKER_LINES lines: why a module may be longer
SIZE_MARKER_LINES = 40


def size_reason(lines: list[str]) -> str:
    """The reason a module gives for its size (a `# Size: <why>` line near its top), or ""."""
    for line in lines[:SIZE_MARKER_LINES]:
        if line.startswith(SIZE_MARKER):
            return line[len(SIZE_MARKER) :].strip()
    return ""


def test_modules_stay_small() -> None:
    """No module of agent/ or probes/ over 500 lines unless it says why; no function over 70 lines."""
    too_long: list[str] = []
    for path in python_files(*PACKAGES):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES and not size_reason(lines):
            too_long.append(f"{path.relative_to(REPO)}: {len(lines)} lines and no '{SIZE_MARKER} <why>' line")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


def test_the_size_marker_counts_only_near_the_top_and_with_a_reason() -> None:
    assert size_reason(['"""doc"""', "# Size: one protocol in one place"]) == "one protocol in one place"
    assert size_reason(['"""doc"""', "    # Size: indented, inside code"]) == ""
    assert size_reason([*[""] * SIZE_MARKER_LINES, "# Size: too far down"]) == ""
    assert size_reason(["# Size:"]) == "", "a marker without a reason says nothing"


# --- config: the keys and defaults of 0.1 ------------------------------------------------------------

# Defaults changed on purpose since 0.1, each for a reason the docs give.
CHANGED_DEFAULTS = {
    # The pod's resolver serves cluster names; no cluster domain is hard-coded (docs/probes/network.md).
    ("network", "dns", "cluster_names"): ["kubernetes.default.svc"],
    # The holder scan's deadline grows with the host's fds, within 40% of the run (docs/probes/npu.md).
    ("probes", "npu", "timeout_seconds"): 20.0,
    # Every default kernel log rule anchored to its driver's prefix, loop devices left out of the filesystem
    # rules: a task's name or crash file name must not raise or clear a fault (docs/probes/kernel_log.md).
    **{
        ("kernel_log", "rules", f"[{index}]", key): rule[key]
        for index, rule in enumerate(DEFAULT_RULES)
        for key in ("pattern", "recover_pattern")
        if rule.get(key)
    },
    # The mlx5 driver's port and module events joined the default rules (docs/probes/interconnect.md).
    ("kernel_log", "rules", "#len"): len(DEFAULT_RULES),
}


def flatten(data: object, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Key paths → values; list items that are mappings are walked too (a key added to them is an addition)."""
    if isinstance(data, dict) and data:
        out: dict[tuple[str, ...], object] = {}
        for key, value in data.items():
            out.update(flatten(value, (*prefix, str(key))))
        return out
    if isinstance(data, list) and data and all(isinstance(item, dict) for item in data):
        out = {(*prefix, "#len"): len(data)}
        for index, item in enumerate(data):
            out.update(flatten(item, (*prefix, f"[{index}]")))
        return out
    return {prefix: data}


def test_config_defaults_keep_every_key_and_value_of_0_1() -> None:
    old = flatten(yaml.safe_load((REPO / "tests" / "data" / "defaults-0.1.yaml").read_text()))
    new = flatten(yaml.safe_load(default_config_yaml(all_probes())))
    for key, value in old.items():
        assert key in new, f"config key {'.'.join(key)} is gone"
        expected = CHANGED_DEFAULTS.get(key, value)
        assert new[key] == expected, f"{'.'.join(key)}: {new[key]!r}, was {value!r}"


def test_every_family_section_is_assembled() -> None:
    sections = set(yaml.safe_load(default_config_yaml(all_probes())))
    assert set(all_families()) <= sections


# --- adding a probe is one file ----------------------------------------------------------------------

EXAMPLE = '''\
"""An example family of one module: its config, its reasons and its probe, all here."""

from __future__ import annotations

from probes.base import Check, Probe, ProbeContext, ProbeOutput, Reason, Status, register

from probes.family import Family, Section
from probes.family import register_family


class ExampleConfig(Section):
    greeting: str = "hello"
    threshold: int = 3


FAMILY = register_family(
    Family(key="example", module=__name__, config=ExampleConfig, title="Example", doc="docs/probes/example.md")
)
EXAMPLE_CHECK = Check("example.greeting", category="host")
TOO_QUIET = Reason("ExampleTooQuiet", Status.WARN, "the greeting is empty", "set example.greeting")


@register
class ExampleProbe(Probe):
    name = "example"
    checks = ("example.greeting",)
    reasons = (TOO_QUIET,)
    default_interval = 42.0

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(ExampleConfig)
        if not settings.greeting:
            return [EXAMPLE_CHECK.report(TOO_QUIET, "", "nothing to say")]
        return [EXAMPLE_CHECK.ok("", f"{settings.greeting} x{settings.threshold}")]
'''


@pytest.fixture(scope="module")
def tree_with_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dropin")
    for package in PACKAGES:
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "probes" / "example.py").write_text(EXAMPLE)
    return root


def run_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_dropped_in_probe_file_is_listed_checked_and_configured(tree_with_example: Path, tmp_path: Path) -> None:
    listed = run_cli(tree_with_example, "probes")
    assert listed.returncode == 0, listed.stderr
    assert "example\n  checks:   example.greeting" in listed.stdout
    reasons = run_cli(tree_with_example, "probes", "--reasons")
    assert "ExampleTooQuiet" in reasons.stdout
    defaults = run_cli(tree_with_example, "config", "--defaults")
    data = yaml.safe_load(defaults.stdout)
    assert data["example"] == {"greeting": "hello", "threshold": 3}
    assert data["probes"]["example"]["interval_seconds"] == 42.0
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("example: {greeting: ''}\n"))
    checked = run_cli(tree_with_example, "check", "--only", "example", "--config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr  # a warn does not block readiness
    assert "ExampleTooQuiet" in checked.stdout and "example.greeting" in checked.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("example: {threshold: many}\n")
    refused = run_cli(tree_with_example, "check", "--only", "example", "--config", str(bad))
    assert refused.returncode == 2 and "example.threshold" in refused.stderr


def imports_of_test_modules(root: Path) -> list[str]:
    """Every file under root that imports a test module or a conftest (shared parts belong in tests/support)."""
    tests = {path.stem for path in root.rglob("test_*.py")} | {"conftest"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([alias.name for alias in node.names] if not node.module else [])
            else:
                continue
            offenders.extend(
                f"{path.relative_to(root)} imports {name}"
                for name in names
                if any(part in tests for part in name.split("."))
            )
    return sorted(offenders)


def test_tests_never_import_another_test_module() -> None:
    """docs/development.md: tests import helpers from tests/support, never from conftest.py or a test module."""
    assert imports_of_test_modules(REPO / "tests") == []


def test_the_test_import_rule_sees_one(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "test_a.py").write_text("X = 1\n")
    (tmp_path / "deploy" / "test_b.py").write_text("from test_a import X\nimport conftest\n")
    (tmp_path / "support.py").write_text("import yaml\n")
    assert imports_of_test_modules(tmp_path) == ["deploy/test_b.py imports conftest", "deploy/test_b.py imports test_a"]
