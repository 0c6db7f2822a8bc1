"""A bad ConfigMap must never kill or bloat the agent: hostile files at start (exit 2, no traceback), with
`config --validate` (bounded), and on reload (rejected, counted, the running config kept, memory bounded)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import ConfigError, load_config, parse_config
from agent.configfile import MAX_CONFIG_BYTES, count_values

CLI = [sys.executable, "-m", "agent.cli"]

ALIAS_BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(
            f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]"
            for prev, name in zip("abcdefgh", "bcdefghi", strict=False)
        ),
    ]
)

HOSTILE: dict[str, tuple[bytes, str]] = {
    "non-utf8": (b"http:\n  port: \xff9100\n", "not UTF-8"),
    "huge-int": (b"http:\n  port: " + b"9" * 5000 + b"\n", "unreadable value"),
    "huge-int-nested": (b"storage:\n  space:\n    - path: /\n      warn_percent: " + b"1" * 5000 + b"\n", "unreadable"),
    "deep-nesting": (b"network:\n  egress: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested more than"),
    "alias-bomb": (ALIAS_BOMB.encode(), "YAML aliases"),
    "too-big": (b"# " + b"x" * (MAX_CONFIG_BYTES + 10) + b"\n", "bytes"),
    "binary": (bytes(range(256)) * 4, "config file"),
}


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_files_are_config_errors_at_start_and_in_validate(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data, expected = HOSTILE[name]
    path = write(tmp_path, name, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert expected in message, message
    assert len(message) < 2000, "the error must not echo the input"
    # In-process main(), as the console script calls it; the processes are in the test below.
    assert main(["config", "--validate", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and expected in stderr
    assert len(stderr) < 4000


def test_check_and_run_exit_2_without_a_traceback_on_a_hostile_file(tmp_path: Path) -> None:
    path = write(tmp_path, "alias-bomb", HOSTILE["alias-bomb"][0])
    for args in (["check", "--config", str(path)], ["run", "--no-kube", "--config", str(path)]):
        result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and "YAML aliases" in result.stderr


def test_a_config_path_that_became_a_symlink_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    link = tmp_path / "config.yaml"
    link.symlink_to("/dev/zero")
    result = subprocess.run([*CLI, "config", "--validate", str(link)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "not a regular file" in result.stderr


def test_configmap_style_symlink_chains_are_followed(tmp_path: Path) -> None:
    """A mounted ConfigMap is config.yaml → ..data/config.yaml → ..2026_11_30/config.yaml: that is fine."""
    data = tmp_path / "..2026_11_30_11_00_00.1"
    data.mkdir()
    (data / "config.yaml").write_text("http: {port: 9200}\n")
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    assert load_config(tmp_path / "config.yaml").http.port == 9200


def test_validation_errors_truncate_the_offending_input() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"logging": {"format": "x" * 100_000}})
    assert "logging.format" in str(info.value) and len(str(info.value)) < 1000


def test_count_values_stops_early_on_expansion() -> None:
    shared: list[object] = ["x"] * 10
    for _ in range(12):
        shared = [shared] * 10  # 10^12 values once expanded, built in microseconds
    assert count_values(shared, limit=1000) == 1001


# --- reload in a running daemon ---------------------------------------------------------------------


def start_daemon(config_path: Path) -> tuple[subprocess.Popen[str], int, list[str]]:
    proc = subprocess.Popen(
        [*CLI, "run", "--no-kube", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    port: list[int] = []
    started = threading.Event()

    def pump() -> None:  # keep draining the log so the daemon never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"serving on [^:]+:(\d+)", line)
            if match and not port:
                port.append(int(match.group(1)))
                started.set()

    threading.Thread(target=pump, daemon=True).start()
    if not started.wait(30):
        proc.kill()
        raise AssertionError("daemon did not start: " + "".join(lines[-20:]))
    return proc, port[0], lines


def status(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return json.loads(response.read())


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path, list[str]]]:
    config = tmp_path / "config.yaml"
    config.write_text("http: {address: 127.0.0.1, port: 0}\nprobes: {host: {interval_seconds: 1}}\n")
    proc, port, lines = start_daemon(config)
    try:
        yield proc, port, config, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.system
def test_every_hostile_file_on_reload_is_rejected_counted_and_memory_stays_bounded(
    daemon: tuple[subprocess.Popen[str], int, Path, list[str]],
) -> None:
    proc, port, config, lines = daemon
    before = peak_rss_mib(proc.pid)
    zero = config.parent / "zero"
    zero.symlink_to("/dev/zero")
    cases = [*HOSTILE.items(), ("dev-zero", (b"", "not a regular file"))]
    for errors, (name, (data, expected)) in enumerate(cases, 1):
        staged = config.parent / f"{name}.staged"
        if name == "dev-zero":
            staged.symlink_to(zero.name)
        else:
            staged.write_bytes(data)
        os.replace(staged, config)  # as the kubelet swaps a ConfigMap: atomically
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"{name} killed the daemon:\n" + "".join(lines[-30:])
            doc = status(port)
            agent = doc["agent"]
            assert isinstance(agent, dict)
            if agent["config_reloads"]["error"] >= errors:
                break
            assert time.monotonic() < deadline, f"{name}: reload not rejected: {agent}"
            time.sleep(0.2)
        assert expected in str(agent["last_reload_error"]), (name, agent["last_reload_error"])
        assert agent["config_reloads"]["ok"] == 0
    assert proc.poll() is None
    # The running config stays in force: the host probe still runs every second and the daemon answers.
    assert any(f["check"] == "host.memory" for f in status(port)["findings"])  # type: ignore[union-attr]
    grown = peak_rss_mib(proc.pid) - before
    assert grown < 100, f"peak RSS grew by {grown:.0f} MiB while rejecting hostile configs"
    assert not any("Traceback" in line for line in lines), "".join(lines[-40:])
