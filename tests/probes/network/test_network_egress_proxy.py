"""network.egress through a proxy that wants credentials: a real authenticating HTTP proxy (CONNECT and forward
GET) on 127.0.0.1, credentials from the proxy URL or from a file as a Secret is mounted, and the password
looked for in every output a test can reach: the finding, `check --json`, the daemon's log and /status, and
config errors (CLI exit 2)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cli import node_env
from support.netservers import ConnectProxy, HttpTestServer, make_self_signed, servers
from support.system import REPO, require_tool

from agent.config import ConfigError, parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.egress import EgressProbe
from probes.network.proxy import parse_proxy
from probes.runtime.host import Host

USER, PASSWORD = "svc-node", "s3cr3t:p@ss/w0rd"  # a colon, an @ and a slash, as people's passwords have
ENCODED = "s3cr3t%3Ap%40ss%2Fw0rd"  # percent-encoded for the URL's userinfo
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
SECRETS = (PASSWORD, ENCODED, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())


@dataclass
class ProxyLab:
    proxy: ConnectProxy
    http: HttpTestServer
    https: HttpTestServer
    cert: Path
    good_file: Path
    wrong_file: Path

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.proxy.port}"

    @property
    def shown(self) -> str:
        return f"http://***@127.0.0.1:{self.proxy.port}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyLab]:
    require_tool("openssl")
    directory = tmp_path_factory.mktemp("proxy")
    cert, key = make_self_signed(directory, "mirror.test")
    good, wrong = directory / "good", directory / "wrong"
    good.write_text(f"{USER}:{PASSWORD}\n")  # as a Secret's key is mounted: one line, maybe a newline
    wrong.write_text(f"{USER}:expired\n")
    with servers() as started:
        http = HttpTestServer({"/": 200, "/simple/": 200})
        https = HttpTestServer({"/": 200}, tls=(cert, key))
        routes = {"mirror.test": https.port, "plain.test": http.port}
        proxy = ConnectProxy(routes, auth_realm="corp-proxy", credentials=f"{USER}:{PASSWORD}")
        started.extend([http, https, proxy])
        yield ProxyLab(proxy, http, https, cert, good, wrong)


def run_egress(targets: list[dict[str, Any]]) -> dict[str, Finding]:
    out = EgressProbe().run(ProbeContext(Host(), parse_config({"network": {"egress": targets}}), 10.0))
    return {f.subject: f for f in out if isinstance(f, Finding)}


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"the proxy password shows: {text[:2000]}"


def targets(lab: ProxyLab) -> list[dict[str, Any]]:
    tls = {"host": "mirror.test", "port": 443, "http_path": "/", "ca_file": str(lab.cert)}
    plain = {"host": "plain.test", "port": 80, "tls": False, "http_path": "/simple/"}
    return [
        {**tls, "name": "url-userinfo", "proxy": lab.url(f"{USER}:{ENCODED}")},
        {**tls, "name": "secret-file", "proxy": lab.url(), "proxy_credentials_file": str(lab.good_file)},
        {**plain, "name": "plain-forwarded", "proxy": lab.url(), "proxy_credentials_file": str(lab.good_file)},
        {**tls, "name": "wrong-file", "proxy": lab.url(), "proxy_credentials_file": str(lab.wrong_file)},
        {**plain, "name": "plain-wrong", "proxy": lab.url(f"{USER}:nope")},
        {**tls, "name": "no-credentials", "proxy": lab.url()},
        {**tls, "name": "missing-file", "proxy": lab.url(), "proxy_credentials_file": str(lab.good_file) + ".gone"},
    ]


@pytest.mark.system
def test_credentials_from_the_url_or_a_secret_file_are_sent_and_never_shown(lab: ProxyLab) -> None:
    found = run_egress(targets(lab))
    for name in ("url-userinfo", "secret-file", "plain-forwarded"):
        finding = found[name]
        assert finding.status is Status.OK, finding
        assert finding.observed["http_status"] == 200 and finding.observed["proxy"] == lab.shown
    assert (found["url-userinfo"].observed["phases"].keys() >= {"proxy", "tls"}) and "proxy" not in found[
        "plain-forwarded"
    ].observed["phases"]  # plain HTTP is forwarded (GET http://...), not tunnelled
    seen = {(method, target) for method, target, authorization in lab.proxy.seen if authorization == BASIC}
    assert ("CONNECT", "mirror.test:443") in seen
    assert ("GET", "http://plain.test/simple/") in seen
    for finding in found.values():
        assert_no_secret(json.dumps(finding.to_dict()))


@pytest.mark.system
def test_refused_or_missing_credentials_are_told_as_such(lab: ProxyLab) -> None:
    found = run_egress(targets(lab))
    wrong = found["wrong-file"]
    assert (wrong.status, wrong.reason, wrong.observed["proxy_status"]) == (Status.FAIL, "EgressProxyAuthRequired", 407)
    assert "the credentials from proxy_credentials_file were refused" in wrong.message
    assert wrong.observed["proxy_credentials"] == "proxy_credentials_file"
    assert wrong.observed["proxy_authenticate"] == 'Basic realm="corp-proxy"'
    plain = found["plain-wrong"]
    assert (plain.reason, plain.observed["proxy_credentials"]) == ("EgressProxyAuthRequired", "url")
    assert "the credentials from the proxy URL were refused" in plain.message and "GET http://plain.test/" in (
        plain.message
    )
    none = found["no-credentials"]
    assert none.reason == "EgressProxyAuthRequired" and "no credentials are configured" in none.message
    assert "proxy_credentials_file" in none.hint and "Secret" in none.hint
    missing = found["missing-file"]
    assert (missing.status, missing.reason) == (Status.UNKNOWN, "EgressProxyCredentialsUnreadable")
    assert "cannot read proxy_credentials_file" in missing.message
    assert missing.observed["proxy"] == f"http://127.0.0.1:{lab.proxy.port}"
    for name in ("wrong-file", "plain-wrong", "no-credentials"):
        assert lab.shown in found[name].message or lab.url() in found[name].message
    for finding in found.values():
        assert_no_secret(json.dumps(finding.to_dict()))


def test_proxy_url_parsing() -> None:
    proxy = parse_proxy(f"http://{USER}:{ENCODED}@proxy.example:3128/")
    assert (proxy.host, proxy.port, proxy.userinfo) == ("proxy.example", 3128, f"{USER}:{PASSWORD}")
    assert proxy.shown == "http://***@proxy.example:3128" and PASSWORD not in repr(proxy)
    assert parse_proxy("http://[fd00::1]").shown == "http://[fd00::1]:3128"
    assert parse_proxy("http://proxy.example:8080").authorization() == ""


@pytest.mark.parametrize(
    ("target", "key"),
    [
        ({"proxy": f"http://{USER}:{PASSWORD}@proxy.example:99999"}, "network.egress[0].proxy"),
        ({"proxy": f"http://{ENCODED}@proxy.example"}, "network.egress[0].proxy"),  # no user:
        (
            {"proxy": f"http://{USER}:{PASSWORD}@proxy:3128", "proxy_credentials_file": "/secret/proxy"},
            "network.egress[0].proxy_credentials_file",
        ),
        ({"proxy_credentials_file": "/secret/proxy"}, "network.egress[0].proxy_credentials_file"),
    ],
)
def test_config_errors_name_the_key_and_never_the_password(target: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"network": {"egress": [{"host": "x", **target}]}})
    assert key in str(info.value)
    assert_no_secret(str(info.value))


CLI = [sys.executable, "-m", "agent.cli"]


def test_cli_refuses_userinfo_and_file_together_with_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    target = {"host": "x", "proxy": f"http://{USER}:{PASSWORD}@proxy:3128", "proxy_credentials_file": "/s/p"}
    path.write_text(yaml.safe_dump({"network": {"egress": [target]}}))
    for args in (["config", "--validate", str(path)], ["check", "--config", str(path)]):
        result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=node_env(), cwd=REPO)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "network.egress[0].proxy_credentials_file" in result.stderr
        assert_no_secret(result.stdout + result.stderr)


@pytest.mark.system
def test_check_json_the_daemons_log_and_status_never_show_the_password(lab: ProxyLab, tmp_path: Path) -> None:
    config = {
        "http": {"address": "127.0.0.1", "port": 0, "metrics_port": 0},
        "network": {"egress": targets(lab)},
        "kubernetes": {"enabled": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [*CLI, "check", "--json", "--config", str(path), "--only", "network.egress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=node_env(),
        cwd=REPO,
    )
    document = json.loads(check.stdout)
    found = {f["subject"]: f for f in document["findings"] if f["check"] == "network.egress"}
    assert found["url-userinfo"]["status"] == "ok" and found["wrong-file"]["reason"] == "EgressProxyAuthRequired"
    assert_no_secret(check.stdout + check.stderr)

    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [*CLI, "run", "--no-kube", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT, env=node_env()
        )
    try:
        status = wait_for(daemon, log, lambda doc: egress_subjects(doc) >= set(found))
        assert {f["reason"] for f in status["findings"] if f["check"] == "network.egress"} >= {
            "OK",
            "EgressProxyAuthRequired",
        }
        # A reload the daemon refuses (userinfo and a file together) is told in /status, without the password.
        bad = {**config, "network": {"egress": [{**targets(lab)[0], "proxy_credentials_file": str(lab.good_file)}]}}
        path.write_text(yaml.safe_dump(bad))
        os.kill(daemon.pid, signal.SIGHUP)
        status = wait_for(daemon, log, lambda doc: doc["agent"].get("last_reload_error"))
        assert "proxy_credentials_file" in str(status["agent"]["last_reload_error"])
        assert_no_secret(json.dumps(status))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=20)
    assert "serving on" in log.read_text()
    assert_no_secret(log.read_text())


def status_port(log: Path) -> int | None:
    for line in log.read_text().splitlines():
        if "serving on " in line:
            return int(line.rsplit(":", 1)[1].split()[0].strip("'\",)"))
    return None


def wait_for(daemon: subprocess.Popen[bytes], log: Path, ready: Any, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.poll() is None, log.read_text()[-3000:]
        port = status_port(log)
        if port is not None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
                doc = dict(json.loads(response.read()))
            if ready(doc):
                return doc
        time.sleep(0.3)
    raise AssertionError(f"no such /status within {timeout:g} s: {log.read_text()[-3000:]}")


def egress_subjects(status: dict[str, Any]) -> set[str]:
    return {f["subject"] for f in status["findings"] if f["check"] == "network.egress"}
