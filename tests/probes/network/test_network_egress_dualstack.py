"""network.egress with a name whose first address is dead: a network namespace of the test's own where fd00::2
(IPv6, nodad, behind a veth whose peer drops everything) and 192.0.2.2 never answer, and a live HTTP server
on 127.0.0.1. The probe runs there in a child (`ip netns exec`), the name resolved from a hosts file under
its host root, as curl would get the addresses: IPv6 first."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.netservers import DnsTestServer, HttpTestServer, Netns, ZoneResolver, servers
from support.system import REPO, require_root, require_tool

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Status
from probes.network.connect import interleaved
from probes.network.egress import EgressProbe
from probes.runtime.host import Host

SNIPPET = textwrap.dedent(
    """
    import http.server, json, sys, threading, time
    sys.path.insert(0, {repo!r})
    from agent.config import parse_config
    from probes.runtime.host import Host
    from probes.base import Finding, ProbeContext
    from probes.network.egress import EgressProbe

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    targets = [dict(t, port=server.server_address[1]) if t.get("port") == "live" else t for t in {targets!r}]
    config = parse_config({{"network": {{"egress": targets}}}})
    started = time.monotonic()
    out = EgressProbe().run(ProbeContext(Host(root={root!r}), config, {timeout!r}))
    print(json.dumps({{"elapsed": time.monotonic() - started,
                       "findings": [f.to_dict() for f in out if isinstance(f, Finding)]}}))
    """
)


@pytest.fixture
def dead_addresses() -> Iterator[Netns]:
    """fd00::2 and 192.0.2.2 behind veth bh0, with permanent neighbour entries: SYNs leave, nothing answers."""
    require_root()
    require_tool("ip")
    ns = Netns()
    try:
        ns.ip("link", "add", "bh0", "type", "veth", "peer", "name", "bh1")
        ns.ip("addr", "add", "192.0.2.1/24", "dev", "bh0")
        ns.ip("-6", "addr", "add", "fd00::1/64", "dev", "bh0", "nodad")
        ns.ip("link", "set", "bh0", "up")
        ns.ip("link", "set", "bh1", "up")
        ns.ip("neigh", "add", "192.0.2.2", "lladdr", "02:00:00:00:00:02", "dev", "bh0", "nud", "permanent")
        ns.ip("-6", "neigh", "add", "fd00::2", "lladdr", "02:00:00:00:00:02", "dev", "bh0", "nud", "permanent")
        yield ns
    finally:
        ns.close()


def run_in(ns: Netns, root: Path, targets: list[dict[str, Any]], timeout: float) -> dict[str, Any]:
    snippet = SNIPPET.format(repo=str(REPO), targets=targets, root=str(root), timeout=timeout)
    result = ns.exec([sys.executable, "-c", snippet], timeout=120)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.mark.system
def test_dead_ipv6_first_and_live_ipv4_second_is_ok_well_within_the_deadline(
    dead_addresses: Netns, tmp_path: Path
) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text(
        "fd00::2 mirror.test\n127.0.0.1 mirror.test\nfd00::2 dead.test\n192.0.2.2 dead.test\n"
    )
    targets = [
        {"name": "mirror", "host": "mirror.test", "port": "live", "tls": False, "http_path": "/"},
        {"name": "dead", "host": "dead.test", "port": 80, "tls": False, "timeout_seconds": 2.0},
    ]
    report = run_in(dead_addresses, tmp_path, targets, timeout=10.0)
    found = {f["subject"]: f for f in report["findings"]}
    mirror = found["mirror"]
    assert (mirror["status"], mirror["observed"]["http_status"]) == ("ok", 200), mirror
    assert mirror["observed"]["address"] == "127.0.0.1"
    # The IPv6 attempt had its 0.25 s alone, then IPv4 answered: nowhere near the 5 s deadline.
    assert mirror["observed"]["connect_seconds"] < 2.5 and mirror["observed"]["deadline_seconds"] == 5.0
    assert mirror["observed"]["failed"] == {"fd00::2": "no answer"}
    assert "through 127.0.0.1; [fd00::2] no answer" in mirror["message"]

    dead = found["dead"]
    assert (dead["status"], dead["reason"], dead["observed"]["phase"]) == ("fail", "EgressTimeout", "connect")
    assert dead["observed"]["failed"] == {"fd00::2": "no answer", "192.0.2.2": "no answer"}
    assert "[fd00::2]:80 no answer; 192.0.2.2:80 no answer" in dead["message"]
    assert dead["observed"]["duration_seconds"] >= 1.9  # both tried until the target's own 2 s ran out


def test_addresses_alternate_families_from_the_first() -> None:
    assert interleaved(["fd00::2", "fd00::3", "10.0.0.1", "10.0.0.2"]) == ["fd00::2", "10.0.0.1", "fd00::3", "10.0.0.2"]
    assert interleaved(["10.0.0.1", "fd00::2", "10.0.0.1"]) == ["10.0.0.1", "fd00::2"]
    assert interleaved([]) == []


@pytest.mark.system
def test_a_name_from_dns_is_tried_at_its_aaaa_records_too() -> None:
    """DNS gives the name an A record where nothing listens (127.0.0.2: refused) and an AAAA record that reaches
    the server (::ffff:127.0.0.1, IPv4-mapped): the check is ok through the AAAA address, naming the A one."""
    with servers() as started:
        http = HttpTestServer({"/": 200})
        dns = DnsTestServer(ZoneResolver({"mirror.test": "127.0.0.2"}, aaaa_records={"mirror.test": "::ffff:7f00:1"}))
        started.extend([http, dns])
        target = {"name": "mirror", "host": "mirror.test", "port": http.port, "tls": False, "http_path": "/"}
        config = parse_config({"network": {"dns": {"nameservers": [dns.address]}, "egress": [target]}})
        out = EgressProbe().run(ProbeContext(Host(), config, 10.0))
    (finding,) = [f for f in out if isinstance(f, Finding)]
    assert (finding.status, finding.observed["http_status"]) == (Status.OK, 200), finding
    assert finding.observed["address"] == "::ffff:127.0.0.1"
    assert finding.observed["failed"] == {"127.0.0.2": "refused"}
