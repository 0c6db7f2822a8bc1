#!/usr/bin/env python3
"""A stand-in for `npu-smi` that answers from a JSON spec, for tests that drive the npu probe end to end, and
the helpers those tests use to set it up and run the probe (FakeSmi, context, run_probe, ...).

    fake_npu_smi.py SPEC.json [npu-smi arguments...]

SPEC: {"responses": {"info": R, "info -m": R, "info -t health -i 0 -c 0": R, ...}, "default": R,
       "log": "/path/calls.log"}
R:    {"stdout": str, "stdout_file": path, "stderr": str, "rc": int, "sleep": seconds}

The arguments joined by single spaces pick the response; unknown ones get "default" (else the usage error
npu-smi prints). Every call is appended to "log" (one line of arguments) when set.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probes.base import Finding, ProbeContext, Sample
    from probes.npu.npu import NpuProbe
    from probes.runtime.podresources.pods import KubeletAccess

USAGE_ERROR = "Error parameter of -t\nUsage: npu-smi info <watch|proc|-h|-m|-l|-t type> [Options...]\n"


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    args = " ".join(argv[2:])
    if spec.get("log"):
        with open(spec["log"], "a") as log:
            log.write(args + "\n")
    response = spec.get("responses", {}).get(args, spec.get("default"))
    if response is None:
        sys.stderr.write(USAGE_ERROR)
        return 1
    if response.get("sleep"):
        time.sleep(float(response["sleep"]))
    stdout = response.get("stdout", "")
    if response.get("stdout_file"):
        stdout = Path(response["stdout_file"]).read_text()
    sys.stdout.write(stdout)
    sys.stdout.flush()
    sys.stderr.write(response.get("stderr", ""))
    return int(response.get("rc", 0))


# --- the test side ---------------------------------------------------------------------------------
# Imported by the npu tests; the agent's modules are imported inside the functions, so that the fake itself,
# run once per npu-smi call, starts as fast as a bare interpreter.

FAKE = Path(__file__).resolve()
REPO = FAKE.parents[2]


def npu_fixture(name: str) -> Path:
    path = REPO / "tests" / "fixtures" / "npu-smi" / name
    assert path.is_file(), f"fixture {path} is missing from the repository"
    return path


class FakeSmi:
    """A fake `npu-smi` executable in root/bin (put it on PATH), answering from a JSON spec the test writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        self.spec = root / "spec.json"
        self.log = root / "calls.log"
        script = self.bin / "npu-smi"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "{self.spec}" "$@"\n')
        script.chmod(0o755)
        self.answer({})

    def answer(self, responses: dict[str, dict[str, Any]], default: dict[str, Any] | None = None) -> None:
        spec: dict[str, Any] = {"responses": responses, "log": str(self.log)}
        if default is not None:
            spec["default"] = default
        self.spec.write_text(json.dumps(spec))
        self.log.write_text("")

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()


def table(name: str) -> dict[str, Any]:
    """A response that prints a captured output."""
    return {"stdout_file": str(npu_fixture(name))}


def make_dev(root: Path, nodes: dict[str, tuple[int, int]]) -> Path:
    """A temp dev dir with character device nodes name → (major, minor) (needs root: mknod)."""
    from support.system import require_root

    require_root()
    root.mkdir(parents=True, exist_ok=True)
    for name, (major, minor) in nodes.items():
        os.mknod(root / name, stat.S_IFCHR | 0o600, os.makedev(major, minor))
    return root


def context(
    tmp: Path,
    npu: dict[str, Any] | None = None,
    proc: Path | None = None,
    dev: Path | None = None,
    timeout: float = 10.0,
    kubelet: KubeletAccess | None = None,
) -> ProbeContext:
    """A real ProbeContext. By default /proc is an empty temp dir, so the PIDs of captured outputs can never
    match a process of this machine; holder tests pass the real /proc. Without `kubelet`, the PodResources socket
    is one that does not exist (a kubelet on the test machine is never asked)."""
    from agent.config import parse_config
    from probes.base import ProbeContext
    from probes.runtime.host import Host
    from probes.runtime.podresources.pods import KubeletAccess

    if proc is None:
        proc = tmp / "empty-proc"
        proc.mkdir(exist_ok=True)
    if dev is None:
        dev = tmp / "empty-dev"
        dev.mkdir(exist_ok=True)
    kubelet = kubelet or KubeletAccess(socket=str(tmp / "no-kubelet" / "kubelet.sock"))
    return ProbeContext(Host(proc=proc, dev=dev), parse_config({"npu": npu or {}}), timeout, kubelet=kubelet)


def run_probe(ctx: ProbeContext, probe: NpuProbe | None = None) -> tuple[dict[tuple[str, str], Finding], list[Sample]]:
    """Run the npu probe once; its findings by (check, subject), one each, and its samples."""
    from probes.base import Finding, Sample, Status
    from probes.npu.npu import NpuProbe

    probe = probe or NpuProbe()
    assert probe.applicable(ctx) is None
    findings: dict[tuple[str, str], Finding] = {}
    samples: list[Sample] = []
    for item in probe.run(ctx):
        if isinstance(item, Finding):
            assert item.key not in findings, f"two findings for {item.key}"
            assert item.message and "\n" not in item.message
            if item.status in (Status.WARN, Status.FAIL):
                assert item.hint, f"{item.key} has no hint"
            findings[item.key] = item
        else:
            assert isinstance(item, Sample)
            assert item.name.startswith("nodehealth_npu_") or item.name == "nodehealth_device_allocated"
            samples.append(item)
    return findings, samples


def sample(samples: list[Sample], name: str, chip: int) -> float | None:
    values = [s.value for s in samples if s.name == name and s.labels.get("chip") == str(chip)]
    assert len(values) <= 1
    return values[0] if values else None


if __name__ == "__main__":
    sys.exit(main(sys.argv))
