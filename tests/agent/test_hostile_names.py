"""A process whose name is built to attack an operator's terminal, read back from every output.

A copy of /bin/sleep named `\\x1b\\u202e\\u200bevil\\x1b[31mgpj.exe\\u200b` (ESC, a right-to-left override, a
zero-width space, an ANSI colour) is exec'd from a temporary directory, so its argv[0], /proc/PID/exe and
/proc/PID/comm carry the name. It holds the fake node's davinci0 out of band (tests/support/fake_node.py):
davinci0 is mknod'ed with the device number of a pseudo-terminal this test opens, a device no other process
of this shared machine can be holding, so the finding names this process and no other.

Then every output is read back: the `check` table and `check --json` (the CLI as a subprocess), /status,
/ready as JSON and as text (a real agent), the Node's conditions and Events (the Kubernetes API double), and
the agent's log lines in the text and the JSON format. And `node-health diagnose` of a Python process whose
script and thread carry the name, dumped by the real py-spy. Each must name the process with the characters escaped
(visible: `\\x1b`, `\\u202e`, `\\u200b`) and hold no C0/C1 control, bidi or zero-width character, nor U+2028/9.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import node_env
from support.fake_node import REPO, FakeNode
from support.system import FIXTURES, require_root, require_tool

NAME = "\x1b\u202e\u200bevil\x1b[31mgpj.exe\u200b"
# How every output must show it (written out here, not computed by the code under test).
SHOWN = "\\x1b\\u202e\\u200bevil\\x1b[31mgpj.exe\\u200b"
# C0 and C1 controls, bidi embeddings/overrides/isolates and marks, zero-width characters, line and paragraph
# separators: none may be in any output (a line break only between lines).
FORBIDDEN = re.compile(
    "[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\u200b-\u200d\u2060\ufeff\u2028\u2029]"
)


def forbidden_in(text: str) -> list[str]:
    return [f"U+{ord(char):04X}" for char in FORBIDDEN.findall(text)]


def strings_of(value: Any) -> Iterator[str]:
    """Every string in a decoded JSON document, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings_of(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_of(item)


def assert_clean(document: Any, where: str) -> None:
    bad = {text[:200]: forbidden_in(text) for text in strings_of(document) if forbidden_in(text)}
    assert not bad, f"{where} holds raw control/bidi/zero-width characters: {bad}"


def assert_clean_lines(text: str, where: str) -> None:
    for line in text.split("\n"):
        assert not forbidden_in(line), f"{where}: {forbidden_in(line)} in {line[:300]!r}"


class HostileNode(FakeNode):
    """The fake node, with davinci0 held by the hostile process instead of the usual Python holder."""

    def __init__(self, workdir: Path, log_format: str = "text", kube: bool = True) -> None:
        super().__init__(workdir, FIXTURES, kube=kube)
        self.log_format = log_format
        self._pty_master: int | None = None
        self.holder_pid = 0

    def prepare(self) -> dict[str, Any]:
        config = super().prepare()
        # The Events the agent writes are logged at info: the log lines carry the name too.
        config["logging"] = {"level": "info", "format": self.log_format}
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return config

    def start_holder(self) -> None:
        self._pty_master, slave = os.openpty()
        program = self.workdir / "bin" / NAME
        try:
            davinci0 = self.workdir / "dev" / "davinci0"
            davinci0.unlink()
            os.mknod(davinci0, 0o666 | stat.S_IFCHR, os.fstat(slave).st_rdev)
            program.parent.mkdir()
            shutil.copy("/bin/sleep", program)
            self._holder = subprocess.Popen([str(program), "600"], stdin=slave, stdout=subprocess.DEVNULL)
        finally:
            os.close(slave)  # the holder keeps its own
        self.holder_pid = self._holder.pid
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder_pid}/exe") != str(program):  # exec'd
            assert time.monotonic() < deadline, "the hostile holder did not start"
            time.sleep(0.05)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._pty_master is not None:
                os.close(self._pty_master)
                self._pty_master = None

    def check(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = node_env()
        command = [sys.executable, "-m", "agent.cli", "check", *args, "--config", str(self.config_path)]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()


def wait_for(what: str, probe: Any, timeout: float = 45.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileNode]:
    """The fake node's tree, servers and the hostile holder, without an agent: for `node-health check`."""
    require_root()
    node = HostileNode(tmp_path_factory.mktemp("hostile-check"), kube=False)
    try:
        node.prepare()
        node.start_holder()
        yield node
    finally:
        node.close()


@contextlib.contextmanager
def running(workdir: Path, log_format: str) -> Iterator[HostileNode]:
    require_root()
    with HostileNode(workdir, log_format) as node:
        yield node


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileNode]:
    """A real agent on the hostile node, reconciling its Node on the API double, logging text."""
    with running(tmp_path_factory.mktemp("hostile-agent"), "text") as node:
        yield node


def holder_finding(document: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in document["findings"] if (f["check"], f["subject"]) == ("npu.holders", "npu0"))


# --- node-health check --------------------------------------------------------------------------------


@pytest.mark.system
def test_check_table(prepared: HostileNode) -> None:
    result = prepared.check()
    assert result.returncode == 1, result.stderr[-2000:]
    assert_clean_lines(result.stdout, "the check table")
    assert_clean_lines(result.stderr, "check's stderr")
    # A row is its first line and the indented lines under it (a long message is wrapped between words).
    lines = result.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if "npu.holders" in line and "NpuHeldOutOfBand" in line]
    rows = []
    for start in starts:
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        rows.append(" ".join(line.strip() for line in lines[start:end]))
    assert rows and all(f"PID {prepared.holder_pid} ({SHOWN})" in row for row in rows), result.stdout


@pytest.mark.system
def test_check_json(prepared: HostileNode) -> None:
    result = prepared.check("--json")
    assert result.returncode == 1, result.stderr[-2000:]
    document = json.loads(result.stdout)
    assert_clean(document, "check --json")
    held = holder_finding(document)
    assert held["reason"] == "NpuHeldOutOfBand" and f"PID {prepared.holder_pid} ({SHOWN})" in held["message"]
    (holder,) = [h for h in held["observed"]["holders"] if h["pid"] == prepared.holder_pid]
    assert holder["executable"] == SHOWN


# --- the agent's HTTP answers --------------------------------------------------------------------------


@pytest.mark.system
def test_status(agent: HostileNode) -> None:
    document = agent.status()
    assert_clean(document, "/status")
    held = holder_finding(document)
    assert held["status"] == "fail" and f"PID {agent.holder_pid} ({SHOWN})" in held["message"]
    (holder,) = [h for h in held["observed"]["holders"] if h["pid"] == agent.holder_pid]
    assert holder["executable"] == SHOWN


@pytest.mark.system
def test_ready_json(agent: HostileNode) -> None:
    for path in ("/ready", "/ready?checks=npu"):
        status, body = agent.get(path)
        assert status == 503, body
        document = json.loads(body)
        assert_clean(document, path)
        messages = [r["message"] for r in document["reasons"] if r["check"] == "npu.holders"]
        assert messages and f"PID {agent.holder_pid} ({SHOWN})" in messages[0], document


@pytest.mark.system
def test_ready_text(agent: HostileNode) -> None:
    status, body = agent.get("/ready?format=text")
    assert status == 503, body
    assert_clean_lines(body, "/ready?format=text")
    (line,) = [line for line in body.splitlines() if line.startswith("fail npu.holders npu0 NpuHeldOutOfBand: ")]
    # The line is bounded: the name shows escaped as far as its room goes, at least its three leading escapes.
    named = line.partition(f"PID {agent.holder_pid} (")[2]
    shown = named.split(")", 1)[0] if named.startswith(SHOWN) else named.split("...", 1)[0]
    assert SHOWN.startswith(shown) and len(shown) >= len("\\x1b\\u202e\\u200b"), line


# --- the Node: conditions and Events -------------------------------------------------------------------


@pytest.mark.system
def test_node_conditions(agent: HostileNode) -> None:
    api = agent.api
    assert api is not None

    def npu_condition() -> dict[str, Any] | None:
        conditions = api.node(agent.node_name).get("status", {}).get("conditions") or []
        found = [c for c in conditions if c.get("type") == "NPUHealthy" and c.get("status") == "False"]
        return found[0] if found else None

    condition = wait_for("NPUHealthy=False condition", npu_condition)
    assert f"PID {agent.holder_pid} ({SHOWN})" in condition["message"], condition
    assert_clean(api.node(agent.node_name), "the Node")


@pytest.mark.system
def test_events(agent: HostileNode) -> None:
    api = agent.api
    assert api is not None

    def naming() -> list[dict[str, Any]]:
        return [e for e in api.events() if f"PID {agent.holder_pid} (" in e.get("message", "")]

    events = wait_for("Event naming the holder", naming)
    assert_clean(api.events(), "the Events")
    assert any(f"PID {agent.holder_pid} ({SHOWN})" in event["message"] for event in events), events


# --- the agent's logs -----------------------------------------------------------------------------------


def logged_lines(node: HostileNode) -> list[str]:
    def naming() -> list[str]:
        lines = node.log_path.read_text(errors="replace").splitlines()
        return lines if any(str(node.holder_pid) in line and "wrote event" in line for line in lines) else []

    return list(wait_for("log line about the Event naming the holder", naming))


@pytest.mark.system
def test_text_log(agent: HostileNode) -> None:
    lines = logged_lines(agent)
    assert_clean_lines("\n".join(lines), "the text log")
    assert any(f"PID {agent.holder_pid} ({SHOWN})" in line for line in lines), lines[-20:]


@pytest.mark.system
def test_json_log(tmp_path: Path) -> None:
    with running(tmp_path, "json") as node:
        lines = logged_lines(node)
    entries = [json.loads(line) for line in lines]  # every line one JSON object
    assert_clean([{k: v for k, v in entry.items() if k != "exc"} for entry in entries], "the JSON log")
    for entry in entries:  # a traceback keeps its line breaks, nothing else
        assert_clean_lines(entry.get("exc", ""), "a traceback in the JSON log")
    assert_clean_lines("\n".join(lines), "the JSON log's raw lines")
    assert any(f"PID {node.holder_pid} ({SHOWN})" in entry["msg"] for entry in entries), entries[-20:]


# --- node-health diagnose ------------------------------------------------------------------------------

SLEEPER = """
import sys, threading, time
threading.current_thread().name = sys.argv[1]
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.system
def test_diagnose(tmp_path: Path) -> None:
    require_root()  # py-spy needs ptrace rights over the child
    require_tool("py-spy")
    script = tmp_path / f"{NAME}.py"
    script.write_text(SLEEPER)
    child = subprocess.Popen([sys.executable, str(script), NAME], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        command = [sys.executable, "-m", "agent.cli", "diagnose", str(child.pid)]
        text = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)
        as_json = subprocess.run(
            [*command, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        child.kill()
        child.wait()
    assert text.returncode == 0, text.stderr
    assert_clean_lines(text.stdout, "diagnose")
    assert f"Thread {SHOWN} (" in text.stdout and f"{SHOWN}.py" in text.stdout, text.stdout
    document = json.loads(as_json.stdout)
    assert_clean(document, "diagnose --json")
    assert any(thread["name"] == SHOWN for thread in document["threads"]), document
