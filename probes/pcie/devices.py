"""Which accelerators each checked PCI function serves: the function is one, or sits above one.

The npu and gpu probes publish each device's PCI Bus-Id (`ctx.host.devices`). A device's real sysfs path
lies under the directory of every port above it, so a function serves the accelerators whose real path is
its own or beneath it. A finding on such a function carries the device index, and `/ready?devices=` refuses
only the jobs that use that device.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from probes.pcie.sysfs import PciFunction, pci_devices_dir
from probes.runtime.inventory import Accelerator

# Category (taint, condition) of a function no accelerator is known on, by vendor: the device is what breaks.
VENDOR_CATEGORY = {0x19E5: "npu", 0x10DE: "gpu"}


@dataclass(frozen=True)
class Target:
    """What one finding about a function is about: its subject, how messages name it, device and category."""

    subject: str
    label: str
    device: int | None
    category: str | None
    accelerator: Accelerator | None = None


def accelerators_below(
    functions: Iterable[PciFunction], accelerators: Iterable[Accelerator], sys_dir: Path
) -> dict[str, list[Accelerator]]:
    """address → the accelerators that function is, or sits above (by index); functions serving none are left out."""
    bus = pci_devices_dir(sys_dir)
    located: list[tuple[str, Accelerator]] = []
    for accelerator in accelerators:
        link = bus / accelerator.bus_id
        if os.path.lexists(link):
            located.append((os.path.realpath(link), accelerator))
    served: dict[str, list[Accelerator]] = {}
    for function in functions:
        own = str(function.path)
        found = [acc for path, acc in located if path == own or path.startswith(own + os.sep)]
        if found:
            served[function.address] = sorted(found, key=lambda acc: (acc.kind, acc.index))
    return served


def _plain_label(function: PciFunction) -> str:
    below = f" above {', '.join(function.below)}" if function.below else ""
    return f"{function.address} ({function.role}{below})"


def _device_label(function: PciFunction, accelerator: Accelerator) -> str:
    named = f"{accelerator.name} ({accelerator.bus_id})"
    return named if function.address == accelerator.bus_id else f"{named}, port {function.address} above it"


def targets_of(function: PciFunction, served: Sequence[Accelerator], vendor_category: str | None) -> list[Target]:
    """The findings' targets for one function: itself when it serves no known accelerator; else the device
    (subject: the address); a port above several devices gives one target each (subject: address/device)."""
    if not served:
        return [Target(function.address, _plain_label(function), None, vendor_category)]
    several = len(served) > 1
    return [
        Target(
            f"{function.address}/{accelerator.name}" if several else function.address,
            _device_label(function, accelerator),
            accelerator.index,
            accelerator.kind,
            accelerator,
        )
        for accelerator in served
    ]
