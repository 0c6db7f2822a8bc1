"""The CLI as a user runs it: exit codes, table and JSON, config validation, the daemon and its signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent.cli import main
from agent.config import default_config, parse_config
from probes import all_probes

CLI = [sys.executable, "-m", "agent.cli"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("bogus: 1\n", "bogus"),
        ("http: {port: notaport}\n", "http.port"),
        ("probes: {host: {interval_seconds: -5}}\n", "probes.host.interval_seconds"),
        ("probes: {nosuchprobe: {enabled: true}}\n", "probes.nosuchprobe"),
        ("storage: {space: [{path: /, warn_percent: 120}]}\n", "storage.space[0].warn_percent"),
        ("logging: {format: xml}\n", "logging.format"),
        ("host: {memory: {min_available_mib: many}}\n", "host.memory.min_available_mib"),
        ("health: {fail_threshold: 0}\n", "health.fail_threshold"),
        ("- just\n- a list\n", "mapping"),
        ("http: {port: [unclosed\n", "YAML"),
        # Kubernetes' own prefixes: cleanup removes every key under the prefix, kubelet's too.
        ("kubernetes: {key_prefix: kubernetes.io}\n", "kubernetes.key_prefix"),
        ("kubernetes: {key_prefix: node.kubernetes.io}\n", "kubernetes.key_prefix"),
        ("kubernetes: {key_prefix: k8s.io}\n", "kubernetes.key_prefix"),
        ("kubernetes: {key_prefix: health.x-k8s.k8s.io}\n", "kubernetes.key_prefix"),
        # A Node's Events are refused anywhere but in default (tests/realkube/test_realkube_vs_double.py).
        ("kubernetes: {events_namespace: node-health}\n", "kubernetes.events_namespace"),
        # Checked at load, as kube-apiserver parses it (tests/realkube/test_realkube_vs_double.py).
        ("kubernetes: {budget_node_selector: 'accel===true'}\n", "kubernetes.budget_node_selector"),
    ],
)
def test_bad_config_exits_2_naming_the_key(
    tmp_path: Path, text: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process (the same main() the console script calls): the entry point itself is run as a process in
    # test_check_table_json_and_exit_codes and test_config_hostile.
    assert main(["check", "--config", write(tmp_path, text)]) == 2
    stderr = capsys.readouterr().err
    assert key in stderr
    assert "Traceback" not in stderr


def test_a_prefix_that_only_looks_like_a_reserved_one_is_accepted() -> None:
    for prefix in ("mykubernetes.io", "k8s.io.example.com", "health.example.com"):
        assert parse_config({"kubernetes": {"key_prefix": prefix}}).kubernetes.key_prefix == prefix


def test_allowed_values_are_named() -> None:
    with pytest.raises(Exception) as info:
        parse_config({"logging": {"level": "loud"}})
    assert "'debug'" in str(info.value) and "logging.level" in str(info.value)


def test_defaults_print_valid_yaml_that_round_trips() -> None:
    result = run_cli("config", "--defaults")
    assert result.returncode == 0
    data = yaml.safe_load(result.stdout)
    probes = all_probes()
    config = parse_config(data, probes)
    assert set(data["probes"]) == set(probes)
    assert config.model_dump(exclude={"probes"}) == default_config().model_dump(exclude={"probes"})
    assert data["http"] == {
        "address": "0.0.0.0",
        "port": 9100,
        "metrics_port": 9101,
        "status_on_main_port": True,
        "max_wait_seconds": 300.0,
    }


def test_check_table_json_and_exit_codes(tmp_path: Path) -> None:
    ok_cfg = write(
        tmp_path,
        "host: {memory: {min_available_mib: 1, min_available_percent: 0}, shm: {min_size_mib: 0, min_free_mib: 0}}\n",
    )
    result = run_cli("check", "--config", ok_cfg, "--only", "host")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "READY" in result.stdout and "host.memory" in result.stdout

    bad_cfg = write(tmp_path, "host: {memory: {min_available_mib: 100000000}}\n", "bad.yaml")
    result = run_cli("check", "--config", bad_cfg, "--only", "host.memory", "--json")
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert set(doc) >= {"node", "ready", "generated_at", "findings", "probes"}
    assert doc["ready"] is False
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", doc["generated_at"])
    (finding,) = [f for f in doc["findings"] if f["check"] == "host.memory" and f["subject"] == ""]
    assert finding["reason"] == "HostMemoryLow" and finding["hint"]
    assert {p["name"] for p in doc["probes"]} == {"host"}
    assert all(set(p) >= {"name", "last_run", "duration_seconds", "result"} for p in doc["probes"])

    result = run_cli("check", "--only", "nosuch")
    assert result.returncode == 2 and "nosuch" in result.stderr


def test_probes_lists_every_probe_with_checks_and_needs() -> None:
    result = run_cli("probes")
    assert result.returncode == 0
    for name, cls in all_probes().items():
        assert name in result.stdout
        for check in cls.checks:
            assert check in result.stdout
    assert "needs:" in result.stdout


def start_daemon(config_path: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [*CLI, "run", "--no-kube", "--config", config_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = re.search(r"serving on [^:]+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
    proc.kill()
    raise AssertionError("daemon did not start")


def fetch(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.read()


@pytest.mark.system
def test_daemon_reloads_config_on_change_and_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    config_path = write(tmp_path, "http: {address: 127.0.0.1, port: 0}\nstorage: {space: [{path: /}]}\n")
    proc, port = start_daemon(config_path)
    try:
        status = json.loads(fetch(port, "/status"))
        assert status["agent"]["config_reloads"] == {"ok": 0, "error": 0}

        # An invalid new config is rejected, counted, and the running config stays in force. (An unknown key is
        # not invalid for the daemon: tests/agent/test_config_compat.py.)
        Path(config_path).write_text("http: {address: 127.0.0.1, port: 0}\nlogging: {level: bogus}\n")
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while json.loads(fetch(port, "/status"))["agent"]["config_reloads"]["error"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status = json.loads(fetch(port, "/status"))
        assert "bogus" in status["agent"]["last_reload_error"]
        assert b'nodehealth_config_reloads_total{result="error"} 1.0' in fetch(port, "/metrics")

        # A valid change on disk is picked up without a signal (a ConfigMap update), and applied.
        text = "http: {address: 127.0.0.1, port: 0}\nstorage: {space: [{path: /}, {path: /tmp}]}\n"
        tmp = Path(config_path + ".new")
        tmp.write_text(text)
        tmp.replace(config_path)
        deadline = time.monotonic() + 20
        while True:
            doc = json.loads(fetch(port, "/status"))
            subjects = {f["subject"] for f in doc["findings"] if f["check"] == "storage.space"}
            if "/tmp" in subjects:
                break
            assert time.monotonic() < deadline, doc["agent"]
            time.sleep(0.3)
        assert doc["agent"]["config_reloads"]["ok"] == 1

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - started < 5.0
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.system
def test_json_logs(tmp_path: Path) -> None:
    config_path = write(tmp_path, "http: {address: 127.0.0.1, port: 0}\nlogging: {format: json}\n")
    proc = subprocess.Popen(
        [*CLI, "run", "--no-kube", "--config", config_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        entry = json.loads(line)
        assert entry["level"] == "info" and "serving on" in entry["msg"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
