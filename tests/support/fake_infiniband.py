"""A /sys/class/infiniband tree in the kernel's formats (Documentation/ABI/stable/sysfs-class-infiniband and
drivers/infiniband/core/sysfs.c: `state` and `phys_state` print `%d: %s`, `rate` `%d%s Gb/sec (%dX%s)`), for the
interconnect tests: `node(tmp, 8)` is an 8-HCA node of ConnectX-7 ports at 400 Gb/s NDR, all ACTIVE/LinkUp."""

from __future__ import annotations

from pathlib import Path

COUNTERS = (
    "link_downed",
    "link_error_recovery",
    "symbol_error",
    "port_rcv_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
STATES = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4}
PHYS = {"Polling": 2, "Disabled": 3, "LinkUp": 5}


class InfinibandTree:
    def __init__(self, sys_root: Path) -> None:
        self.sys = sys_root
        self.base = sys_root / "class" / "infiniband"
        self.base.mkdir(parents=True, exist_ok=True)

    def port_dir(self, name: str) -> Path:
        hca, port = name.split("/")
        return self.base / hca / "ports" / port

    def add(self, name: str, rate: str = "400 Gb/sec (4X NDR)", link_layer: str = "InfiniBand") -> None:
        path = self.port_dir(name)
        (path / "counters").mkdir(parents=True, exist_ok=True)
        (path / "rate").write_text(rate + "\n")
        (path / "link_layer").write_text(link_layer + "\n")
        self.set_state(name, "ACTIVE", "LinkUp")
        for counter in COUNTERS:
            (path / "counters" / counter).write_text("0\n")

    def set_state(self, name: str, state: str, phys: str) -> None:
        path = self.port_dir(name)
        (path / "state").write_text(f"{STATES[state]}: {state}\n")
        (path / "phys_state").write_text(f"{PHYS[phys]}: {phys}\n")

    def set_rate(self, name: str, rate: str) -> None:
        (self.port_dir(name) / "rate").write_text(rate + "\n")

    def set_counter(self, name: str, counter: str, value: int) -> None:
        (self.port_dir(name) / "counters" / counter).write_text(f"{value}\n")

    def counter(self, name: str, counter: str) -> int:
        return int((self.port_dir(name) / "counters" / counter).read_text())


def node(sys_root: Path, hcas: int = 8) -> InfinibandTree:
    tree = InfinibandTree(sys_root)
    for index in range(hcas):
        tree.add(f"mlx5_{index}/1")
    return tree
