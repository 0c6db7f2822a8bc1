"""The probe runtime is the bottom layer: it imports neither the contract (`probes.base`, which imports it for
the probe's context) nor any family, so every family and the contract can use it without a cycle."""

from __future__ import annotations

import ast

from support.system import REPO


def test_the_runtime_imports_only_itself_of_this_repository() -> None:
    offenders = []
    for path in sorted((REPO / "probes" / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)} imports {name}"
                for name in names
                if name.split(".")[0] in ("probes", "agent") and not name.startswith("probes.runtime")
            ]
            if isinstance(node, ast.ImportFrom) and node.level:
                offenders.append(f"{path.relative_to(REPO)} uses a relative import")
    assert offenders == []
