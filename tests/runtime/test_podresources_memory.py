"""The kubelet's ledger cannot take the agent past its memory limit (issue 30 item 11): the real agent (`run`) reads
a fake kubelet (real gRPC) answering the largest answer the bounds of probes/runtime/podresources/caps.py admit,
then answers past each bound, again and again; the peak RSS (VmHWM) of the agent and of its reader child, added
up (one container, one memory cgroup), stays below the memory limit of deploy/daemonset.yaml's agent container."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from support.cli import node_env
from support.fake_kubelet import FakeKubelet
from support.system import REPO

from probes.runtime.podresources import caps

MIB = 1 << 20
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def manifest_memory_limit() -> int:
    """The agent container's memory limit in deploy/daemonset.yaml, in bytes."""
    daemonset = yaml.safe_load((REPO / "deploy" / "daemonset.yaml").read_text())
    (agent,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", str(agent["resources"]["limits"]["memory"]))
    assert match, agent["resources"]["limits"]["memory"]
    return int(match[1]) * UNITS[match[2]]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def padded(prefix: str, index: int, width: int) -> str:
    return f"{prefix}{index}".ljust(width, "x")


def largest_admitted(kubelet: FakeKubelet) -> None:
    """Every count at its bound: MAX_PODS pods of MAX_CONTAINERS containers in all, one allocated id each
    (MAX_ALLOCATED_IDS), MAX_ALLOCATABLE_IDS offered ids, names and ids as long as keep each gRPC message within
    MAX_MESSAGE_BYTES (the test asserts the read is ok: admitted)."""
    per_pod = caps.MAX_CONTAINERS // caps.MAX_PODS
    assert per_pod * caps.MAX_PODS == caps.MAX_CONTAINERS == caps.MAX_ALLOCATED_IDS
    kubelet.pods = {
        f"{padded('ns', pod, 48)}/{padded('pod', pod, 120)}": {
            padded(f"c{c}-", pod, 10): [["nvidia.com/gpu", padded(f"GPU-{pod}-{c}-", 0, 40)]] for c in range(per_pod)
        }
        for pod in range(caps.MAX_PODS)
    }
    kubelet.allocatable = {"nvidia.com/gpu": [padded(f"GPU-{i}-", 0, 100) for i in range(caps.MAX_ALLOCATABLE_IDS)]}
    kubelet._save()


def one_pod(kubelet: FakeKubelet, allocatable: list[str]) -> None:
    kubelet.pods = {"team/train": {"main": [["nvidia.com/gpu", "0"]]}}
    kubelet.allocatable = {"nvidia.com/gpu": allocatable}
    kubelet._save()


# Answers past one bound each, and what the refusal names. Within the message bound, the shapes that cost the
# reader child most to parse: hundreds of thousands of one-byte ids, or of entries.
def the_issues_answer(kubelet: FakeKubelet) -> None:
    one_pod(kubelet, [f"{i:07d}" for i in range(1_180_000)])  # about 1.18 million ids: 10.6 MB


def too_many_allocatable_ids(kubelet: FakeKubelet) -> None:
    one_pod(kubelet, [str(i % 10) for i in range(600_000)])  # 1.8 MB


def too_many_pods(kubelet: FakeKubelet) -> None:
    kubelet.pods = {f"team/p{i}": {"main": []} for i in range(caps.MAX_PODS + 1)}
    kubelet.pods["team/train"] = {"main": [["nvidia.com/gpu", "0"]]}
    kubelet.allocatable = {}
    kubelet._save()


def too_many_containers(kubelet: FakeKubelet) -> None:
    kubelet.pods = {"team/train": {f"{i:x}": [] for i in range(150_000)}}
    kubelet.allocatable = {}
    kubelet._save()


def too_many_allocated_ids(kubelet: FakeKubelet) -> None:
    kubelet.pods = {"team/train": {"main": [["nvidia.com/gpu", str(i % 10)] for i in range(600_000)]}}
    kubelet.allocatable = {}
    kubelet._save()


def too_long_an_id(kubelet: FakeKubelet) -> None:
    kubelet.pods = {"team/train": {"main": [["nvidia.com/gpu", "G" * (caps.MAX_TEXT_CHARS + 1)]]}}
    kubelet.allocatable = {}
    kubelet._save()


PAST_BOUNDS = [
    (the_issues_answer, "bytes in the GetAllocatableResources answer"),
    (too_many_allocatable_ids, "600000 allocatable device ids"),
    (too_many_pods, f"{caps.MAX_PODS + 2} pods listed"),
    (too_many_containers, "150000 containers listed"),
    (too_many_allocated_ids, "device ids allocated"),
    (too_long_an_id, f"a name or id of {caps.MAX_TEXT_CHARS + 1} characters"),
]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[FakeKubelet, subprocess.Popen[str], int]]:
    with FakeKubelet(rate=1000, burst=1000) as kubelet:
        config = tmp_path / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "http": {"address": "127.0.0.1", "port": 0, "metrics_port": 0},
                    "kubernetes": {"pod_resources_socket": kubelet.socket, "pod_resources_timeout_seconds": 20},
                    "probes": {"host": {"interval_seconds": 5}},
                }
            )
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--no-kube", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=node_env(),
        )
        lines: list[str] = []
        port: list[int] = []
        started = threading.Event()

        def pump() -> None:  # the log is drained so the agent never blocks on a full pipe
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                match = re.search(r"serving on [^:]+:(\d+)", line)
                if match and not port:
                    port.append(int(match.group(1)))
                    started.set()

        threading.Thread(target=pump, daemon=True).start()
        try:
            assert started.wait(60), "the agent did not start: " + "".join(lines[-20:])
            yield kubelet, proc, port[0]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def ask_pod(port: int, pod: str) -> dict[str, Any]:
    """/ready?pod=: a fresh ledger read first (the agent waits at most 1 s for it; the test waits for its outcome)."""
    url = f"http://127.0.0.1:{port}/ready?pod={pod}&format=json"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def read_until(port: int, pod: str, done: Any, what: str) -> dict[str, Any]:
    """Asks until `done(answer)`: a large answer may take the reader longer than the agent's 1 s wait."""
    deadline = time.monotonic() + 120
    while True:
        answer = ask_pod(port, pod)
        if done(answer):
            return answer
        assert time.monotonic() < deadline, f"{what}: {answer}"
        time.sleep(1.1)  # past the 1 s between reads: the next ask makes a new read


def mapped_nowhere(answer: dict[str, Any]) -> bool:
    return bool(answer.get("pod", {}).get("ledger") == "PodDevicesUnknown")


def reader_child(proc: subprocess.Popen[str]) -> psutil.Process:
    (child,) = [c for c in psutil.Process(proc.pid).children() if any("reader.py" in a for a in c.cmdline())]
    return child


@pytest.mark.system
def test_the_largest_admitted_ledger_and_answers_past_each_bound_stay_within_the_memory_limit(
    agent: tuple[FakeKubelet, subprocess.Popen[str], int],
) -> None:
    kubelet, proc, port = agent
    limit = manifest_memory_limit()
    listed_pod = f"{padded('ns', 7, 48)}/{padded('pod', 7, 120)}"

    largest_admitted(kubelet)
    for _ in range(4):  # reads after reads: each replaces the last, none adds to it
        # Read and the pod found in it: its ids name no GPU of this node, which is what it says.
        answer = read_until(port, listed_pod, mapped_nowhere, "the largest admitted answer was not read")
        assert "which no npu or gpu result of this node names" in json.dumps(answer)
        time.sleep(1.1)
    child = reader_child(proc)
    admitted = {"agent": peak_rss(proc.pid), "reader": peak_rss(child.pid)}

    for serve, named in PAST_BOUNDS:
        serve(kubelet)
        answer = read_until(port, "team/train", lambda a, named=named: named in json.dumps(a), serve.__name__)
        assert answer["ready"] is False and answer["pod"]["ledger"] == "LedgerUnavailable", answer
        assert "larger than the agent reads" in json.dumps(answer), answer
    child = reader_child(proc)
    peaks = {"agent": peak_rss(proc.pid), "reader": max(admitted["reader"], peak_rss(child.pid))}
    total = peaks["agent"] + peaks["reader"]
    shown = {k: f"{v / MIB:.0f} MiB" for k, v in {**peaks, "limit": limit}.items()}
    assert total < 0.8 * limit, f"agent + reader child peak {total / MIB:.0f} MiB: {shown}"
    assert proc.poll() is None
