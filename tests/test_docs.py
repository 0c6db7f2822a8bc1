"""Claims in docs/ that are about the code, proven against the code: the layout tree of development.md and the
module table of kubernetes.md list every module of the tree and nothing that is gone, every repository path the
docs name exists, what agent/kube reads of a finding's `observed`, and which error answers are JSON."""

from __future__ import annotations

import ast
import json
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.system import REPO

from agent.http.routes import HttpServer
from agent.metrics import MetricsRenderer
from agent.state import HealthSettings, HealthState
from probes import all_families

DOCS = REPO / "docs"


def tracked_children(directory: str) -> set[str]:
    """What the layout tree must list of a directory: its files but __init__.py, its subpackages (`x/`)."""
    out = set()
    for path in (REPO / directory).iterdir():
        if path.is_file() and path.name != "__init__.py" and path.suffix != ".pyc" and not path.name.startswith("."):
            out.add(path.name)
        elif (path / "__init__.py").is_file():
            out.add(path.name + "/")
    return out


def layout_tree(text: str) -> dict[str, set[str]]:
    """development.md's layout block: directory → the names listed under it (placeholders `<...>` skipped with
    what is under them)."""
    block = text.split("## Layout\n\n```\n", 1)[1].split("```\n", 1)[0]
    listed: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    skip_below: int | None = None
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if skip_below is not None and depth > skip_below:
            continue
        skip_below = None
        stack = [(d, p) for d, p in stack if d < depth]
        parent = stack[-1][1] if stack else ""
        if name.startswith("<"):
            listed.setdefault(parent, set()).add(name)
            skip_below = depth
            continue
        listed.setdefault(parent, set()).add(name)
        if name.endswith("/"):
            stack.append((depth, parent + name))
    return listed


def test_the_layout_tree_lists_every_module_and_nothing_gone() -> None:
    text = (DOCS / "development.md").read_text()
    tree = layout_tree(text)
    families = {Path(family.module.replace(".", "/")).name for family in all_families().values()}
    problems = []
    for directory, names in sorted(tree.items()):
        if not directory.startswith(("agent/", "probes/")):
            continue
        actual = tracked_children(directory)
        if directory == "probes/":
            actual -= {f"{name}/" for name in families}
        real = {name for name in names if not name.startswith("<")}
        problems += [f"{directory}{name} listed, not in the tree" for name in sorted(real - actual)]
        problems += [f"{directory}{name} in the tree, not listed" for name in sorted(actual - real)]
    assert problems == []
    assert {"agent/", "agent/http/", "agent/kube/", "agent/kube/node/", "agent/kube/devices/"} <= set(tree)
    # The families' placeholder names them all.
    line = next(line for line in text.splitlines() if line.strip().startswith("<family>/"))
    named = set(re.search(r"\(([^)]*)\)", line).group(1).split(", "))  # type: ignore[union-attr]
    assert named == families


def test_the_layout_check_sees_a_missing_and_a_gone_module() -> None:
    tree = layout_tree("## Layout\n\n```\nagent/  x\n  http/  y\n    gone.py  z\n```\n")
    assert tree == {"": {"agent/"}, "agent/": {"http/"}, "agent/http/": {"gone.py"}}
    assert "routes.py" in tracked_children("agent/http/") - tree["agent/http/"]


def kube_table() -> set[str]:
    text = (DOCS / "kubernetes.md").read_text().split("The code is the package `agent/kube/`", 1)[1]
    table = text.split("\n\n", 2)[1]
    assert table.startswith("| Module | What |")
    rows = table.splitlines()[2:]
    return {path for row in rows for path in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0])}


def test_the_kubernetes_module_table_is_the_package() -> None:
    actual = {
        str(path.relative_to(REPO / "agent" / "kube"))
        for path in (REPO / "agent" / "kube").rglob("*.py")
        if path.name != "__init__.py"
    }
    assert kube_table() == actual


def test_every_repository_path_the_docs_name_exists() -> None:
    """A path of the repository named in docs/ or the README (a move leaves none behind); relative links from a
    page resolve from the page's folder. Benchmark results are written by the benchmarks, not tracked."""
    pattern = re.compile(r"(?<![\w/.-])((?:agent|probes|tests|deploy|scripts|benchmarks|docs)/[\w./-]*[\w/])")
    missing = []
    for page in sorted([*DOCS.rglob("*.md"), REPO / "README.md"]):
        for match in pattern.finditer(page.read_text()):
            path = match.group(1)
            if path.startswith("benchmarks/results/"):
                continue
            if not ((REPO / path).exists() or (page.parent / path).exists()):
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert missing == []


def observed_reads(source: str) -> list[str]:
    """Each `<x>.observed` in the source, as `get(NAME)` when it is `.observed.get(NAME)`, else the whole use."""
    tree = ast.parse(source)
    reads = []
    gets = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "observed"
        ):
            gets.add(id(node.func.value))
            key = node.args[0] if node.args else None
            reads.append(f"get({key.id})" if isinstance(key, ast.Name) else f"get({ast.unparse(key) if key else ''})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "observed" and id(node) not in gets:
            reads.append(ast.unparse(node))
    return reads


def test_agent_kube_reads_observed_only_for_device_identities() -> None:
    """kubernetes.md: agent/kube reads `observed` only in devices/match.py, through the probes' OBSERVED_* keys,
    and adds no command line."""
    reads = {
        str(path.relative_to(REPO)): observed_reads(path.read_text())
        for path in sorted((REPO / "agent" / "kube").rglob("*.py"))
    }
    assert {path: found for path, found in reads.items() if found} == {
        "agent/kube/devices/match.py": [
            "get(OBSERVED_DEVICE_IDS)",
            "get(OBSERVED_PCI_BUS_ID)",
            "get(OBSERVED_PHYSICAL_ID)",
            "get(OBSERVED_DEVICE_MINOR)",
        ]
    }
    assert not any("cmdline" in path.read_text() for path in (REPO / "agent" / "kube").rglob("*.py"))
    assert observed_reads("x = f.observed['command']; y = f.observed.get('pid')") == ["get('pid')", "f.observed"]


@contextmanager
def served() -> Iterator[int]:
    state = HealthState("node-a", HealthSettings())
    server = HttpServer(
        state,
        MetricsRenderer(state.current).render,
        lambda: (True, {"problems": []}),
        list,
        address="127.0.0.1",
        port=0,
    )
    server.start()
    try:
        yield server.port
    finally:
        server.stop()


def raw(port: int, request: bytes) -> tuple[int, str, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    content_type = next((line.split(": ", 1)[1] for line in lines if line.lower().startswith("content-type:")), "")
    return int(lines[0].split()[1]), content_type, body


@pytest.mark.system  # a server on 127.0.0.1
def test_error_answers_are_json_unless_ready_was_asked_for_text() -> None:
    """http.md: error answers are valid JSON with the client's bytes escaped, except /ready's asked as text."""
    close = b"Connection: close\r\n\r\n"
    requests = [
        (404, b'GET /no"such\\path HTTP/1.1\r\nHost: x\r\n' + close),
        (405, b"POST /ready HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n" + close),
        (400, b"GET /healthz?x=1 HTTP/1.1\r\nHost: x\r\n" + close),
        (400, b"GET /a\x01 HTTP/1.1\r\nHost: x\r\n" + close),
        (400, b"GET /ready HTTP/1.1\nHost: x\n\n"),  # a bare LF: framing refused
        (400, b"GET /ready?bogus=1 HTTP/1.1\r\nHost: x\r\n" + close),
    ]
    with served() as port:
        for status, request in requests:
            got, content_type, body = raw(port, request)
            assert got == status and content_type.startswith("application/json"), (request, got, body)
            assert isinstance(json.loads(body)["error"], str)
        got, content_type, body = raw(port, b"GET /ready?bogus=1&format=text HTTP/1.1\r\nHost: x\r\n" + close)
        assert (got, content_type) == (400, "text/plain; charset=utf-8")
        assert body.decode().startswith("bad request: unknown parameter 'bogus'") and body.count(b"\n") == 1


def test_every_default_public_fault_code_is_documented_and_registered() -> None:
    """docs/kubernetes.md's publicCustomization.json example registers every default code once, and its table gives
    each reason its code (a row `A \N{EN DASH} B` or `A, B` pairs the codes with its reasons in order)."""
    from agent.config import PublicFaultConfig
    from probes.npu.public_faults import DEFAULT_PUBLIC_FAULT_CODES

    text = (DOCS / "kubernetes.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```json\n")[1:]]
    example = json.loads(next(block for block in blocks if "publicFaultCode" in block))
    registered = [code for codes in example["publicFaultCode"].values() for code in codes]
    assert sorted(registered) == sorted([*DEFAULT_PUBLIC_FAULT_CODES.values(), PublicFaultConfig().default_code])
    table = text.split("| Code | Reason |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    documented: dict[str, str] = {}
    for row in table.splitlines():
        codes_cell, reasons_cell = row.strip("|").split("|")[:2]
        if "\N{EN DASH}" in codes_cell:
            first, last = (int(part) for part in codes_cell.split("\N{EN DASH}"))
            codes = [str(code) for code in range(first, last + 1)]
        else:
            codes = [code.strip() for code in codes_cell.split(",")]
        reasons = re.findall(r"\b(Npu\w+|Pcie\w+)", reasons_cell)
        documented.update(zip(reasons, codes, strict=False))
    assert documented == DEFAULT_PUBLIC_FAULT_CODES
