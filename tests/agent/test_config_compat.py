"""Config forward compatibility (agent/configcompat.py): a rollback under a ConfigMap written for a newer release.

The shipped ConfigMap as 0.3 would ship it (`config_version: "0.3"`, a key in an agent section and a whole
family only 0.3 knows) is given to today's code: `node-health run` starts, serves and lists what it ignored in
/status, /metrics and its log; a reload to such a file is accepted; `config --validate` and `check` still exit 2
naming the key, and say the file was written for a newer release.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.system import REPO

from agent.config import ConfigError, parse_config, parse_config_tolerant
from agent.configcompat import ConfigNotes, release_tuple
from agent.version import __version__
from probes import all_probes
from probes.storage.config import StorageConfig

CLI = [sys.executable, "-m", "agent.cli"]
CONFIGMAP = REPO / "deploy" / "configmap.yaml"
NEWER = "0.3"
# Keys only "0.3" knows: one in an agent section, one in a family's list items, a family of its own.
NEW_KEYS = ("kubernetes.uninstall_flag", "storage.space[0].reserve_percent", "accelerator_ledger")


def shipped() -> dict[str, Any]:
    configmap = yaml.safe_load(CONFIGMAP.read_text())
    return dict(yaml.safe_load(configmap["data"]["config.yaml"]))


def written_for_0_3(space_path: str) -> dict[str, Any]:
    """The shipped config as a 0.3 ConfigMap would have it, made runnable on this machine (no Kubernetes, a
    loopback port, only storage.space)."""
    config = shipped()
    config["config_version"] = NEWER
    config["kubernetes"]["enabled"] = False
    config["kubernetes"]["uninstall_flag"] = False
    config["http"] = {"address": "127.0.0.1", "port": 0}
    config["logging"] = {"format": "text", "level": "info"}
    config["host"] = {"proc": "/proc", "sys": "/sys", "dev": "/dev", "root": "/"}
    config["probes"] = {name: {"enabled": name == "storage.space"} for name in all_probes()}
    config["storage"]["space"] = [{"path": space_path, "reserve_percent": 5}]
    config["accelerator_ledger"] = {"enabled": True}
    return config


def test_the_shipped_config_is_for_this_release() -> None:
    config = shipped()
    assert release_tuple(config["config_version"]) <= release_tuple(__version__)
    notes = parse_config_tolerant(config, all_probes())[1]
    assert notes == ConfigNotes((), config["config_version"]) and notes.warnings() == []


def test_keys_of_a_newer_release_are_set_aside_with_a_warning(tmp_path: Path) -> None:
    config, notes = parse_config_tolerant(written_for_0_3(str(tmp_path)), all_probes())
    assert sorted(notes.unknown_keys) == sorted(NEW_KEYS)
    assert notes.newer
    assert config.kubernetes.enabled is False  # the rest of the section is in force
    assert config.section(StorageConfig).space[0].path == str(tmp_path)
    for key, warning in zip(notes.unknown_keys, notes.warnings(), strict=True):
        assert warning == (
            f"config key {key}: unknown to node-health {__version__}, ignored "
            f"(the file says config_version {NEWER}: written for a newer release)"
        )


def test_strict_parsing_still_names_the_key_and_the_release(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(written_for_0_3(str(tmp_path)), all_probes())
    message = str(info.value)
    assert all(f"config key {key}: unknown key" in message for key in NEW_KEYS), message
    assert f"config_version {NEWER}: written for a newer release than node-health {__version__}" in message


def test_a_typo_without_config_version_is_called_one() -> None:
    _, notes = parse_config_tolerant({"kubernetes": {"dry_rnu": True}}, all_probes())
    assert notes.warnings() == [
        f"config key kubernetes.dry_rnu: unknown to node-health {__version__}, ignored "
        "(a typo? `node-health config --validate` names it)"
    ]
    _, notes = parse_config_tolerant({"probes": {"npu.ledger": {"enabled": True}}}, all_probes())
    assert notes.unknown_keys == ("probes.npu.ledger",)


@pytest.mark.parametrize(
    ("document", "key"),
    [
        ({"kubernetes": {"new_key": 1}, "logging": {"level": "loud"}}, "logging.level"),  # a real error stays one
        ({"config_version": "next"}, "config_version"),
        ({"config_version": True}, "config_version"),
        ({"config_version": [0, 3]}, "config_version"),
    ],
)
def test_values_are_still_validated(document: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config_tolerant(document, all_probes())
    assert f"config key {key}:" in str(info.value)


def test_release_comparison() -> None:
    assert release_tuple("0.3") == (0, 3, 0) and release_tuple(" 1 ") == (1, 0, 0)
    assert ConfigNotes(config_version="0.2").newer is False
    assert ConfigNotes(config_version="0.2.1").newer is True
    assert ConfigNotes(config_version="1").newer is True
    assert ConfigNotes(config_version="0.1.9").newer is False
    with pytest.raises(ValueError):
        release_tuple("0.3.1.2")
    with pytest.raises(ValueError):
        release_tuple("v0.3")


def test_validate_and_check_exit_2_on_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(written_for_0_3(str(tmp_path))))
    for args in (["config", "--validate", str(path)], ["check", "--config", str(path), "--only", "storage"]):
        done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "config key kubernetes.uninstall_flag: unknown key" in done.stderr
        assert "written for a newer release" in done.stderr


# --- the daemon: a rollback under the newer ConfigMap ------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(written_for_0_3(str(tmp_path))))
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*CLI, "run", "--no-kube", "--config", str(path)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not (match := re.search(r"serving on [^:\s]+:(\d+)", log.read_text())):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield process, int(match.group(1)), path
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def fetch(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return bytes(response.read())


@pytest.mark.system
def test_todays_agent_runs_under_a_configmap_written_for_0_3(
    daemon: tuple[subprocess.Popen[str], int, Path], tmp_path: Path
) -> None:
    process, port, path = daemon
    status = json.loads(fetch(port, "/status"))
    assert status["version"] == __version__
    agent = status["agent"]
    assert agent["config_version"] == NEWER
    assert sorted(agent["config_unknown_keys"]) == sorted(NEW_KEYS)
    assert all("written for a newer release" in warning for warning in agent["config_warnings"])
    assert f"nodehealth_config_unknown_keys {float(len(NEW_KEYS))}".encode() in fetch(port, "/metrics")
    log = (tmp_path / "agent.log").read_text()
    for key in NEW_KEYS:
        assert f"config key {key}: unknown to node-health {__version__}, ignored" in log
    # The rest of the file is in force: storage.space on the configured path answers.
    deadline = time.monotonic() + 30
    while not any(f["check"] == "storage.space" and f["status"] == "ok" for f in status["findings"]):
        assert time.monotonic() < deadline, status["findings"]
        time.sleep(0.3)
        status = json.loads(fetch(port, "/status"))

    # A reload to a file with one new key less is accepted (not rejected), and the list follows it.
    config = yaml.safe_load(path.read_text())
    del config["accelerator_ledger"]
    path.with_suffix(".new").write_text(yaml.safe_dump(config))
    path.with_suffix(".new").replace(path)
    os.kill(process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 15
    while (agent := json.loads(fetch(port, "/status"))["agent"])["config_reloads"]["ok"] < 1:
        assert agent["config_reloads"]["error"] == 0, agent
        assert time.monotonic() < deadline, agent
        time.sleep(0.2)
    assert sorted(agent["config_unknown_keys"]) == sorted(NEW_KEYS[:2])
    assert f"nodehealth_config_unknown_keys {float(len(NEW_KEYS) - 1)}".encode() in fetch(port, "/metrics")
