"""Where the NVIDIA tools are, and reading every GPU through them: NVML first, nvidia-smi as the fallback.

The library and nvidia-smi are looked for where the host has them (the loader's path, `gpu.nvml_library`,
`gpu.smi_command` on PATH) and, on GPU Operator nodes, in the driver container's root (`gpu.driver_root`,
default /run/nvidia/driver under host.root), entered the way the operator's own tools do: NVML loaded from
the driver root's lib dirs, nvidia-smi run chrooted into it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from probes.gpu import nvidia_smi as smi
from probes.gpu.config import GpuConfig
from probes.gpu.model import GpuInventory, GpuState
from probes.gpu.nvml import NvmlUnavailable, library_loadable, read_nvml

if TYPE_CHECKING:
    from probes.base import ProbeContext
    from probes.runtime.commands import CommandResult

NVML_LIBRARY = "libnvidia-ml.so.1"
# Lib dirs of a driver root, as the driver container lays them out (Debian/Ubuntu multiarch, RHEL lib64).
DRIVER_LIB_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
)
DRIVER_SMI = "usr/bin/nvidia-smi"


@dataclass(frozen=True)
class Tools:
    """The NVIDIA tools found: what to dlopen as NVML ("" = the loader's search path) and the nvidia-smi
    commands to try in order; `looked` says where, for a message when there is none."""

    nvml: str | None
    smi_commands: tuple[tuple[str, ...], ...]
    looked: str

    @property
    def any(self) -> bool:
        return self.nvml is not None or bool(self.smi_commands)


def command_exists(argv0: str) -> bool:
    return os.access(argv0, os.X_OK) if "/" in argv0 else shutil.which(argv0) is not None


def find_tools(ctx: ProbeContext, cfg: GpuConfig) -> Tools:
    driver_root = ctx.host.root_path(cfg.driver_root)
    nvml = _find_nvml(cfg, driver_root)
    commands: list[tuple[str, ...]] = []
    if cfg.smi_command and command_exists(cfg.smi_command[0]):
        commands.append(tuple(cfg.smi_command))
    chroot = shutil.which("chroot")
    if chroot and os.access(driver_root / DRIVER_SMI, os.X_OK):
        commands.append((chroot, str(driver_root), "/" + DRIVER_SMI))
    library = cfg.nvml_library or f"{NVML_LIBRARY} on the loader's path"
    looked = (
        f"no loadable {library} nor under {driver_root}; no {cfg.smi_command[0] if cfg.smi_command else 'nvidia-smi'} "
        f"nor {driver_root / DRIVER_SMI}"
    )
    return Tools(nvml, tuple(commands), looked)


def _find_nvml(cfg: GpuConfig, driver_root: Path) -> str | None:
    if library_loadable(cfg.nvml_library):  # "": the loader's search path
        return cfg.nvml_library
    for directory in DRIVER_LIB_DIRS:
        candidate = driver_root / directory / NVML_LIBRARY
        if candidate.is_file() and library_loadable(str(candidate)):
            return str(candidate)
    return None


@dataclass
class Unavailable:
    """Why no backend could read the GPUs."""

    nvml_error: str
    smi_error: str
    smi_not_found: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def detail(self) -> str:
        return f"NVML: {self.nvml_error}; nvidia-smi: {self.smi_error}"


def read_inventory(ctx: ProbeContext, cfg: GpuConfig, tools: Tools) -> GpuInventory | Unavailable:
    nvml_error = f"{NVML_LIBRARY} not found"
    # dlopen first (find_tools): on a host without the library, pynvml (several MiB) is never imported.
    if tools.nvml is not None:
        try:
            return read_nvml(tools.nvml)
        except NvmlUnavailable as exc:
            nvml_error = str(exc)
    unavailable = Unavailable(nvml_error, "not found", smi_not_found=True)
    for command in tools.smi_commands:
        try:
            return read_smi(ctx, cfg, command)
        except SmiUnavailable as exc:
            unavailable.smi_error = str(exc)
            unavailable.smi_not_found = unavailable.smi_not_found and exc.not_found
    return unavailable


# --- the nvidia-smi fallback -----------------------------------------------------------------------


class SmiUnavailable(Exception):
    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def read_smi(ctx: ProbeContext, cfg: GpuConfig, command: tuple[str, ...]) -> GpuInventory:
    """`nvidia-smi -q` (+ one CSV query for indices and the recovery action, and `-L` for MIG devices);
    `-L` when `-q` fails."""

    def run(*args: str) -> CommandResult:
        return ctx.host.run([*command, *args], timeout=max(0.1, min(cfg.smi_timeout_seconds, ctx.remaining())))

    result = run("-q")
    if result.not_found:
        raise SmiUnavailable(f"{command[0]} not found", not_found=True)
    if result.timed_out:
        raise SmiUnavailable(f"nvidia-smi -q did not answer within {cfg.smi_timeout_seconds:g}s")
    if result.returncode != 0:
        return _listing_only(run("-L"), result)
    query = smi.parse_query(result.output)
    inventory = GpuInventory("nvidia-smi", query.driver_version, query.gpus, query.failures)
    _read_indices(run, inventory)
    if any(gpu.mig_enabled for gpu in inventory.gpus):
        _read_mig_devices(run("-L"), inventory)
    for gpu in inventory.gpus:
        if gpu.recovery_action is None and "recovery_action" not in gpu.unsupported:
            gpu.unsupported.append("recovery_action")
        if gpu.processes is None:
            gpu.unsupported.append("compute_processes")
    return inventory


def _listing_only(listing: CommandResult, failed: CommandResult) -> GpuInventory:
    """`-q` failed: the GPUs `-L` still lists are present, but nothing else is known (their checks are unknown)."""
    if listing.returncode != 0 or listing.timed_out:
        first = (failed.output.strip().splitlines() or [f"exit status {failed.returncode}"])[0]
        raise SmiUnavailable(f"nvidia-smi failed: {first}")
    listed, failures = smi.parse_list(listing.output)
    inventory = GpuInventory("nvidia-smi", failures=failures)
    inventory.gpus = [GpuState(index=g.index, uuid=g.uuid, name=g.name, mig_uuids=list(g.mig_uuids)) for g in listed]
    why = f"nvidia-smi -q failed (exit {failed.returncode})"
    for gpu in inventory.gpus:
        gpu.errors.update(dict.fromkeys(("ecc_uncorrected_volatile", "clock_event_reasons", "memory_info"), why))
    inventory.notes.append(f"{why}; only nvidia-smi -L was read")
    return inventory


def _read_indices(run: Callable[..., CommandResult], inventory: GpuInventory) -> None:
    """GPU indices (and the recovery action, where the driver reports it) by bus id from one CSV query."""
    fields = ["index", "pci.bus_id", "gpu_recovery_action"]
    csv = run("--query-gpu=" + ",".join(fields), "--format=csv,noheader")
    if csv.returncode != 0:
        inventory.notes.append("this driver's nvidia-smi does not report gpu_recovery_action")
        fields = fields[:2]
        csv = run("--query-gpu=" + ",".join(fields), "--format=csv,noheader")
    if csv.returncode != 0:
        inventory.notes.append("GPU indices are the order of nvidia-smi -q (the CSV query failed)")
        return
    by_bus = {smi.short_bus_id(row["pci.bus_id"] or ""): row for row in smi.parse_csv(csv.stdout, fields)}
    for gpu in inventory.gpus:
        row = by_bus.get(smi.short_bus_id(gpu.bus_id))
        if row is None:
            continue
        gpu.index = int(row["index"] or gpu.index)
        if "gpu_recovery_action" in row and row["gpu_recovery_action"] is not None:
            gpu.recovery_action = row["gpu_recovery_action"]
        elif "gpu_recovery_action" in row:
            gpu.unsupported.append("recovery_action")


def _read_mig_devices(listing: CommandResult, inventory: GpuInventory) -> None:
    if listing.returncode != 0 or listing.timed_out:
        inventory.notes.append("MIG device UUIDs unknown: nvidia-smi -L failed")
        return
    listed, _ = smi.parse_list(listing.output)
    by_uuid = {g.uuid: g for g in listed}
    for gpu in inventory.gpus:
        match = by_uuid.get(gpu.uuid)
        if match is not None:
            gpu.mig_uuids = list(match.mig_uuids)
