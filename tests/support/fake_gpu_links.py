"""A fake nvidia-smi for the gpu.links probe, serving the sourced NVLink and fabric outputs
(tests/fixtures/nvidia-smi/SOURCES.md) for the 8 A100s of the `-q` fixture, with links made inactive, counters
raised and fabric sections changed per GPU; and a /proc with or without a host nv-fabricmanager."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from agent.config import parse_config
from agent.scheduler import execute
from probes.gpu.links import GpuLinksProbe
from probes.runtime.host import Host
from support.system import REPO

FIXTURES = REPO / "tests" / "fixtures" / "nvidia-smi"
Q_FULL = (FIXTURES / "a100-sxm4-40gb-8gpu-q-full-460.32.03-healthy.txt").read_text()
UUIDS = re.findall(r"GPU UUID\s+: (\S+)", Q_FULL)
BUSES = re.findall(r"^GPU (\S+)$", Q_FULL, re.M)
STATUS_I0 = (FIXTURES / "nvlink-s-i0-a100-sxm4-40gb-535.161.08.txt").read_text()
ERRORS_I0 = (FIXTURES / "nvlink-e-i0-a100-sxm4-40gb-535.161.08.txt").read_text()
FABRIC_OK = (FIXTURES / "q-excerpt-fabric-Completed-Success.txt").read_text()
FABRIC_NA = (FIXTURES / "q-excerpt-fabric-NA-550.txt").read_text()
HEADER_I0 = STATUS_I0.splitlines()[0]


def per_gpu(block: str, index: int) -> str:
    header = f"GPU {index}: NVIDIA A100-SXM4-40GB (UUID: {UUIDS[index]})"
    return block.replace(HEADER_I0, header)


class Node:
    """What the fake nvidia-smi serves: per GPU its inactive links, raised counters and fabric section."""

    def __init__(self, fabric: str = FABRIC_OK) -> None:
        self.inactive: dict[int, list[int]] = {}
        self.counters: dict[tuple[int, int, str], int] = {}
        self.fabric: dict[int, str] = dict.fromkeys(range(8), fabric)

    def status(self) -> str:
        out = []
        for index in range(8):
            text = per_gpu(STATUS_I0, index)
            for link in self.inactive.get(index, []):
                text = text.replace(f"Link {link}: 25 GB/s", f"Link {link}: <inactive>")
            out.append(text)
        return "".join(out)

    def errors(self) -> str:
        out = []
        for index in range(8):
            text = per_gpu(ERRORS_I0, index)
            for (gpu, link, name), value in self.counters.items():
                if gpu == index:
                    text = text.replace(f"Link {link}: {name}: 0\n", f"Link {link}: {name}: {value}\n")
            out.append(text)
        return "".join(out)

    def query(self) -> str:
        blocks = re.split(r"(?m)^(?=GPU \S+$)", Q_FULL)
        out = [blocks[0]]
        for index, block in enumerate(blocks[1:]):
            out.append(block.replace("    Processes", self.fabric[index] + "    Processes", 1))
        return "".join(out)


def fake_smi(tmp: Path, node: Node, hang: str = "") -> str:
    (tmp / "s.txt").write_text(node.status())
    (tmp / "e.txt").write_text(node.errors())
    (tmp / "q.txt").write_text(node.query())
    script = tmp / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "args = ' '.join(sys.argv[1:])\n"
        f"files = {{'-q': 'q.txt', 'nvlink -s': 's.txt', 'nvlink -e': 'e.txt'}}\n"
        f"if args == {hang!r}: time.sleep(60)\n"
        f"sys.stdout.write(open({str(tmp)!r} + '/' + files[args]).read())\n"
    )
    script.chmod(0o755)
    return str(script)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def run(tmp: Path, node: Node, probe: GpuLinksProbe, proc: Path | None = None, **section: Any) -> list[Any]:
    smi = fake_smi(tmp, node, section.pop("hang", ""))
    section.setdefault("state_dir", str(tmp / "state"))
    config = parse_config(
        {
            "gpu": {
                "smi_command": [smi],
                "nvml_library": str(tmp / "absent.so"),
                "smi_timeout_seconds": 2,
                "expected_gpus": 8,
            },
            "interconnect": section,
        }
    )
    result, findings, samples = execute(probe, Host(proc=proc or fabric_proc(tmp, True)), config, 20.0)
    assert result in ("ok", "skip"), findings
    return [*findings, *samples]


def fabric_proc(tmp: Path, running: bool) -> Path:
    """A /proc holding this test's own process, named nv-fabricmanager when `running` (its cgroup is the
    test's, uid 0 as the suite runs): fabric_manager_running reads comm, stat, cgroup and status."""
    proc = tmp / ("proc-fm" if running else "proc-none")
    if proc.exists():
        return proc
    me = proc / str(os.getpid())
    me.mkdir(parents=True)
    real = Path("/proc/self")
    comm = "nv-fabricmanage" if running else "python3"
    (me / "comm").write_text(comm + "\n")
    stat = (real / "stat").read_text()
    (me / "stat").write_text(stat[: stat.index("(") + 1] + comm + stat[stat.rindex(")") :])
    (me / "cgroup").write_text("0::/system.slice/nvidia-fabricmanager.service\n")
    (me / "status").write_text("Name:\tnv-fabricmanage\nUid:\t0\t0\t0\t0\n")
    return proc
