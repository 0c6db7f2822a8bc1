"""Which accelerator sits on which PCI function, shared between probe families.

The npu and gpu probes learn each device's PCI Bus-Id from npu-smi / NVML and record it here; the pcie probe
reads it to tie an AER error or a degraded link to the device on that bus (or below that port), so the
finding carries the device index and `/ready?devices=` refuses only the jobs that use it. The inventory lives
as long as the Host; until a device probe has run, pcie findings simply carry no device.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

_BDF = re.compile(r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$")


def normalize_bus_id(bus_id: str) -> str | None:
    """`00000000:3B:00.0` (NVML), `0000:DA:00.0` (npu-smi), `3b:00.0` → `0000:3b:00.0` (sysfs); None if not one."""
    match = _BDF.match(bus_id.strip())
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16)
    return f"{domain:04x}:{match['bus'].lower()}:{match['dev'].lower()}.{match['fn']}"


@dataclass(frozen=True)
class Accelerator:
    kind: str  # "npu" or "gpu": the category of findings about it
    index: int  # the logical index a job names in /ready?devices= (NPU logical id, GPU index)
    name: str  # how messages name it: "npu3", "gpu1"
    bus_id: str  # normalized, sysfs style


class DeviceInventory:
    """Bus-Id → accelerator, replaced per kind by each device probe run (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[str, dict[str, Accelerator]] = {}

    def publish(self, kind: str, devices: list[tuple[int, str, str]]) -> None:
        """Replace what is known of one kind: (index, name, bus id as the tool prints it) per device."""
        table: dict[str, Accelerator] = {}
        for index, name, bus_id in devices:
            normal = normalize_bus_id(bus_id)
            if normal is not None:
                table[normal] = Accelerator(kind, index, name, normal)
        with self._lock:
            self._by_kind[kind] = table

    def at(self, bus_id: str) -> Accelerator | None:
        normal = normalize_bus_id(bus_id)
        if normal is None:
            return None
        with self._lock:
            for table in self._by_kind.values():
                if normal in table:
                    return table[normal]
        return None

    def all(self) -> list[Accelerator]:
        with self._lock:
            return [device for table in self._by_kind.values() for device in table.values()]
