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

from agent.cli import cpu_line, main
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
        "health_port": 9102,
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
    assert result.stdout.splitlines()[-3].startswith("cpu: ")  # the container's limit and throttling

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
    assert doc["cpu"]["mode"] in ("quota", "weight", "off") and "limit_millicores" in doc["cpu"]

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


def test_check_shows_the_limit_and_both_cgroups_throttling() -> None:
    assert cpu_line({"mode": "off", "limit_millicores": None}) == "cpu: no CPU limit"
    status = {
        "mode": "quota",
        "limit_millicores": 500,
        "work_millicores": 400,
        "container": {"periods": 600, "throttled_periods": 3, "throttled_seconds": 0.041},
        "work": {"periods": 3000, "throttled_periods": 240, "throttled_seconds": 2.4},
    }
    assert cpu_line(status) == (
        "cpu: limit 500m; agent's cgroup throttled in 3 of 600 periods (0.041 s); "
        "children's work cgroup (400m) throttled in 240 of 3000 periods (2.4 s)"
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "health: {required_checks: [storage.mount]}\n",
            "config key health.required_checks[0]: 'storage.mount' is no declared check or category "
            "(did you mean 'storage.mounts'?)",
        ),
        ("kubernetes: {disabled_checks: [npu, netwrk]}\n", "kubernetes.disabled_checks[1]: 'netwrk' is no declared"),
        ("kubernetes: {disabled_reasons: [DiskFul]}\n", "(did you mean 'DiskFull'?)"),
        ("kubernetes: {effects: {NpuHealthAlarn: None}}\n", "kubernetes.effects.NpuHealthAlarn: 'NpuHealthAlarn'"),
        (
            "kubernetes: {dryrun: true}\n",
            "config key kubernetes.dryrun: unknown key under kubernetes (did you mean 'dry_run'?)",
        ),
        ("probes: {npu: {intervl_seconds: 3}}\n", "probes.npu.intervl_seconds: unknown key under probes.npu (did you"),
    ],
)
def test_validate_names_what_selects_nothing_with_a_did_you_mean(tmp_path: Path, text: str, named: str) -> None:
    """Field failure: `required_checks: [storage.mount]` was "valid" and silently required nothing."""
    done = run_cli("config", "--validate", write(tmp_path, text))
    assert done.returncode == 2, done.stdout
    assert named in done.stderr, done.stderr


def test_declared_names_and_categories_are_valid(tmp_path: Path) -> None:
    text = (
        "health: {required_checks: [storage.mounts, npu, host, time.sync]}\n"
        "kubernetes: {disabled_checks: [network, storage.locks], disabled_reasons: [DiskFull, WarmingUp], "
        "effects: {NpuHealthAlarm: None, ParseError: None}}\n"
    )
    done = run_cli("config", "--validate", write(tmp_path, text))
    assert done.returncode == 0, done.stderr


def test_the_daemon_warns_and_counts_names_that_select_nothing(tmp_path: Path) -> None:
    """The daemon keeps running on such a config (a rollback must not crash-loop), with a warning line and the
    nodehealth_config_unknown_keys gauge counting each name."""
    from agent.config import load_config_tolerant
    from agent.daemon import Agent

    path = write(tmp_path, "health: {required_checks: [storage.mount]}\nkubernetes: {disabled_reasons: [DiskFul]}\n")
    config, notes = load_config_tolerant(path, all_probes())
    warnings = notes.warnings()
    assert len(warnings) == 2 and "'storage.mount' is no declared check" in warnings[0], warnings
    assert "did you mean 'DiskFull'?" in warnings[1], warnings
    agent = Agent(path, config, no_kube=True)
    gauge = next(s for s in agent._agent_samples() if s.name == "nodehealth_config_unknown_keys")
    assert gauge.value == 2
