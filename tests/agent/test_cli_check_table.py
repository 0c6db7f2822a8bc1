"""`node-health check`'s table, as a person reads it in a terminal or a CI log: at most 120 columns, worst first
(fail, unknown, warn, ok, skip), every message and fix whole (wrapped between words, never cut), the fix for warns
too, and one verdict line at the end. Real probes on this machine: storage.space on a missing path whose name is
wider than the table (fail), on / with a warn threshold of 1% (warn), host.memory on a /proc without meminfo
(unknown).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.checktable import shorten_middle
from agent.cli import EXIT_NOT_READY, EXIT_READY, EXIT_USAGE

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
        env=child_env(),  # not a terminal, no $COLUMNS: 120 wide
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
        [*CLI, "check", "--config", str(path), "--only", "storage.space"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines()[-1] == f"node {json.loads(check(tmp_path, '--json').stdout)['node']}: READY (1 ok)"


# --- the terminal: width, colour, --problems, shortened subjects ------------------------------------------------

COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "host": {"proc": str(tmp_path / "no-proc")},
                "storage": {"space": [{"path": LONG}, {"path": "/", "warn_percent": 1}]},
            }
        )
    )
    return path


def on_pty(args: list[str], columns: int, env: dict[str, str]) -> tuple[int, str]:
    """Run the CLI as a child whose stdout is a real terminal (a pty) `columns` wide; what it wrote, as read from
    the terminal's other end (line ends back to \\n)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    child = subprocess.Popen([*CLI, *args], stdout=slave, stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return child.wait(timeout=180), b"".join(chunks).decode().replace("\r\n", "\n")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR")}
    env.update(extra)
    return env


def piped(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "check", "--config", str(config_file(tmp_path)), "--only", "host,storage.space", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(**env),
    )


def assert_aligned(lines: list[str]) -> None:
    """Every row's CHECK, SUBJECT and REASON begin where the header's do."""
    header = lines[0]
    starts = [header.index(name) for name in ("CHECK", "SUBJECT", "REASON")]
    rows = [line for line in lines if ROW.match(line)]
    assert rows
    for row in rows:
        for start in starts:
            assert row[start - 2 : start] == "  " and row[start] != " ", (start, row)


@pytest.mark.parametrize("columns", [80, 200])
def test_on_a_terminal_the_table_fits_its_width_aligned_and_coloured(tmp_path: Path, columns: int) -> None:
    args = ["check", "--config", str(config_file(tmp_path)), "--only", "host,storage.space"]
    rc, out = on_pty(args, columns, child_env())
    assert rc == 1, out
    assert "\x1b[1;31mNOT READY\x1b[0m" in out
    assert "\x1b[1;31mFAIL\x1b[0m" in out and "\x1b[1;35mUNKNOWN\x1b[0m" in out and "\x1b[1;33mWARN\x1b[0m" in out
    assert "\x1b[" not in "".join(line for line in out.splitlines() if line.startswith(("ok ", "skip ")))
    plain = COLOURS.sub("", out).splitlines()
    assert max(len(line) for line in plain) <= columns, max(plain, key=len)
    assert max(len(line) for line in plain) > columns - 10  # the width is used, not 120 whatever the terminal
    assert_aligned(plain)
    # The long path: shortened in the middle on its row (head and tail kept), whole in --json.
    fail = next(line for line in plain if line.startswith("FAIL"))
    assert "/nonexist" in fail and "…" in fail and "shared" in fail and LONG not in fail
    document = json.loads(piped(tmp_path, "--json").stdout)
    assert any(f["subject"] == LONG for f in document["findings"])

    rc, bare = on_pty(args, columns, child_env(NO_COLOR="1"))
    assert rc == 1 and "\x1b" not in bare
    numbers = re.compile(r"\d+(\.\d+)?")  # the disk's use may move between the two runs

    def shape(lines: list[str]) -> list[str]:
        return [numbers.sub("N", line) for line in lines]

    assert shape(bare.splitlines()) == shape(plain)


@pytest.mark.parametrize("columns", [80, 200])
def test_not_a_terminal_columns_sets_the_width_and_there_is_no_colour(tmp_path: Path, columns: int) -> None:
    done = piped(tmp_path, COLUMNS=str(columns))
    assert done.returncode == 1 and "\x1b" not in done.stdout
    lines = done.stdout.splitlines()
    assert columns - 10 < max(len(line) for line in lines) <= columns, max(lines, key=len)
    assert_aligned(lines)


def test_not_a_terminal_is_120_wide_and_never_under_80(tmp_path: Path) -> None:
    lines = piped(tmp_path).stdout.splitlines()
    assert 110 < max(len(line) for line in lines) <= 120
    narrow = piped(tmp_path, COLUMNS="40").stdout.splitlines()
    assert 70 < max(len(line) for line in narrow) <= 80


@pytest.mark.parametrize("no_color", [False, True])
def test_problems_shows_only_fail_unknown_warn_and_the_verdict(tmp_path: Path, no_color: bool) -> None:
    args = ["check", "--config", str(config_file(tmp_path)), "--only", "host,storage.space", "--problems"]
    rc, out = on_pty(args, 80, child_env(**({"NO_COLOR": "1"} if no_color else {})))
    assert rc == 1
    assert ("\x1b" in out) is not no_color
    lines = COLOURS.sub("", out).splitlines()
    rows = [match.group(1) for line in lines if (match := ROW.match(line))]
    assert rows == ["FAIL", "UNKNOWN", "WARN"], lines
    full = piped(tmp_path, COLUMNS="80").stdout.splitlines()
    verdict = flat(" ".join(lines[lines.index("") :]))  # wrapped at 80 columns
    assert verdict == flat(" ".join(full[full.index("") :])) and " ok, " in verdict  # it counts every check


def test_problems_on_a_ready_node_is_the_verdict_alone(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"storage": {"space": [{"path": "/"}]}}))
    done = subprocess.run(
        [*CLI, "check", "--config", str(path), "--only", "storage.space", "--problems"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.strip().endswith(": READY (1 ok)")


def test_a_subject_is_shortened_without_cutting_an_escape() -> None:
    escaped = "/data/" + "\\x1b" * 10 + "/end"
    for limit in range(4, len(escaped)):
        short = shorten_middle(escaped, limit)
        assert len(short) <= limit and short.startswith("/") and short.count("…") == 1
        assert re.sub(r"\\x1b", "", short).count("\\") == 0, short  # every escape whole or gone
    assert shorten_middle("short", 10) == "short"


def test_help_lists_the_exit_codes() -> None:
    done = subprocess.run([*CLI, "check", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for code in (EXIT_READY, EXIT_NOT_READY, EXIT_USAGE):
        assert re.search(rf"^  {code}  \S", done.stdout, re.M), done.stdout
    top = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert "exit status" in top.stdout


def test_probes_reasons_code_shows_one_and_an_unknown_code_suggests() -> None:
    one = subprocess.run([*CLI, "probes", "--reasons", "DiskLow"], capture_output=True, text=True, timeout=60)
    assert one.returncode == 0 and one.stdout.startswith("DiskLow  [warn]")
    assert [line for line in one.stdout.splitlines() if not line.startswith(" ")] == [one.stdout.splitlines()[0]]
    assert "fix:   clean caches" in one.stdout
    typo = subprocess.run([*CLI, "probes", "--reasons", "DiskLwo"], capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "did you mean DiskLow" in typo.stderr and not typo.stdout
    hostile = subprocess.run([*CLI, "probes", "--reasons", "\x1b[2J"], capture_output=True, text=True, timeout=60)
    assert hostile.returncode == 2 and "\x1b" not in hostile.stderr and "\\x1b" in hostile.stderr
    every = subprocess.run([*CLI, "probes", "--reasons"], capture_output=True, text=True, timeout=60)
    assert every.returncode == 0 and every.stdout.count("\n    means:") > 50
