"""Parsers of nvidia-smi's NVLink and fabric outputs (the gpu.links probe's nvidia-smi backend).

- `nvidia-smi nvlink -s` (`--status`): per GPU a header `GPU 0: <name> (UUID: GPU-…)`, then one line per link,
  `\t Link 0: 25 GB/s` for an active link, `Link 4: <inactive>` (older drivers `Inactive`) for one that is not.
- `nvidia-smi nvlink -e` (`--errorcounters`): per GPU the same header, then per link `Link 0: Replay Errors: 0`,
  `Link 0: Recovery Errors: 0`, `Link 0: CRC Errors: 0` (newer drivers add other counters, kept by name).
- `nvidia-smi -q`: each `GPU <bus id>` block's `Fabric` section, `State` (`Completed`, `In Progress`,
  `Not Started`, `N/A` off NVSwitch systems) and `Status` (`Success`, `N/A`, or the error).
A GPU without NVLink prints `Device does not have or support Nvlink` or no link line. Sources of the formats:
tests/fixtures/nvidia-smi/SOURCES.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from probes.gpu.nvidia_smi import SmiParseError, parse_query, parse_tree

_HEADER = re.compile(r"^GPU (?P<index>\d+): (?P<name>.*?)(?: \(UUID: (?P<uuid>[^)]*)\))?$")
_STATUS = re.compile(r"^Link (?P<link>\d+): (?P<value>.+)$")
_SPEED = re.compile(r"^(?P<speed>[0-9]+(?:\.[0-9]+)?) GB/s$")
_COUNTER = re.compile(r"^Link (?P<link>\d+): (?P<name>[A-Za-z][A-Za-z0-9 ]*?): (?P<value>\d+|N/A)$")
MAX_LINKS = 64


@dataclass
class GpuLinks:
    """One GPU's NVLinks, as either backend reads them (nvidia-smi here, NVML in probes/gpu/links_nvml.py)."""

    index: int
    name: str = ""
    uuid: str = ""
    # link → active (nvidia-smi: a speed printed; NVML: NVML_FEATURE_ENABLED)
    states: dict[int, bool] = field(default_factory=dict)
    # link → speed in GB/s, where nvidia-smi printed one
    speeds: dict[int, float] = field(default_factory=dict)
    # link → counter name (`replay_errors`) → value
    counters: dict[int, dict[str, int]] = field(default_factory=dict)
    # why this GPU's links could not be read (an NVML error); "" when they were
    error: str = ""

    @property
    def active(self) -> int:
        return sum(1 for up in self.states.values() if up)


def _blocks(text: str) -> list[tuple[GpuLinks, list[str]]]:
    out: list[tuple[GpuLinks, list[str]]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("==="):
            continue
        header = _HEADER.match(line)
        if header is not None:
            gpu = GpuLinks(int(header["index"]), header["name"], header["uuid"] or "")
            out.append((gpu, []))
        elif out:
            out[-1][1].append(line)
        elif "does not have or support" not in line.lower():
            raise SmiParseError(f"nvidia-smi nvlink: a line before the first `GPU N:` header: {line[:80]!r}")
    return out


def parse_status(text: str) -> dict[int, GpuLinks]:
    """`nvidia-smi nvlink -s` → GPU index → its links' speeds."""
    out: dict[int, GpuLinks] = {}
    for gpu, lines in _blocks(text):
        for line in lines:
            match = _STATUS.match(line)
            if match is None:
                if "does not have or support" in line.lower():
                    continue
                raise SmiParseError(f"nvidia-smi nvlink -s: unexpected line {line[:80]!r}")
            if len(gpu.states) >= MAX_LINKS:
                break
            value = match["value"].strip()
            speed = _SPEED.match(value)
            gpu.states[int(match["link"])] = speed is not None
            if speed is not None:
                gpu.speeds[int(match["link"])] = float(speed["speed"])
        out[gpu.index] = gpu
    return out


def counter_key(name: str) -> str:
    """`Replay Errors` → `replay_errors`."""
    return "_".join(name.lower().split())


def parse_errors(text: str) -> dict[int, GpuLinks]:
    """`nvidia-smi nvlink -e` → GPU index → its links' counters (N/A left out)."""
    out: dict[int, GpuLinks] = {}
    for gpu, lines in _blocks(text):
        for line in lines:
            match = _COUNTER.match(line)
            if match is None:
                if "does not have or support" in line.lower():
                    continue
                raise SmiParseError(f"nvidia-smi nvlink -e: unexpected line {line[:80]!r}")
            link = int(match["link"])
            if link >= MAX_LINKS:
                continue
            if match["value"] != "N/A":
                gpu.counters.setdefault(link, {})[counter_key(match["name"])] = int(match["value"])
        out[gpu.index] = gpu
    return out


@dataclass(frozen=True)
class FabricState:
    bus_id: str
    uuid: str
    minor: int | None
    state: str  # "Completed", "In Progress", "Not Started", "N/A", "" when the section is absent
    status: str
    error: str = ""  # why NVML could not read it; "" when it could (or nvidia-smi read it)
    health_mask: int | None = None  # NVML's healthMask (nvmlGpuFabricInfo_v2+), where read

    @property
    def supported(self) -> bool:
        return self.state not in ("", "N/A")


def parse_fabric(text: str) -> list[FabricState]:
    """`nvidia-smi -q` → each GPU's identity and Fabric section, in output (index) order."""
    query = parse_query(text)
    blocks = [node for node in parse_tree(text).children if node.key.startswith("GPU ")]
    out = []
    for gpu, block in zip(query.gpus, blocks, strict=False):
        fabric = block.child("Fabric")
        state = (fabric.value_of("State") or "") if fabric is not None else ""
        status = (fabric.value_of("Status") or "") if fabric is not None else ""
        out.append(FabricState(gpu.bus_id, gpu.uuid, gpu.minor, state, status))
    return out
