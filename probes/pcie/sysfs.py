"""PCI functions in sysfs: discovery of the functions to check and the ports above them, and their link state.

Layout (Documentation/ABI/testing/sysfs-bus-pci): <sys>/bus/pci/devices/<address> is a symlink to the
function's directory under <sys>/devices/pci<domain:bus>/..., where each bridge's directory holds the
functions below it, so the parent of a function's real path is the port above it. `vendor`, `device` and
`class` are hex; `current_link_speed` reads `16.0 GT/s PCIe` (older kernels `8 GT/s`, or `Unknown`),
`*_link_width` a plain number. A function without link files is not PCIe (virtio) or is integrated.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

BDF = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_BRIDGE_CLASS = 0x0604


def parse_link_speed(text: str) -> float | None:
    """`16.0 GT/s PCIe`, `8 GT/s`, `2.5 GT/s` → GT/s; `Unknown` (or empty) → None."""
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s", text)
    return float(match.group(1)) if match else None


def parse_link_width(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_hex(text: str) -> int | None:
    try:
        return int(text.strip(), 16)
    except ValueError:
        return None


@dataclass
class PciFunction:
    address: str
    path: Path  # the real sysfs directory (symlinks resolved)
    vendor: int | None
    device: int | None
    pci_class: int | None
    role: str  # "endpoint" (a configured vendor's function) or "port" (the port above one)
    upstream: str | None = None  # address of the port above, when that is a PCI function
    below: list[str] = field(default_factory=list)  # for ports: the matched functions under them

    @property
    def is_bridge(self) -> bool:
        return self.pci_class is not None and self.pci_class >> 8 == _BRIDGE_CLASS


@dataclass(frozen=True)
class LinkState:
    width: int | None
    max_width: int | None
    speed: float | None  # GT/s
    max_speed: float | None

    @property
    def supported(self) -> bool:
        return self.width is not None and self.max_width is not None and self.max_width > 0


def read_text(path: Path) -> str | None:
    """A sysfs attribute, or None when it is absent or unreadable (sysfs reads do not hang)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def function_at(path: Path, role: str) -> PciFunction:
    return PciFunction(
        address=path.name,
        path=path,
        vendor=parse_hex(read_text(path / "vendor") or ""),
        device=parse_hex(read_text(path / "device") or ""),
        pci_class=parse_hex(read_text(path / "class") or ""),
        role=role,
    )


def pci_devices_dir(sys_dir: Path) -> Path:
    return Path(sys_dir) / "bus" / "pci" / "devices"


def discover_functions(
    sys_dir: Path, vendors: set[int], device_ids: set[int], upstream_ports: bool = True
) -> list[PciFunction]:
    """Matched functions (sorted by address), then the ports above them (deduplicated)."""
    bus = pci_devices_dir(sys_dir)
    endpoints: list[PciFunction] = []
    ports: dict[str, PciFunction] = {}
    try:
        names = sorted(os.listdir(bus))
    except OSError:
        return []
    for name in names:
        real = Path(os.path.realpath(bus / name))
        function = function_at(real, "endpoint")
        function.address = name
        if function.vendor not in vendors or function.is_bridge:
            continue
        if device_ids and function.device not in device_ids:
            continue
        parent = real.parent
        if BDF.match(parent.name):
            function.upstream = parent.name
            if upstream_ports:
                port = ports.get(parent.name)
                if port is None:
                    port = ports[parent.name] = function_at(parent, "port")
                port.below.append(name)
        endpoints.append(function)
    matched = {f.address for f in endpoints}
    return endpoints + [p for a, p in sorted(ports.items()) if a not in matched]


def read_link(function: PciFunction) -> LinkState:
    return LinkState(
        width=parse_link_width(read_text(function.path / "current_link_width") or ""),
        max_width=parse_link_width(read_text(function.path / "max_link_width") or ""),
        speed=parse_link_speed(read_text(function.path / "current_link_speed") or ""),
        max_speed=parse_link_speed(read_text(function.path / "max_link_speed") or ""),
    )
