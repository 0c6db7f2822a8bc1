"""Site checks with real scripts: each exit status, a signal, a hang past the deadline beside a check it must not
delay, output past the cap, control characters, a command that does not exist; the category a check counts
under; the bad configs (exit 2 naming the key); and the two examples of docs/probes/site.md, run for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import check_json, node_env
from support.processes import stop

from agent.config import parse_config
from agent.scheduler import probe_context
from probes import all_probes
from probes.base import Finding
from probes.runtime.host import Host
from probes.site.site import SiteProbe

EXAMPLES = Path(__file__).parent / "examples"
CLI = [sys.executable, "-m", "agent.cli"]


def script(directory: Path, name: str, body: str) -> str:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def run_sites(sites: list[dict[str, Any]], timeout: float = 65.0) -> tuple[dict[str, Finding], float]:
    """One run of the site probe over `sites` (the config's list), as the scheduler runs it: its findings by
    check, and how long the run took."""
    config = parse_config({"site_checks": sites}, all_probes())
    probe = SiteProbe()
    probe.configure(config)
    started = time.monotonic()
    output = probe.run(probe_context(Host(), config, timeout))
    elapsed = time.monotonic() - started
    findings = {item.check: item for item in output if isinstance(item, Finding)}
    assert set(findings) == set(probe.checks) == {f"site.{site['name']}" for site in sites}
    return findings, elapsed


def test_exit_statuses_signals_and_missing_commands(tmp_path: Path) -> None:
    sites = [
        {"name": "ok", "command": [script(tmp_path, "ok", "echo all good")], "category": "npu"},
        {"name": "warn", "command": [script(tmp_path, "warn", "echo look at this; exit 1")], "fix": "call Bob"},
        {"name": "fail", "command": [script(tmp_path, "fail", "echo broken >&2; exit 2")], "category": "storage"},
        {"name": "three", "command": [script(tmp_path, "three", "echo confused; exit 3")], "required": True},
        {"name": "killed", "command": [script(tmp_path, "killed", "kill -9 $$")]},
        {"name": "missing", "command": [str(tmp_path / "no-such-script")]},
        {"name": "silent", "command": [script(tmp_path, "silent", "exit 2")]},
    ]
    found, _ = run_sites(sites)
    seen = {check: (f.status.value, f.reason, f.message, f.category) for check, f in found.items()}
    assert seen["site.ok"] == ("ok", "OK", "all good", "npu")
    assert seen["site.warn"] == ("warn", "SiteCheckWarn", "look at this", "host")
    assert found["site.warn"].hint == "call Bob"
    assert seen["site.fail"] == ("fail", "SiteCheckFailed", "broken", "storage")  # stderr when stdout says nothing
    assert seen["site.three"][:2] == ("unknown", "SiteCheckBadExit") and "exit 3" in seen["site.three"][2]
    assert found["site.three"].required and not found["site.warn"].required
    assert seen["site.killed"][:2] == ("unknown", "SiteCheckKilled") and "SIGKILL" in seen["site.killed"][2]
    assert seen["site.missing"][:2] == ("unknown", "SiteCheckNotRunnable")
    assert seen["site.silent"][:3] == ("fail", "SiteCheckFailed", "exit 2")


def test_a_hang_is_unknown_at_its_deadline_and_delays_no_other_check(tmp_path: Path) -> None:
    sites = [
        {"name": "hang", "command": [script(tmp_path, "hang", "echo waiting; exec sleep 600")], "timeout_seconds": 2},
        {"name": "quick", "command": [script(tmp_path, "quick", "echo fine")]},
    ]
    found, elapsed = run_sites(sites)
    hang, quick = found["site.hang"], found["site.quick"]
    assert (hang.status.value, hang.reason) == ("unknown", "SiteCheckTimeout")
    assert "deadline of 2s" in hang.message and hang.message.endswith(": waiting")
    assert quick.status.value == "ok" and quick.observed["duration_seconds"] < 1.5  # not behind the hang
    assert 2 <= elapsed < 10  # the hang's deadline, not 600 s
    stray = subprocess.run(["pgrep", "-f", str(tmp_path / "hang")], capture_output=True, text=True)
    assert stray.stdout == ""  # its process group was killed


def test_huge_output_is_capped_and_control_characters_are_escaped(tmp_path: Path) -> None:
    flood = script(tmp_path, "flood", "echo first line; exec yes 'more output'")
    hostile = script(tmp_path, "hostile", r"printf 'bad \033[2J\033]0;owned\007 thing\r\nsecond line\n'; exit 2")
    found, elapsed = run_sites(
        [
            {"name": "flood", "command": [flood], "output_cap_bytes": 4096},
            {"name": "hostile", "command": [hostile]},
        ]
    )
    flooded = found["site.flood"]
    assert (flooded.status.value, flooded.reason) == ("unknown", "SiteCheckOutputCapped")
    assert flooded.message == "wrote more than 4096 bytes (killed): first line"
    assert elapsed < 10
    bad = found["site.hostile"]
    assert bad.status.value == "fail" and bad.message == "bad \\x1b[2J\\x1b]0;owned\\x07 thing"
    assert bad.message.isprintable() and "second line" not in bad.message


def test_a_check_counts_under_its_category_and_not_due_checks_keep_their_result(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    counting = script(tmp_path, "count", f"echo x >> {counter}; echo counted; exit 2")
    sites = [{"name": "count", "command": [counting], "category": "network", "interval_seconds": 600}]
    config = parse_config({"site_checks": sites}, all_probes())
    probe = SiteProbe()
    probe.configure(config)
    for _ in range(3):
        output = probe.run(probe_context(Host(), config, 65.0))
    assert counter.read_text().count("x") == 1  # due once in 600 s
    finding = output[0]
    assert isinstance(finding, Finding) and finding.category == "network" and finding.reason == "SiteCheckFailed"


def test_through_the_cli_a_failing_site_check_blocks_its_category(tmp_path: Path) -> None:
    failing = script(tmp_path, "fail", "echo hccn broken; exit 2")
    document = check_json(
        {"site_checks": [{"name": "rule", "command": [failing], "category": "network", "fix": "fix hccn"}]},
        tmp_path,
        "--only",
        "site",
    )
    assert document["ready"] is False
    assert [(r["check"], r["reason"], r["message"], r["hint"]) for r in document["reasons"]] == [
        ("site.rule", "SiteCheckFailed", "hccn broken", "fix hccn")
    ]
    assert [f["category"] for f in document["findings"]] == ["network"]


@pytest.mark.parametrize(
    ("entry", "key", "words"),
    [
        ({"name": "x", "command": ["/bin/true"], "category": "gpuu"}, "site_checks[0].category", "unknown category"),
        ({"name": "x"}, "site_checks[0].command", "required"),
        ({"name": "x", "command": []}, "site_checks[0].command", "at least 1"),
        ({"name": "x", "command": ["/bin/true"], "interval_seconds": 5}, "site_checks[0].interval_seconds", "10"),
        ({"name": "X Y", "command": ["/bin/true"]}, "site_checks[0].name", "pattern"),
        (
            {"name": "x", "command": ["/bin/true"], "timeout_seconds": 30, "interval_seconds": 20},
            "site_checks[0]",
            "shorter",
        ),
        ({"name": "x", "command": ["/bin/true"], "output_cap_bytes": 10}, "site_checks[0].output_cap_bytes", "1024"),
        ({"name": "x", "command": ["/bin/true"], "shell": "echo"}, "site_checks[0].shell", "unknown key"),
    ],
)
def test_a_bad_site_check_is_a_config_error_naming_the_key(
    tmp_path: Path, entry: dict[str, Any], key: str, words: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"site_checks": [entry]}))
    done = subprocess.run([*CLI, "config", "--validate", str(path)], capture_output=True, text=True, env=node_env())
    assert done.returncode == 2, done.stdout
    assert f"config key {key}" in done.stderr and words in done.stderr, done.stderr


def test_a_name_given_twice_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    twice = [{"name": "x", "command": ["/bin/true"]}, {"name": "x", "command": ["/bin/false"]}]
    path.write_text(yaml.safe_dump({"site_checks": twice}))
    done = subprocess.run([*CLI, "check", "--config", str(path)], capture_output=True, text=True, env=node_env())
    assert done.returncode == 2 and "config key site_checks" in done.stderr and "given twice" in done.stderr


# --- the examples of docs/probes/site.md ----------------------------------------------------------------------------


def test_the_driver_pin_example(tmp_path: Path) -> None:
    version = tmp_path / "sys/module/nvidia/version"
    version.parent.mkdir(parents=True)
    version.write_text("550.54.15\n")
    pin = str(EXAMPLES / "driver-pin.sh")

    def site(pinned: str, path: Path = version) -> dict[str, Any]:
        return {"name": f"pin-{pinned.replace('.', '-')}", "command": [pin, str(path), pinned], "category": "gpu"}

    found, _ = run_sites([site("550.54.15"), site("550.54.16"), site("1.0", tmp_path / "none")])
    assert (found["site.pin-550-54-15"].status.value, found["site.pin-550-54-15"].message) == (
        "ok",
        "driver 550.54.15, as pinned",
    )
    other = found["site.pin-550-54-16"]
    assert (other.status.value, other.message) == ("fail", "driver 550.54.15 loaded, this site pins 550.54.16")
    assert other.category == "gpu"
    none = found["site.pin-1-0"]
    assert none.status.value == "fail" and none.message.startswith("no driver loaded")


def test_the_hccn_rule_example(tmp_path: Path) -> None:
    rule = str(EXAMPLES / "hccn-rule.sh")
    whole = "".join(
        f"address_{i}=192.168.10{i}.10\nnetmask_{i}=255.255.255.0\nnetdetect_{i}=192.168.10{i}.1\n" for i in range(8)
    )
    (tmp_path / "whole.conf").write_text(whole)
    (tmp_path / "nodetect.conf").write_text(whole.replace("netdetect_3=", "# netdetect_3="))
    (tmp_path / "noaddress.conf").write_text(whole.replace("address_5=", "#address_5="))
    sites = [
        {"name": name, "command": [rule, str(tmp_path / f"{name}.conf"), "8"], "category": "network"}
        for name in ("whole", "nodetect", "noaddress")
    ]
    found, _ = run_sites(sites)
    assert found["site.whole"].status.value == "ok"
    assert (found["site.nodetect"].status.value, found["site.nodetect"].message) == (
        "warn",
        f"no netdetect_N in {tmp_path}/nodetect.conf for NPU 3",
    )
    assert found["site.noaddress"].status.value == "fail" and found["site.noaddress"].message.endswith("NPU 5")


# --- in a running agent -------------------------------------------------------------------------------------------


@pytest.mark.system
def test_in_a_real_agent_a_hung_site_check_delays_neither_ready_nor_another_check(tmp_path: Path) -> None:
    hang = script(tmp_path, "hang", "exec sleep 600")
    flag = tmp_path / "flag"
    toggled = script(tmp_path, "toggle", f'if [ -e {flag} ]; then echo "flag set"; exit 2; fi; echo clear')
    config = {
        "http": {"address": "127.0.0.1", "port": 0, "metrics_port": 0},
        "logging": {"format": "json"},
        "health": {"fail_threshold": 1, "recovery_threshold": 1},
        "site_checks": [
            {"name": "hang", "command": [hang], "timeout_seconds": 3, "interval_seconds": 10},
            {
                "name": "toggle",
                "command": [toggled],
                "category": "network",
                "interval_seconds": 10,
                "timeout_seconds": 5,
            },
        ],
        "probes": {name: {"enabled": name == "site"} for name in all_probes()},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        agent = subprocess.Popen(
            [*CLI, "run", "--no-kube", "--config", str(path)], stdout=sink, stderr=subprocess.STDOUT, env=node_env()
        )
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"serving on 127\.0\.0\.1:(\d+) /ready", log.read_text())):
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        port = int(match.group(1))
        answers = []
        while True:  # /ready answers at once throughout, while the hang runs to its deadline
            started = time.monotonic()
            status, body = get(port, "/ready?checks=site.toggle")
            answers.append(time.monotonic() - started)
            if status == 200:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
        assert max(answers) < 1.0, answers
        checks = wait_status(port, lambda c: c.get("site.hang", {}).get("reason") == "SiteCheckTimeout", deadline)
        assert checks["site.toggle"]["status"] == "ok" and checks["site.toggle"]["category"] == "network"
        assert checks["site.hang"]["status"] == "unknown"
    finally:
        stop(agent)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_status(port: int, done: Any, deadline: float) -> dict[str, dict[str, Any]]:
    while True:
        checks = {f["check"]: f for f in json.loads(get(port, "/status")[1])["findings"]}
        if done(checks):
            return checks
        assert time.monotonic() < deadline, checks
        time.sleep(0.2)
