"""The default kernel.log rules for the mlx5 driver's port and module events: each against the driver's own
spellings (drivers/net/ethernet/mellanox/mlx5/core/events.c and mlx5_core.h, include/linux/netdevice.h's
netdev_printk; the lines as field reports quote them, see tests/fixtures/README.md), in the interconnect
category, raised and cleared; and a tenant's process name that spells the same words never matches."""

from __future__ import annotations

import pytest

from probes.base import Status
from probes.kernel.config import KernelLogRule
from probes.kernel.default_rules import DEFAULT_RULES
from probes.kernel.rules import RuleEngine, is_user_task_record


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(clock: Clock | None = None) -> RuleEngine:
    return RuleEngine([KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES], 60, clock=clock or Clock())


MLX5_LINES = [
    # mlx5_core_err() with its "<function>:<line>:(pid N): " (older kernels name the function
    # mlx5_port_module_event, newer port_module), and without it as some distribution kernels print it.
    (
        "mlx5_core 0000:5c:00.0: mlx5_port_module_event:1131:(pid 0): Port module event[error]: module 0, "
        "Cable error, High Temperature",
        "Mlx5ModuleError",
    ),
    (
        "mlx5_core 0000:5c:00.0: port_module:254:(pid 0): Port module event[error]: module 1, Cable error, "
        "Bad or shorted cable/module",
        "Mlx5ModuleError",
    ),
    ("mlx5_core 0000:5c:00.0: Port module event[error]: module 0, Cable error, High Temperature", "Mlx5ModuleError"),
    ("mlx5_core 0000:63:00.1: Port module event: module 1, Cable unplugged", "Mlx5CableUnplugged"),
    ("mlx5_core 0000:3b:00.0 ens1f0np0: Link down", "Mlx5LinkDown"),
    ("mlx5_core 0000:3b:00.1 eth3 (unregistering): Link down", "Mlx5LinkDown"),
    (
        "mlx5_core 0000:12:00.0: mlx5_pcie_event:299:(pid 268269): Detected insufficient power on the PCIe slot (27W).",
        "Mlx5InsufficientPower",
    ),
]
HEALTHY_LINES = [
    "mlx5_core 0000:63:00.1: Port module event: module 1, Cable plugged",
    "mlx5_core 0000:3b:00.0 ens1f0np0: Link up",
    "mlx5_core 0000:3b:00.0: firmware version: 28.39.1002",
    "mlx5_ib: Mellanox ConnectX InfiniBand driver v5.0",
]


@pytest.mark.parametrize(("line", "reason"), MLX5_LINES)
def test_mlx5_rule_matches_the_drivers_spelling_in_the_interconnect_category(line: str, reason: str) -> None:
    clock = Clock()
    rules = engine(clock)
    assert rules.observe(line) == [reason]
    finding = {f.subject: f for f in rules.findings()}[reason]
    assert finding.category == "interconnect"
    assert finding.status == (Status.FAIL if reason == "Mlx5ModuleError" else Status.WARN)
    assert finding.observed["pci"] == line.split()[1].rstrip(":")
    clock.now += 3601  # the quiet period (kernel_log.quiet_period_seconds) passes: cleared
    assert {f.subject: f for f in rules.findings()}[reason].status == Status.OK


@pytest.mark.parametrize("line", HEALTHY_LINES)
def test_healthy_mlx5_lines_match_nothing(line: str) -> None:
    assert engine().observe(line) == []


# A tenant's task named with a fault line: the kernel prints the name's first 15 bytes at the start of a crash
# record, then "[pid]", and the whole file name after " in " (arch/x86/mm/fault.c show_signal_msg,
# arch/x86/kernel/traps.c do_trap). No name can spell "mlx5_core <full PCI address>: " before its "[pid]".
HOSTILE = [
    "mlx5_core 0000:5c:00.0: Port module event[error]: module 0, Cable error, High Temperature",
    "mlx5_core 0000:63:00.1: Port module event: module 1, Cable unplugged",
    "mlx5_core 0000:3b:00.0 ens1f0np0: Link down",
    "mlx5_core 0:0:0: Port module event[error]: module 0, x",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_tenants_process_name_never_matches(name: str) -> None:
    comm = name[:15]
    records = [
        f"{comm}[4242]: segfault at 10 ip 0000000000401106 sp 00007ffc error 4 in {name}[401000+1000]",
        f"traps: {comm}[4242] trap invalid opcode ip:401106 sp:7ffc error:0 in {name}[401000+1000]",
        f"{comm}[4242]: Port module event[error]: module 0, Cable error, High Temperature",
    ]
    rules = engine()
    for record in records:
        assert rules.observe(record) == [], record
    assert all(f.status == Status.OK for f in rules.findings() if f.subject.startswith("Mlx5"))
    assert is_user_task_record(records[0]) and is_user_task_record(records[1])
