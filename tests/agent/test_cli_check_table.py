"""`node-health check`'s table, as a person reads it in a terminal or a CI log: at most 120 columns, worst first
(fail, unknown, warn, ok, skip), every message and fix whole (wrapped between words, never cut), the fix for warns
too, and one verdict line at the end. Real probes on this machine: storage.space on a missing path whose name is
wider than the table (fail), on / with a warn threshold of 1% (warn), host.memory on a /proc without meminfo
(unknown).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

CLI = [sys.executable, "-m", "agent.cli"]
LONG = "/nonexistent/" + "/".join(f"directory-{n}" for n in range(14)) + "/shared"
STATUS_ORDER = ["FAIL", "UNKNOWN", "WARN", "ok", "skip"]
ROW = re.compile(r"^(FAIL|UNKNOWN|WARN|ok|skip) +(\S+)")


def check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = {
        "host": {"proc": str(tmp_path / "no-proc")},
        "storage": {"space": [{"path": LONG}, {"path": "/", "warn_percent": 1}]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [*CLI, "check", "--config", str(path), "--only", "host,storage.space", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def test_table_fits_120_columns_worst_first_with_every_fix_whole(tmp_path: Path) -> None:
    table = check(tmp_path)
    assert table.returncode == 1, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    rows = [match.group(1) for line in lines if (match := ROW.match(line))]
    assert rows == sorted(rows, key=STATUS_ORDER.index), rows
    assert {"FAIL", "UNKNOWN", "WARN", "ok"} <= set(rows)

    document: dict[str, Any] = json.loads(check(tmp_path, "--json").stdout)
    text = flat(table.stdout)
    for finding in document["findings"]:
        # Wrapped between words: with the line breaks and indents removed, every message is there whole. A word
        # wider than a line (the long path) is the only thing split, so compare without spaces for it.
        message = flat(finding["message"])
        assert message in text or message.replace(" ", "") in text.replace(" ", ""), message
        if finding["status"] in ("fail", "unknown", "warn") and finding["hint"]:
            assert f"fix: {flat(finding['hint'])}" in text, finding["hint"]
    warn = next(f for f in document["findings"] if f["status"] == "warn")
    assert warn["reason"] == "DiskLow" and f"fix: {flat(warn['hint'])}" in text

    assert lines[-2] == ""
    verdict = lines[-1]
    assert verdict.startswith(f"node {document['node']}: NOT READY: 1 reason blocks jobs (1 fail, 1 unknown, 1 warn,")
    counts = dict((status, len([r for r in rows if r == status])) for status in STATUS_ORDER)
    assert verdict.endswith(f"{counts['ok']} ok, {counts['skip']} skip)"), verdict


def test_a_ready_node_ends_with_ready(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"storage": {"space": [{"path": "/"}]}}))
    done = subprocess.run(
        [*CLI, "check", "--config", str(path), "--only", "storage.space"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines()[-1] == f"node {json.loads(check(tmp_path, '--json').stdout)['node']}: READY (1 ok)"
