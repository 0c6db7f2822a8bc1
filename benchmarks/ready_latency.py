"""/ready latency and throughput under wrk, against prometheus_client's own server in the same run.

    python benchmarks/ready_latency.py [--duration 10] [--connections 50]

Runs, one after another on this machine:
  1. baseline: prometheus_client.start_http_server serving /metrics (its own threaded WSGI server);
  2. node-health `run --no-kube` serving /ready with the default probes;
  3. the same agent while one probe is hung forever (its thread blocked, reported as ProbeTimeout);
  4. where nginx is installed, the near-physical reference: one nginx worker answering `return 200`.
Each under `wrk -t2 -c<connections> -d<duration>s --latency` (keep-alive). Prints p50/p99 and requests/s,
the ratio of each agent run to the baseline, and to nginx. Budget (DESIGN, docs/http.md): p99 <= 5 ms and
>= 40x the baseline's req/s, hung probe or not; aim for >= 0.6x nginx. Exit status 1 when over budget.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIN_RATIO = 40.0  # the agent's /ready req/s over prometheus_client's own server's, in the same run
MAX_P99_MS = 5.0

BASELINE = """
import sys, time
from prometheus_client import Counter, Gauge, start_http_server
g = Gauge("bench_gauge", "x", ["a"])
for i in range(20):
    g.labels(str(i)).set(i)
Counter("bench_total", "x").inc()
start_http_server(int(sys.argv[1]), addr="127.0.0.1")
print("ready", flush=True)
time.sleep(3600)
"""

AGENT_WITH_HUNG_PROBE = """
import sys, threading
sys.path.insert(0, sys.argv[2])
from agent.config import parse_config
from agent.daemon import Agent
from probes import all_probes
from probes.base import Probe

class HungProbe(Probe):
    name = "bench.hung"
    checks = ("storage.benchhung",)
    default_interval = 5.0
    default_timeout = 1.0
    def run(self, ctx):
        threading.Event().wait()  # blocked forever, as on a hung NFS mount

classes = {**all_probes(), HungProbe.name: HungProbe}
config = parse_config({"http": {"address": "127.0.0.1", "port": int(sys.argv[1])}}, classes)
agent = Agent(None, config, no_kube=True, probe_classes=classes)
agent.install_signal_handlers()
agent.start()
print("ready", flush=True)
agent.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2).read()
            return
        except urllib.error.HTTPError:
            return  # 503 answers too
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing answered on port {port}")


def to_ms(text: str) -> float:
    number, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def run_wrk(url: str, duration: int, connections: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--latency", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    latency = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    return {
        "requests_per_second": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": to_ms(latency["50"]),
        "p99_ms": to_ms(latency["99"]),
        "non_2xx": float(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0.0,
    }


def measure(name: str, argv: list[str], path: str, duration: int, connections: int) -> dict[str, float]:
    port = free_port()
    proc = subprocess.Popen(
        [*argv, str(port), str(REPO)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, text=True
    )
    try:
        wait_http(port, path)
        time.sleep(3.0)  # let first probe runs finish (and the hung probe hang)
        result = run_wrk(f"http://127.0.0.1:{port}{path}", duration, connections)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(
        f"{name:38s} {result['requests_per_second']:10.0f} req/s  p50 {result['p50_ms']:7.2f} ms  "
        f"p99 {result['p99_ms']:8.2f} ms",
        flush=True,
    )
    return result


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp};
    scgi_temp_path {tmp};
    server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ready"; }} }}
}}
"""


def nginx_reference(tmp: Path, duration: int, connections: int) -> dict[str, float] | None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        print("nginx is not installed: no near-physical reference (apt-get install nginx-light)")
        return None
    conf = tmp / "nginx.conf"
    port = free_port()
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port))
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp)], stderr=subprocess.DEVNULL)
    try:
        wait_http(port, "/ready")
        result = run_wrk(f"http://127.0.0.1:{port}/ready", duration, connections)
    finally:
        proc.terminate()
        proc.wait(10)
    print(
        f"{'nginx, one worker, return 200':38s} {result['requests_per_second']:10.0f} req/s  "
        f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:8.2f} ms",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "ready_latency.json"))
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        agent_script = Path(tmp) / "agent_run.py"
        agent_script.write_text(
            "import sys\nsys.path.insert(0, sys.argv[2])\nfrom agent.config import parse_config\n"
            "from agent.daemon import Agent\nfrom probes import all_probes\n"
            "c = parse_config({'http': {'address': '127.0.0.1', 'port': int(sys.argv[1])}}, all_probes())\n"
            "a = Agent(None, c, no_kube=True)\na.install_signal_handlers()\na.start()\na.serve_forever()\n"
        )
        baseline_script = Path(tmp) / "baseline.py"
        baseline_script.write_text(BASELINE)
        hung_script = Path(tmp) / "hung.py"
        hung_script.write_text(AGENT_WITH_HUNG_PROBE)
        print(f"wrk -t2 -c{args.connections} -d{args.duration}s on {os.cpu_count()} cores")
        results = {
            "baseline_prometheus_client_metrics": measure(
                "prometheus_client start_http_server",
                [sys.executable, str(baseline_script)],
                "/metrics",
                args.duration,
                args.connections,
            ),
            "agent_ready": measure(
                "node-health /ready", [sys.executable, str(agent_script)], "/ready", args.duration, args.connections
            ),
            "agent_ready_with_hung_probe": measure(
                "node-health /ready, one probe hung",
                [sys.executable, str(hung_script)],
                "/ready",
                args.duration,
                args.connections,
            ),
        }
        reference = nginx_reference(Path(tmp), args.duration, args.connections)
        if reference is not None:
            results["reference_nginx"] = reference
    base = results["baseline_prometheus_client_metrics"]["requests_per_second"]
    over = False
    for key in ("agent_ready", "agent_ready_with_hung_probe"):
        ratio = results[key]["requests_per_second"] / base
        results[key]["ratio_to_baseline"] = round(ratio, 1)
        within = ratio >= MIN_RATIO and results[key]["p99_ms"] <= MAX_P99_MS
        over = over or not within
        against = ""
        if "reference_nginx" in results:
            share = results[key]["requests_per_second"] / results["reference_nginx"]["requests_per_second"]
            results[key]["ratio_to_nginx"] = round(share, 2)
            against = f", {share:.2f}x nginx"
        print(
            f"{key}: {ratio:.1f}x baseline req/s{against}, p99 {results[key]['p99_ms']:.2f} ms -> "
            f"{'within budget' if within else 'OVER BUDGET'}"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
