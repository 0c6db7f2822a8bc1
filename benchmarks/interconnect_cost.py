#!/usr/bin/env python3
"""Cost per run of the interconnect checks on an 8-GPU/8-HCA fake node, against a named baseline in the same run.

- `interconnect.ports`: 8 HCA ports in a fake /sys/class/infiniband (tests/support/fake_infiniband.py).
- `gpu.links`: the fake nvidia-smi of tests/support/fake_gpu_links.py (8 A100s, 12 NVLinks each, NVSwitch fabric;
  three nvidia-smi children per run).
- baseline: the `gpu` probe's nvidia-smi fallback on the same fake node (`nvidia-smi -q` and a CSV query), the
  closest existing check that spawns the same tool.
- through NVML (where gcc builds tests/support/fake_nvml's libnvidia-ml.so.1): `gpu.links` on 8 H100s with 18
  NVLinks each and the NVSwitch fabric (one NVML pass: per GPU 18 link states, 54 error counters, the fabric info),
  against its own baseline, the `gpu` probe through the same library (one NVML pass over the same GPUs). The fake
  answers at once, so this is the agent's own cost per call, not the driver's.

Each is run N times (default 20); wall time and CPU (this process and its children) per run are printed, and the
ratios to the baseline. `PYTHONPATH=$PWD python3 benchmarks/interconnect_cost.py [N]`.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.fake_gpu_links import Clock, Node, fabric_proc, fake_smi
from support.fake_infiniband import node as ib_node
from support.fake_nvml.build import build_fake_nvml, device_config

from agent.config import parse_config
from agent.scheduler import execute
from probes.base import Probe
from probes.gpu.gpu import GpuProbe
from probes.gpu.links import GpuLinksProbe
from probes.interconnect.ports import InterconnectPortsProbe
from probes.runtime.host import Host


def cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(probe: Probe, host: Host, config: Any, runs: int) -> tuple[float, float]:
    execute(probe, host, config, 20.0)  # warm-up: imports, the baseline file
    wall, used = time.perf_counter(), cpu()
    for _ in range(runs):
        result, findings, _ = execute(probe, host, config, 20.0)
        assert result in ("ok", "skip"), findings
    return (time.perf_counter() - wall) / runs, (cpu() - used) / runs


def main(argv: list[str]) -> int:
    runs = int(argv[1]) if len(argv) > 1 else 20
    with tempfile.TemporaryDirectory(prefix="nh-interconnect-bench-") as directory:
        tmp = Path(directory)
        ib_node(tmp / "sys", 8)
        smi = fake_smi(tmp, Node())
        config = parse_config(
            {
                "gpu": {"smi_command": [smi], "nvml_library": str(tmp / "absent.so"), "expected_gpus": 8},
                "interconnect": {
                    "state_dir": str(tmp / "state"),
                },
                "kubernetes": {"pod_resources_socket": str(tmp / "no-kubelet.sock")},
            }
        )
        host = Host(proc=fabric_proc(tmp, True), sys=tmp / "sys", dev=tmp)
        results = {
            "baseline gpu (nvidia-smi fallback)": measure(GpuProbe(), host, config, runs),
            "interconnect.ports (8 HCA ports)": measure(InterconnectPortsProbe(Clock()), host, config, runs),
            "gpu.links (8 GPUs x 12 NVLinks)": measure(GpuLinksProbe(Clock()), host, config, runs),
        }
        report(results)
        if shutil.which("gcc") or shutil.which("cc"):
            report(through_nvml(tmp, runs))
        else:
            print("no gcc: the NVML measurement (a fake libnvidia-ml.so.1 built from C) is left out")
    return 0


def through_nvml(tmp: Path, runs: int) -> dict[str, tuple[float, float]]:
    library = build_fake_nvml(tmp / "nvml")
    gpu = {"nvlinks": 18, "fabric_state": 3, "fabric_status": 0}
    (tmp / "nvml.conf").write_text(device_config(*[gpu] * 8))
    os.environ["FAKE_NVML_CONFIG"] = str(tmp / "nvml.conf")  # read by the fake at every nvmlInit
    config = parse_config(
        {
            "gpu": {"smi_command": ["/nonexistent/nvidia-smi"], "nvml_library": str(library), "expected_gpus": 8},
            "interconnect": {"state_dir": str(tmp / "state-nvml")},
            "kubernetes": {"pod_resources_socket": str(tmp / "no-kubelet.sock")},
        }
    )
    host = Host(proc=fabric_proc(tmp, True), sys=tmp / "sys", dev=tmp)
    return {
        "baseline gpu (NVML)": measure(GpuProbe(), host, config, runs),
        "gpu.links (NVML, 8 GPUs x 18 NVLinks)": measure(GpuLinksProbe(Clock()), host, config, runs),
    }


def report(results: dict[str, tuple[float, float]]) -> None:
    base_wall, base_cpu = next(iter(results.values()))
    for name, (wall, used) in results.items():
        print(
            f"{name:40s} wall {wall * 1000:8.1f} ms ({wall / base_wall:5.2f}x)  "
            f"cpu {used * 1000:8.1f} ms ({used / base_cpu:5.2f}x)"
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
