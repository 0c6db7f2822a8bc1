"""network.egress against real TCP, HTTP, HTTPS, CONNECT-proxy and DNS servers on 127.0.0.1, and a black
hole inside a network namespace the test creates (the probe runs there in a child via `ip netns exec`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.netservers import (
    ConnectProxy,
    DnsTestServer,
    HttpTestServer,
    Netns,
    SilentTcpServer,
    TcpAcceptServer,
    ZoneResolver,
    make_self_signed,
    refused_port,
    servers,
)
from support.system import REPO, require_root, require_tool

from agent.config import ConfigError, parse_config
from agent.scheduler import execute
from probes.base import Finding, ProbeContext, Sample, Status
from probes.network.egress import EgressProbe
from probes.runtime.host import Host


@dataclass
class Lab:
    dns: DnsTestServer
    tcp: TcpAcceptServer
    http: HttpTestServer
    https: HttpTestServer
    proxy: ConnectProxy
    cert: Path


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_tool("openssl")
    cert, key = make_self_signed(tmp_path_factory.mktemp("tls"), "mirror.test")
    with servers() as started:
        dns = DnsTestServer(ZoneResolver({"mirror.test": "127.0.0.1"}, nxdomain=("gone.test",)))
        tcp = TcpAcceptServer()
        http = HttpTestServer({"/": 200, "/simple/": 503, "/private/": 403})
        https = HttpTestServer({"/": 200, "/simple/": 503}, tls=(cert, key))
        proxy = ConnectProxy({"mirror.test": https.port})
        started.extend([dns, tcp, http, https, proxy])
        yield Lab(dns, tcp, http, https, proxy, cert)


def run_egress(
    lab: Lab, targets: list[dict[str, Any]], timeout: float = 10.0
) -> tuple[dict[str, Finding], list[Sample]]:
    config = parse_config({"network": {"dns": {"nameservers": [lab.dns.address]}, "egress": targets}})
    out = EgressProbe().run(ProbeContext(Host(), config, timeout))
    findings = {f.subject: f for f in out if isinstance(f, Finding)}
    assert len(findings) == len(targets)
    return findings, [s for s in out if isinstance(s, Sample)]


@pytest.mark.system
def test_plain_tcp_and_http_ok(lab: Lab) -> None:
    findings, samples = run_egress(
        lab,
        [
            {"name": "tcp", "host": "127.0.0.1", "port": lab.tcp.port, "tls": False},
            {"name": "http", "host": "mirror.test", "port": lab.http.port, "tls": False, "http_path": "/"},
        ],
    )
    assert findings["tcp"].status is Status.OK and findings["tcp"].observed["address"] == "127.0.0.1"
    http = findings["http"]
    assert http.status is Status.OK and http.observed["http_status"] == 200
    assert http.observed["address"] == "127.0.0.1"  # resolved through the test DNS server
    names = {(s.name, s.labels["target"]) for s in samples}
    for target in ("tcp", "http"):
        assert ("nodehealth_network_egress_connect_seconds", target) in names
        assert ("nodehealth_network_egress_duration_seconds", target) in names


@pytest.mark.system
def test_mirror_answering_503_is_http_status(lab: Lab) -> None:
    findings, _ = run_egress(
        lab,
        [
            {"name": "pypi-mirror", "host": "127.0.0.1", "port": lab.http.port, "tls": False, "http_path": "/simple/"},
            {
                "name": "private",
                "host": "127.0.0.1",
                "port": lab.http.port,
                "tls": False,
                "http_path": "/private/",
                "expect_status": [200, 403],
            },
        ],
    )
    mirror = findings["pypi-mirror"]
    assert (mirror.status, mirror.reason) == (Status.FAIL, "EgressHttpStatus")
    assert "503" in mirror.message and mirror.observed["http_status"] == 503
    assert findings["private"].status is Status.OK


@pytest.mark.system
def test_tls_self_signed_is_tls_failed_and_trusted_with_ca_file(lab: Lab) -> None:
    target = {"host": "mirror.test", "port": lab.https.port, "http_path": "/"}
    findings, _ = run_egress(lab, [{**target, "name": "untrusted"}, {**target, "name": "ca", "ca_file": str(lab.cert)}])
    untrusted = findings["untrusted"]
    assert (untrusted.status, untrusted.reason) == (Status.FAIL, "EgressTlsFailed")
    assert "self-signed certificate" in untrusted.observed["tls_error"]
    assert "self-signed" in untrusted.message
    trusted = findings["ca"]
    assert trusted.status is Status.OK
    assert trusted.observed["tls_version"].startswith("TLS") and trusted.observed["http_status"] == 200


@pytest.mark.system
def test_tls_to_a_plain_http_port_and_wrong_hostname(lab: Lab) -> None:
    findings, _ = run_egress(
        lab,
        [
            {"name": "plain", "host": "127.0.0.1", "port": lab.http.port},
            # The certificate names mirror.test and 127.0.0.1; "localhost" is neither.
            {"name": "wrong-name", "host": "localhost", "port": lab.https.port, "ca_file": str(lab.cert)},
        ],
    )
    assert findings["plain"].reason == "EgressTlsFailed"
    assert findings["plain"].observed["tls_error"]  # e.g. WRONG_VERSION_NUMBER
    assert findings["wrong-name"].reason == "EgressTlsFailed"
    assert "localhost" in findings["wrong-name"].observed["tls_error"]


@pytest.mark.system
def test_refused_port_and_unresolvable_host(lab: Lab) -> None:
    port = refused_port()
    findings, _ = run_egress(
        lab,
        [
            {"host": "127.0.0.1", "port": port, "tls": False},
            {"host": "gone.test", "port": 443},
        ],
    )
    refused = findings[f"127.0.0.1:{port}"]  # no name: the subject is host:port
    assert (refused.status, refused.reason) == (Status.FAIL, "EgressRefused")
    assert "refused" in refused.message
    gone = findings["gone.test:443"]
    assert (gone.reason, gone.observed["dns_error"]) == ("EgressDnsFailed", "nxdomain")
    assert "NXDOMAIN" in gone.message


@pytest.mark.system
def test_https_through_connect_proxy(lab: Lab) -> None:
    findings, _ = run_egress(
        lab,
        [
            {
                "name": "via-proxy",
                "host": "mirror.test",
                "port": 443,
                "http_path": "/",
                "ca_file": str(lab.cert),
                "proxy": lab.proxy.url,
            },
            {
                "name": "via-proxy-503",
                "host": "mirror.test",
                "http_path": "/simple/",
                "ca_file": str(lab.cert),
                "proxy": lab.proxy.url,
            },
            {"name": "not-allowed", "host": "pypi.test", "port": 443, "proxy": lab.proxy.url},
        ],
    )
    assert findings["via-proxy"].status is Status.OK
    assert findings["via-proxy"].observed["proxy"] == lab.proxy.url
    assert findings["via-proxy-503"].reason == "EgressHttpStatus"
    denied = findings["not-allowed"]
    assert (denied.reason, denied.observed["proxy_status"]) == ("EgressRefused", 403)
    assert "403" in denied.message and "CONNECT pypi.test:443" in denied.message


@pytest.mark.system
def test_refused_proxy(lab: Lab) -> None:
    findings, _ = run_egress(
        lab, [{"name": "dead-proxy", "host": "mirror.test", "proxy": f"http://127.0.0.1:{refused_port()}"}]
    )
    assert findings["dead-proxy"].reason == "EgressRefused"
    assert "proxy" in findings["dead-proxy"].message


@pytest.mark.system
def test_proxy_asking_for_credentials_is_told_as_authentication_not_a_whitelist(lab: Lab) -> None:
    with servers() as started:
        proxy = ConnectProxy({"mirror.test": lab.https.port}, auth_realm="corp-proxy")
        started.append(proxy)
        findings, _ = run_egress(lab, [{"name": "auth", "host": "mirror.test", "proxy": proxy.url}])
    auth = findings["auth"]
    assert (auth.status, auth.reason) == (Status.FAIL, "EgressProxyAuthRequired")
    assert (auth.observed["phase"], auth.observed["proxy_status"]) == ("proxy", 407)
    assert auth.observed["proxy_authenticate"] == 'Basic realm="corp-proxy"'
    assert "407 Proxy Authentication Required" in auth.message and "CONNECT mirror.test:443" in auth.message
    assert "proxy authentication required" in auth.hint and "credentials" in auth.hint
    assert "whitelist" not in auth.hint and "allow-list" not in auth.hint


@pytest.mark.system
def test_proxy_that_takes_the_connect_and_never_answers_is_a_stalled_proxy_not_a_firewall(lab: Lab) -> None:
    with servers() as started:
        proxy = ConnectProxy({"mirror.test": lab.https.port}, stall_hosts=("slow.test",))
        started.append(proxy)
        started_at = time.monotonic()
        findings, _ = run_egress(
            lab, [{"name": "stall", "host": "slow.test", "proxy": proxy.url, "timeout_seconds": 1.0}], timeout=5.0
        )
        elapsed = time.monotonic() - started_at
    stalled = findings["stall"]
    assert (stalled.status, stalled.reason, stalled.observed["phase"]) == (Status.FAIL, "EgressProxyStalled", "proxy")
    assert "accepted the connection but did not answer CONNECT slow.test:443" in stalled.message
    assert "the proxy is stalled or filtering" in stalled.hint and "check the proxy" in stalled.hint
    assert "firewall" not in stalled.hint
    assert elapsed < 3.0  # the target's own timeout, not the probe's


def test_proxy_must_be_http_url() -> None:
    with pytest.raises(ConfigError, match=r"network\.egress\[0\]\.proxy"):
        parse_config({"network": {"egress": [{"host": "x", "proxy": "socks5://127.0.0.1:1080"}]}})


BLACKHOLE_SNIPPET = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {repo!r})
    from agent.config import parse_config
    from probes.runtime.host import Host
    from probes.base import Finding, ProbeContext
    from probes.network.egress import EgressProbe
    config = parse_config({{"network": {{"egress": {targets!r}}}}})
    started = time.monotonic()
    out = EgressProbe().run(ProbeContext(Host(), config, {timeout!r}))
    print(json.dumps({{"elapsed": time.monotonic() - started,
                       "findings": [f.to_dict() for f in out if isinstance(f, Finding)]}}))
    """
)


@pytest.fixture
def blackhole_netns() -> Iterator[Netns]:
    """192.0.2.2 behind a veth with a permanent neighbour entry: SYNs leave and nothing ever answers.
    198.51.100.0/24 is a blackhole route, 203.0.113.0/24 an unreachable route. Only inside this namespace."""
    require_root()
    require_tool("ip")
    ns = Netns()
    try:
        ns.ip("link", "add", "bh0", "type", "veth", "peer", "name", "bh1")
        ns.ip("addr", "add", "192.0.2.1/24", "dev", "bh0")
        ns.ip("link", "set", "bh0", "up")
        ns.ip("link", "set", "bh1", "up")
        ns.ip("neigh", "add", "192.0.2.2", "lladdr", "02:00:00:00:00:02", "dev", "bh0", "nud", "permanent")
        ns.ip("route", "add", "blackhole", "198.51.100.0/24")
        ns.ip("route", "add", "unreachable", "203.0.113.0/24")
        yield ns
    finally:
        ns.close()


@pytest.mark.system
def test_black_hole_is_a_timeout_within_the_deadline(blackhole_netns: Netns) -> None:
    targets = [
        {"name": "dropped", "host": "192.0.2.2", "port": 443, "timeout_seconds": 1.0},
        {"name": "dropped-long", "host": "192.0.2.2", "port": 80, "tls": False, "timeout_seconds": 30.0},
        {"name": "blackhole-route", "host": "198.51.100.7", "port": 443},
        {"name": "unreachable-route", "host": "203.0.113.5", "port": 443},
    ]
    snippet = BLACKHOLE_SNIPPET.format(repo=str(REPO), targets=targets, timeout=2.0)
    started = time.monotonic()
    result = blackhole_netns.exec([sys.executable, "-c", snippet], timeout=60)
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    findings = {f["subject"]: f for f in report["findings"]}
    dropped = findings["dropped"]
    assert (dropped["status"], dropped["reason"], dropped["observed"]["phase"]) == ("fail", "EgressTimeout", "connect")
    # The target's own 30 s is cut to the probe's 2 s deadline, and the message says so.
    assert findings["dropped-long"]["reason"] == "EgressTimeout"
    assert "cut from timeout_seconds 30 s" in findings["dropped-long"]["message"]
    assert findings["dropped-long"]["observed"]["deadline_seconds"] < 2.0
    assert report["elapsed"] < 2.5, report
    assert wall < 30
    assert findings["blackhole-route"]["reason"] == "EgressRefused"
    assert findings["blackhole-route"]["observed"]["errno"] == "EINVAL"
    assert "blackhole" in findings["blackhole-route"]["message"]
    assert findings["unreachable-route"]["reason"] == "EgressRefused"
    assert findings["unreachable-route"]["observed"]["errno"] == "EHOSTUNREACH"


@pytest.mark.system
def test_subprocess_in_netns_sees_only_its_namespace(blackhole_netns: Netns) -> None:
    # Guard for the test above: the snippet really runs inside the namespace (its own bh0 link exists).
    result = blackhole_netns.exec(["ip", "-o", "link", "show", "bh0"])
    assert result.returncode == 0 and "bh0" in result.stdout
    assert subprocess.run(["ip", "-o", "link", "show", "bh0"], capture_output=True).returncode != 0


# --- slow targets -----------------------------------------------------------------------------------


@pytest.mark.system
def test_slow_mirror_is_egress_slow_with_the_measured_time() -> None:
    """A mirror that answers after 1.2 s: past its slow_ms it is a warning naming the time and the phase;
    under a generous slow_ms the same answer is ok."""
    with servers() as started:
        mirror = HttpTestServer({"/simple/": 200}, delays={"/simple/": 1.2})
        started.append(mirror)
        target = {"host": "127.0.0.1", "port": mirror.port, "tls": False, "http_path": "/simple/"}
        config = parse_config(
            {"network": {"egress": [{**target, "name": "slow", "slow_ms": 500}, {**target, "name": "patient"}]}}
        )
        out = EgressProbe().run(ProbeContext(Host(), config, 10.0))
    findings = {f.subject: f for f in out if isinstance(f, Finding)}
    slow = findings["slow"]
    assert (slow.status, slow.reason) == (Status.WARN, "EgressSlow")
    assert slow.observed["duration_seconds"] >= 1.2 and slow.observed["slow_ms"] == 500
    assert slow.observed["phases"]["http"] >= 1.2 and slow.observed["http_status"] == 200
    said = re.search(r"HTTP 200 in (\d+) ms", slow.message)
    assert said is not None and abs(int(said.group(1)) - slow.observed["duration_seconds"] * 1000) <= 1
    assert "slower than slow_ms 500" in slow.message and "slowest phase http" in slow.message
    assert slow.hint
    patient = findings["patient"]  # no slow_ms of its own: network.egress_slow_ms (2000 ms)
    assert (patient.status, patient.reason) == (Status.OK, "OK")


@pytest.mark.system
def test_section_default_slow_ms_applies_to_targets_without_their_own() -> None:
    with servers() as started:
        mirror = HttpTestServer({"/": 200}, delays={"/": 0.5})
        started.append(mirror)
        target = {"name": "mirror", "host": "127.0.0.1", "port": mirror.port, "tls": False, "http_path": "/"}
        config = parse_config({"network": {"egress_slow_ms": 200, "egress": [target]}})
        out = EgressProbe().run(ProbeContext(Host(), config, 10.0))
    (finding,) = [f for f in out if isinstance(f, Finding)]
    assert (finding.status, finding.reason, finding.observed["slow_ms"]) == (Status.WARN, "EgressSlow", 200)


@pytest.mark.parametrize("egress", [{"egress": [{"host": "x", "slow_ms": 0}]}, {"egress_slow_ms": -1}])
def test_slow_ms_must_be_positive(egress: dict) -> None:
    with pytest.raises(ConfigError, match=r"network\.egress"):
        parse_config({"network": egress})


# --- deadlines --------------------------------------------------------------------------------------


@pytest.mark.system
def test_many_hanging_targets_each_get_a_specific_timeout_inside_the_probe_deadline() -> None:
    """Twenty targets whose TLS handshake never gets an answer, each allowed 30 s, under a 2 s probe deadline:
    every target ends in its own EgressTimeout at the tls phase, inside the deadline, so the scheduler keeps
    the result instead of reporting an opaque ProbeTimeout."""
    with servers() as started:
        silent = SilentTcpServer()
        started.append(silent)
        targets = [
            {"name": f"hang-{i}", "host": "127.0.0.1", "port": silent.port, "timeout_seconds": 30} for i in range(20)
        ]
        config = parse_config({"network": {"egress": targets}})
        started_at = time.monotonic()
        result, findings, _ = execute(EgressProbe(), Host(), config, 2.0)
        elapsed = time.monotonic() - started_at
    assert result == "ok" and elapsed < 2.0
    found = {f.subject: f for f in findings}
    assert set(found) == {t["name"] for t in targets}
    for finding in found.values():
        assert (finding.status, finding.reason, finding.observed["phase"]) == (Status.FAIL, "EgressTimeout", "tls")
        # Usually "TLS handshake with 127.0.0.1 did not finish within ..."; on a loaded machine a target may
        # get to the handshake only after its time is up ("no time left before the TLS handshake").
        assert "TLS handshake" in finding.message
        assert "cut from timeout_seconds 30 s" in finding.message
        assert finding.observed["deadline_seconds"] < 2.0


@pytest.mark.system
def test_target_that_starts_with_no_time_left_is_a_timeout_not_a_crash() -> None:
    with servers() as started:
        tcp = TcpAcceptServer()
        started.append(tcp)
        config = parse_config({"network": {"egress": [{"name": "late", "host": "127.0.0.1", "port": tcp.port}]}})
        out = EgressProbe().run(ProbeContext(Host(), config, 0.2))  # less than the probe keeps in hand
    (finding,) = [f for f in out if isinstance(f, Finding)]
    assert (finding.status, finding.reason) == (Status.FAIL, "EgressTimeout")
    assert "no time left before" in finding.message


def test_no_targets_is_not_applicable() -> None:
    result, findings, _ = execute(EgressProbe(), Host(), parse_config({}), 5.0)
    assert result == "skip" and findings[0].reason == "NotApplicable"
    assert "network.egress" in findings[0].message
