"""npu.smi, npu.health, npu.hbm, npu.holders: Ascend NPUs as npu-smi and /proc see them.

- npu.smi: npu-smi answers (or why not: -8005 init failure, -8020 device held elsewhere, permission,
  timeout). A missing npu-smi makes the whole probe skip.
- npu.health: per chip, the health word (Warning → warn, Alarm / Critical → fail; configurable) with the
  error codes of `-t health`; chips expected (a /dev/davinciN node, or npu.expected_chips) but not listed.
- npu.hbm: per chip, free device memory below npu.min_hbm_free_mib; memory in use with no process.
- npu.holders: processes holding the NPU device nodes (matched by device number, so a container's own
  /dev/davinci0 counts) merged with npu-smi's process list, classified by cgroup: outside a pod → fail.

Detail queries (`-m`, `-t health`, `-t proc-mem`) are not supported everywhere: when one fails, what the
main table said stands, and the failure is noted in the finding's observed data.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from probes.base import (
    OBSERVED_HBM_FREE_MIB,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Sample,
    Status,
    register,
)
from probes.npu.smi_parse import (
    ChipMapping,
    HealthDetail,
    NpuChip,
    NpuInfo,
    SmiFailure,
    classify_failure,
    parse_health,
    parse_info,
    parse_mapping,
    parse_proc_mem,
    resolve_ids,
)
from probes.runtime import procfs as _procfs

MIB = 1024 * 1024
_DAVINCI = re.compile(r"^davinci(\d+)$")
# Where npu-smi lives on Ascend hosts, for a command run in the host's mount namespace (nsenter ... --).
_HOST_BIN_DIRS = ("/usr/local/bin", "/usr/local/sbin", "/usr/bin", "/usr/sbin", "/bin", "/sbin")

# Metric value of each health word (documented in README.md, Metrics).
HEALTH_METRIC = {"ok": 0, "warning": 1, "alarm": 2, "critical": 3}
HEALTH_METRIC_OTHER = 4  # UNKNOWN (device absent or not started) and words npu-smi has not printed before

_HEALTH_HINT = (
    "look the error codes up in Ascend's fault-code table (faultCode.json of the device plugin); drain the node "
    "and reset the chip (npu-smi set -t reset -i {card} -c {chip}) or reboot; replace the card if it comes back"
)
_SCAN_HINT = "a process stuck on a hung filesystem can stall the scan: look for D-state processes (ps -eo pid,stat,cmd)"
_MISSING_HINT = (
    "the chip fell off the bus or did not start: check `dmesg` for davinci/PCIe errors and `lspci -d 19e5:`; "
    "reset or reboot the node; reseat or replace the card if it stays missing"
)


def _chip_subject(chip: NpuChip) -> str:
    return f"npu{chip.logical_id}"


def _chip_labels(chip: NpuChip) -> dict[str, str]:
    return {"chip": str(chip.logical_id), "card": str(chip.card_id), "name": chip.name}


def _chip_observed(chip: NpuChip) -> dict[str, Any]:
    observed: dict[str, Any] = {"card": chip.card_id, "chip": chip.chip_index, "logical_id": chip.logical_id}
    if chip.physical_id is not None:
        observed["physical_id"] = chip.physical_id
    if chip.bus_id:
        observed["bus_id"] = chip.bus_id
    return observed


def _describe_chip(chip: NpuChip) -> str:
    return f"npu{chip.logical_id} ({chip.name or 'NPU'}, card {chip.card_id} chip {chip.chip_index})"


def davinci_numbers(dev_dir: Path) -> list[int]:
    """N of every /dev/davinciN character device in dev_dir."""
    numbers: list[int] = []
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return numbers
    for name in names:
        match = _DAVINCI.match(name)
        if not match:
            continue
        try:
            if os.stat(dev_dir / name).st_mode & 0o170000 == 0o020000:
                numbers.append(int(match.group(1)))
        except OSError:
            continue
    return sorted(numbers)


# --- health ----------------------------------------------------------------------------------------


def health_findings(
    chips: Sequence[NpuChip],
    details: dict[tuple[int, int], HealthDetail | str],
    health_status: dict[str, str],
    davinci: Sequence[int],
    expected_chips: int | None,
) -> list[Finding]:
    """npu.health per chip, plus one node-wide finding about chips expected but not listed."""
    status_of = {word.lower(): status for word, status in health_status.items()}
    out: list[Finding] = []
    for chip in chips:
        observed = _chip_observed(chip)
        observed["health"] = chip.health
        detail = details.get((chip.card_id, chip.chip_index))
        codes: tuple[str, ...] = ()
        information: tuple[str, ...] = ()
        if isinstance(detail, HealthDetail):
            codes, information = detail.error_codes, detail.error_information
            observed["error_codes"] = list(codes)
            if information:
                observed["error_information"] = list(information[:5])
        elif isinstance(detail, str):
            observed["health_detail_error"] = detail
        word = chip.health
        configured = status_of.get(word.lower())
        subject = _chip_subject(chip)
        if configured == "ok":
            out.append(
                Finding(
                    "npu.health",
                    subject,
                    Status.OK,
                    "OK",
                    f"{_describe_chip(chip)}: {word}",
                    observed=observed,
                    device=chip.logical_id,
                )
            )
            continue
        suffix = ""
        if codes:
            suffix += f", error codes {' '.join(codes)}"
        if information:
            suffix += f": {information[0]}"
        hint = _HEALTH_HINT.format(card=chip.card_id, chip=chip.chip_index)
        if configured is None and word.upper() == "UNKNOWN":
            out.append(
                Finding(
                    "npu.health",
                    subject,
                    Status.FAIL,
                    "NpuMissing",
                    f"{_describe_chip(chip)} reports health UNKNOWN (device absent or not started){suffix}",
                    _MISSING_HINT,
                    observed,
                    device=chip.logical_id,
                )
            )
        elif configured is None:
            out.append(
                Finding(
                    "npu.health",
                    subject,
                    Status.UNKNOWN,
                    "NpuHealthUnrecognized",
                    f"{_describe_chip(chip)} reports health {word!r}, a word the agent does not know{suffix}",
                    f"map it in npu.health_status (ok, warn or fail); {hint}",
                    observed,
                    device=chip.logical_id,
                )
            )
        else:
            out.append(
                Finding(
                    "npu.health",
                    subject,
                    Status(configured),
                    "NpuHealth" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", word)),
                    f"{_describe_chip(chip)} health is {word}{suffix}",
                    hint,
                    observed,
                    device=chip.logical_id,
                )
            )
    listed = {chip.device_number for chip in chips}
    missing_nodes = [n for n in davinci if n not in listed]
    for number in missing_nodes:
        out.append(
            Finding(
                "npu.health",
                f"npu{number}",
                Status.FAIL,
                "NpuMissing",
                f"/dev/davinci{number} exists but npu-smi does not list chip {number}",
                _MISSING_HINT,
                {"device_node": f"davinci{number}", "chips_listed": len(chips)},
                device=number,
            )
        )
    observed_count = {"chips_listed": len(chips), "davinci_nodes": len(davinci)}
    if expected_chips is not None:
        observed_count["expected_chips"] = expected_chips
    if expected_chips is not None and len(chips) < expected_chips:
        out.append(
            Finding(
                "npu.health",
                "",
                Status.FAIL,
                "NpuMissing",
                f"npu-smi lists {len(chips)} chips, {expected_chips} expected (npu.expected_chips)",
                _MISSING_HINT,
                observed_count,
            )
        )
    else:
        expected_text = f", {expected_chips} expected" if expected_chips is not None else ""
        out.append(
            Finding(
                "npu.health",
                "",
                Status.OK,
                "OK",
                f"npu-smi lists {len(chips)} chips{expected_text}; {len(davinci)} /dev/davinci nodes",
                observed=observed_count,
            )
        )
    return out


# --- hbm -------------------------------------------------------------------------------------------


def hbm_findings(
    chips: Sequence[NpuChip],
    min_free_mib: float,
    leak_min_mib: float,
    chips_with_fd_holders: set[int],
    proc_mem_errors: dict[tuple[int, int], str],
) -> list[Finding]:
    """npu.hbm per chip: free device memory below the floor; memory in use with no process on the chip."""
    out: list[Finding] = []
    for chip in chips:
        subject = _chip_subject(chip)
        observed = _chip_observed(chip)
        error = proc_mem_errors.get((chip.card_id, chip.chip_index))
        if error:
            observed["proc_mem_error"] = error
        memory = chip.device_memory()
        if memory is None:
            out.append(
                Finding(
                    "npu.hbm",
                    subject,
                    Status.UNKNOWN,
                    "NoData",
                    f"{_describe_chip(chip)}: npu-smi shows no device memory figures",
                    "run `npu-smi info` on the host to see what it prints for this chip",
                    observed,
                    device=chip.logical_id,
                )
            )
            continue
        kind, used, total = memory
        free = total - used
        observed.update({"memory": kind, "used_mib": used, "total_mib": total, OBSERVED_HBM_FREE_MIB: free})
        if chip.processes is not None:
            observed["processes"] = len(chip.processes)
            observed["process_memory_mib"] = sum(p.memory_mib or 0 for p in chip.processes)
        label = "HBM" if kind == "hbm" else "device memory"
        leaked = (
            chip.processes is not None
            and not chip.processes
            and used > leak_min_mib
            and chip.device_number not in chips_with_fd_holders
        )
        if leaked:
            out.append(
                Finding(
                    "npu.hbm",
                    subject,
                    Status.FAIL,
                    "NpuHbmLeaked",
                    f"{_describe_chip(chip)}: {used} MiB of {label} in use with no process on the chip "
                    f"(above {leak_min_mib:g} MiB)",
                    f"memory of an exited job was not released: reset the chip (npu-smi set -t reset -i "
                    f"{chip.card_id} -c {chip.chip_index}) or reboot the node",
                    observed,
                    device=chip.logical_id,
                )
            )
        elif free < min_free_mib:
            holders = ", ".join(f"{p.pid} ({p.name or '?'})" for p in (chip.processes or ())[:5])
            out.append(
                Finding(
                    "npu.hbm",
                    subject,
                    Status.FAIL,
                    "NpuHbmLow",
                    f"{_describe_chip(chip)}: {free} MiB of {label} free of {total} MiB, below {min_free_mib:g} MiB"
                    + (f"; processes {holders}" if holders else ""),
                    "stop the leftover processes on the chip (npu-smi info lists them); if none, reset the chip "
                    "or reboot",
                    observed,
                    device=chip.logical_id,
                )
            )
        else:
            out.append(
                Finding(
                    "npu.hbm",
                    subject,
                    Status.OK,
                    "OK",
                    f"{_describe_chip(chip)}: {free} MiB of {label} free of {total} MiB",
                    observed=observed,
                    device=chip.logical_id,
                )
            )
    return out


# --- holders ---------------------------------------------------------------------------------------


@dataclass
class Holder:
    """One process (keyed by pid and start time) holding NPU device nodes or listed by npu-smi."""

    info: _procfs.ProcessInfo
    devices: set[str] = field(default_factory=set)  # device node names: davinci0, davinci_manager
    sources: set[str] = field(default_factory=set)  # "fd" (open file) and/or "npu-smi" (its process list)

    def describe(self) -> dict[str, Any]:
        return {
            "pid": self.info.pid,
            "start_time": self.info.start_time,
            "command": self.info.command[:120],
            "cgroup": self.info.cgroup.describe(),
            "cgroup_path": self.info.cgroup.path,
            "kind": self.info.cgroup.kind,
            "devices": sorted(self.devices),
            "sources": sorted(self.sources),
        }


@dataclass
class HolderScan:
    holders: list[Holder]
    vanished: int = 0
    permission_denied: int = 0
    processes: int = 0
    duration: float = 0.0
    error: str = ""  # the fd scan failed (timeout, error): only npu-smi's list was used


def collect_holders(
    proc: Path,
    scan: _procfs.ScanResult | None,
    rdev_paths: dict[int, str],
    smi_pids: dict[int, set[str]],
) -> tuple[list[Holder], int]:
    """Merge fd-scan matches (by rdev) with npu-smi's PIDs (pid → device names); (holders, vanished)."""
    holders: dict[tuple[int, int], Holder] = {}
    vanished = 0
    infos: dict[int, _procfs.ProcessInfo | None] = {}

    def info_of(pid: int) -> _procfs.ProcessInfo | None:
        if pid not in infos:
            infos[pid] = _procfs.process_info(proc, pid)
        return infos[pid]

    for match in scan.matches if scan else ():
        info = info_of(match.pid)
        if info is None or info.start_time != match.start_time:
            vanished += 1  # exited (or the pid was reused) between the scan and now
            continue
        holder = holders.setdefault(info.key, Holder(info))
        path = rdev_paths.get(match.key[1]) if match.key and match.key[0] == "rdev" else None
        holder.devices.add(Path(path).name if path else match.target)
        holder.sources.add("fd")
    for pid, devices in smi_pids.items():
        info = info_of(pid)
        if info is None:
            vanished += 1  # gone, or not visible from here (the agent needs hostPID)
            continue
        holder = holders.setdefault(info.key, Holder(info))
        holder.devices.update(devices)
        holder.sources.add("npu-smi")
    return sorted(holders.values(), key=lambda h: h.info.key), vanished


def _stop_hint(holder: Holder) -> str:
    owner = holder.info.cgroup
    if owner.kind == "container":
        runtime = owner.runtime or "the runtime"
        tool = {"docker": "docker", "podman": "podman", "containerd": "nerdctl", "cri-o": "crictl"}.get(
            owner.runtime or "", runtime
        )
        return f"stop the container ({tool} stop {(owner.container_id or '')[:12]})"
    if owner.kind == "service":
        return f"stop the service (systemctl stop {owner.unit})"
    return f"stop the process (kill {holder.info.pid})"


def _holder_phrase(holder: Holder, device: str) -> str:
    command = holder.info.command[:80] or holder.info.comm
    return f"PID {holder.info.pid} ({command}) holds /dev/{device} from {holder.info.cgroup.describe()}"


def holder_findings(
    chips: Sequence[NpuChip],
    davinci: Sequence[int],
    scan: HolderScan | None,
    ignore_commands: Sequence[str],
    dev_dir: Path | str = "/dev",
    holder_patterns: Sequence[str] = (),
) -> tuple[list[Finding], dict[int, int], int]:
    """npu.holders per chip (and node-wide for the shared nodes); (findings, out-of-band count per device
    number, shared-only out-of-band count)."""
    by_number: dict[int, NpuChip] = {c.device_number: c for c in chips if c.device_number is not None}
    numbers = sorted(set(by_number) | set(davinci))
    out_of_band_per_number: dict[int, int] = dict.fromkeys(numbers, 0)
    if scan is None:
        skip = Finding(
            "npu.holders",
            "",
            Status.SKIP,
            "NotApplicable",
            f"no NPU device nodes ({', '.join(holder_patterns)}) under {dev_dir} and no NPU processes",
        )
        return [skip], out_of_band_per_number, 0

    def ignored(holder: Holder) -> bool:
        names = (holder.info.comm, holder.info.command.split(" ", 1)[0].rsplit("/", 1)[-1])
        return any(fnmatch.fnmatchcase(n, pattern) for n in names if n for pattern in ignore_commands)

    base_observed = {
        "vanished": scan.vanished,
        "permission_denied": scan.permission_denied,
        "processes_scanned": scan.processes,
        "scan_seconds": round(scan.duration, 3),
    }
    if scan.error:
        base_observed["scan_error"] = scan.error
    kept = [h for h in scan.holders if not ignored(h)]
    ignored_count = len(scan.holders) - len(kept)
    findings: list[Finding] = []
    chip_holders: dict[int, list[Holder]] = {n: [] for n in numbers}
    shared_only: list[Holder] = []
    for holder in kept:
        held_numbers = [int(m.group(1)) for d in holder.devices if (m := _DAVINCI.match(d))]
        for number in held_numbers:
            chip_holders.setdefault(number, []).append(holder)
        if not held_numbers:
            shared_only.append(holder)
    for number in sorted(chip_holders):
        holders = chip_holders[number]
        chip = by_number.get(number)
        subject = _chip_subject(chip) if chip else f"npu{number}"
        device = chip.logical_id if chip else number
        outside = [h for h in holders if not h.info.cgroup.in_pod]
        out_of_band_per_number[number] = len(outside)
        observed = {
            **base_observed,
            "device_node": f"davinci{number}",
            "holders_in_pods": len(holders) - len(outside),
            "holders_out_of_band": len(outside),
            "holders": [h.describe() for h in holders[:10]],
        }
        if outside:
            first = outside[0]
            more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
            findings.append(
                Finding(
                    "npu.holders",
                    subject,
                    Status.FAIL,
                    "NpuHeldOutOfBand",
                    _holder_phrase(first, f"davinci{number}") + ", outside Kubernetes" + more,
                    f"{_stop_hint(first)}, or run it through Kubernetes so the device plugin accounts for the NPU",
                    observed,
                    device=device,
                )
            )
        elif scan.error:
            findings.append(
                Finding(
                    "npu.holders",
                    subject,
                    Status.UNKNOWN,
                    "NpuHolderScanFailed",
                    f"could not scan /proc for holders of /dev/davinci{number}: {scan.error}",
                    _SCAN_HINT,
                    observed,
                    device=device,
                )
            )
        else:
            in_pods = f", {len(holders)} in pods" if holders else ""
            findings.append(
                Finding(
                    "npu.holders",
                    subject,
                    Status.OK,
                    "OK",
                    f"/dev/davinci{number}: no holder outside Kubernetes{in_pods}",
                    observed=observed,
                    device=device,
                )
            )
    outside_shared = [h for h in shared_only if not h.info.cgroup.in_pod]
    observed = {
        **base_observed,
        "holders_ignored": ignored_count,
        "shared_holders_out_of_band": len(outside_shared),
        "holders": [h.describe() for h in outside_shared[:10]],
    }
    if outside_shared:
        first = outside_shared[0]
        more = f" (and {len(outside_shared) - 1} more)" if len(outside_shared) > 1 else ""
        findings.append(
            Finding(
                "npu.holders",
                "",
                Status.WARN,
                "NpuHeldOutOfBand",
                _holder_phrase(first, sorted(first.devices)[0]) + ", outside Kubernetes" + more,
                f"{_stop_hint(first)}, or run it through Kubernetes; if it is a node daemon that must stay, add its "
                "command to npu.holder_ignore_commands",
                observed,
            )
        )
    elif scan.error and not scan.holders:
        findings.append(
            Finding(
                "npu.holders",
                "",
                Status.UNKNOWN,
                "NpuHolderScanFailed",
                f"could not scan /proc for NPU device holders: {scan.error}",
                _SCAN_HINT,
                observed,
            )
        )
    else:
        findings.append(
            Finding(
                "npu.holders",
                "",
                Status.OK,
                "OK",
                f"no NPU device held outside Kubernetes ({len(kept)} holders, {ignored_count} ignored)",
                observed=observed,
            )
        )
    return findings, out_of_band_per_number, len(outside_shared)


# --- metrics ---------------------------------------------------------------------------------------


def chip_samples(chips: Sequence[NpuChip], out_of_band: dict[int, int]) -> list[Sample]:
    samples: list[Sample] = []
    for chip in chips:
        labels = _chip_labels(chip)
        health = HEALTH_METRIC.get(chip.health.lower(), HEALTH_METRIC_OTHER)
        samples.append(
            Sample(
                "nodehealth_npu_health",
                "npu-smi health per chip: 0 OK, 1 Warning, 2 Alarm, 3 Critical, 4 UNKNOWN or unrecognised.",
                health,
                labels,
            )
        )
        if chip.hbm_total_mib:
            samples.append(
                Sample("nodehealth_npu_hbm_total_bytes", "HBM capacity per chip.", chip.hbm_total_mib * MIB, labels)
            )
            if chip.hbm_used_mib is not None:
                samples.append(
                    Sample("nodehealth_npu_hbm_used_bytes", "HBM in use per chip.", chip.hbm_used_mib * MIB, labels)
                )
        if chip.memory_total_mib:
            samples.append(
                Sample(
                    "nodehealth_npu_memory_total_bytes",
                    "Device DDR capacity per chip (310/310P/910A; 910B and later print 0).",
                    chip.memory_total_mib * MIB,
                    labels,
                )
            )
            if chip.memory_used_mib is not None:
                samples.append(
                    Sample(
                        "nodehealth_npu_memory_used_bytes",
                        "Device DDR in use per chip.",
                        chip.memory_used_mib * MIB,
                        labels,
                    )
                )
        if chip.aicore_percent is not None:
            samples.append(
                Sample(
                    "nodehealth_npu_aicore_utilization_ratio",
                    "AI Core utilisation per chip, 0 to 1 (npu-smi AICore(%), or NPU Util(%) on 950).",
                    chip.aicore_percent / 100.0,
                    labels,
                )
            )
        if chip.temperature_celsius is not None:
            samples.append(
                Sample("nodehealth_npu_temperature_celsius", "Chip temperature.", chip.temperature_celsius, labels)
            )
        if chip.power_watts is not None:
            samples.append(
                Sample(
                    "nodehealth_npu_power_watts", "Chip (card) power draw; absent on 310P.", chip.power_watts, labels
                )
            )
        if chip.processes is not None:
            samples.append(
                Sample("nodehealth_npu_processes", "Processes npu-smi lists on the chip.", len(chip.processes), labels)
            )
        if chip.device_number is not None:
            samples.append(
                Sample(
                    "nodehealth_npu_out_of_band_holders",
                    "Processes outside Kubernetes pods holding the chip's /dev/davinciN.",
                    out_of_band.get(chip.device_number, 0),
                    labels,
                )
            )
    return samples


# --- the probe -------------------------------------------------------------------------------------


def _smi_binary(argv: Sequence[str]) -> tuple[str, bool]:
    """(the npu-smi binary, whether it runs in another mount namespace): `nsenter ... -- npu-smi` → npu-smi."""
    if "--" in argv[:-1] and Path(argv[0]).name == "nsenter":
        return argv[list(argv).index("--") + 1], True
    return argv[0], False


@register
class NpuProbe(Probe):
    name = "npu"
    checks = ("npu.smi", "npu.health", "npu.hbm", "npu.holders")
    default_interval = 30.0
    default_timeout = 10.0
    needs = "npu-smi (npu.smi_command); /dev/davinci*; /proc of the host (hostPID) for npu.holders"

    def __init__(self) -> None:
        # `-m` changes only when chips come or go: keep it while the table lists the same chips.
        self._mapping_cache: tuple[tuple[tuple[int, int, str | None], ...], tuple[ChipMapping, ...]] | None = None

    def applicable(self, ctx: ProbeContext) -> str | None:
        argv = ctx.config.npu.smi_command
        if not argv:
            return "npu.smi_command is empty"
        if self._found(ctx, argv[0], host_namespace=False):
            binary, elsewhere = _smi_binary(argv)
            if not elsewhere or self._found(ctx, binary, host_namespace=True):
                return None
            # nsenter into the host: npu-smi may live anywhere on the host's PATH; a davinci node says "NPU host".
            if davinci_numbers(ctx.host.dev):
                return None
            return "no npu-smi on this host"
        return "no npu-smi on this host" if Path(argv[0]).name == "npu-smi" else f"no {argv[0]} on this host"

    @staticmethod
    def _found(ctx: ProbeContext, binary: str, host_namespace: bool) -> bool:
        if not host_namespace:
            if "/" in binary:
                # Present but not executable is a failure to report (permission), not an absent tool.
                return os.path.exists(binary)
            return ctx.host.which(binary) is not None
        if "/" in binary:
            return os.access(ctx.host.root_path(binary), os.X_OK)
        return any(os.access(ctx.host.root_path(f"{d}/{binary}"), os.X_OK) for d in _HOST_BIN_DIRS) or (
            str(ctx.host.root) == "/" and shutil.which(binary) is not None
        )

    def _smi(
        self, ctx: ProbeContext, args: Sequence[str], reserve: float = 0.0
    ) -> tuple[str | None, SmiFailure | None]:
        """Run `npu-smi ARGS` bounded by npu.smi_timeout_seconds and the probe's deadline."""
        settings = ctx.config.npu
        timeout = max(0.1, min(settings.smi_timeout_seconds, ctx.remaining() - reserve))
        result = ctx.host.run([*settings.smi_command, *args], timeout=timeout)
        failure = classify_failure(result, timeout, command=" ".join(["npu-smi", *args]))
        if failure is not None:
            return None, failure
        return result.stdout, None

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.config.npu
        davinci = davinci_numbers(ctx.host.dev)
        out: ProbeOutput = []

        # The fd scan first: it is quick, and a hung npu-smi must not starve it of its deadline.
        scan = self._scan(ctx)

        text, failure = self._smi(ctx, ["info"])
        info: NpuInfo | None = None
        if failure is None and text is not None:
            try:
                info = parse_info(text)
            except ProbeParseError as exc:
                out.extend(
                    self._no_table(
                        Status.UNKNOWN,
                        "ParseError",
                        f"npu-smi info not understood: {exc}",
                        "the table layout is new to the agent: report the `npu-smi info` output",
                        {"output": text[:300]},
                    )
                )
        elif failure is not None and failure.kind == "not_installed":
            out.extend(
                Finding(check, "", Status.SKIP, "NotApplicable", "no npu-smi on this host")
                for check in ("npu.smi", "npu.health", "npu.hbm")
            )
        elif failure is not None:
            observed = {"failure": failure.kind, "output": failure.detail}
            if failure.ret is not None:
                observed["ret"] = failure.ret
            out.extend(self._no_table(Status.FAIL, "NpuSmiFailed", failure.message, failure.hint, observed))

        chips: tuple[NpuChip, ...] = ()
        health_details: dict[tuple[int, int], HealthDetail | str] = {}
        proc_mem_errors: dict[tuple[int, int], str] = {}
        if info is not None:
            smi_observed: dict[str, Any] = {"version": info.version, "chips": len(info.chips)}
            chips, mapping_error = self._resolve(ctx, info)
            if mapping_error:
                smi_observed["mapping_error"] = mapping_error
            chips = self._complete_processes(ctx, info, chips, proc_mem_errors)
            health_details = self._health_details(ctx, info, chips, settings.health_status)
            cards = len({c.card_id for c in chips})
            out.append(
                Finding(
                    "npu.smi",
                    "",
                    Status.OK,
                    "OK",
                    f"npu-smi {info.version or ''}: {len(chips)} chips on {cards} cards".replace("  ", " "),
                    observed=smi_observed,
                )
            )
            out.extend(health_findings(chips, health_details, settings.health_status, davinci, settings.expected_chips))

        smi_pids: dict[int, set[str]] = {}
        for chip in chips:
            for process in chip.processes or ():
                smi_pids.setdefault(process.pid, set()).add(f"davinci{chip.device_number}")
        holder_scan = self._holders(ctx, scan, smi_pids)
        held_numbers = {
            int(m.group(1))
            for h in (holder_scan.holders if holder_scan else ())
            if "fd" in h.sources
            for d in h.devices
            if (m := _DAVINCI.match(d))
        }
        if info is not None:
            out.extend(
                hbm_findings(chips, settings.min_hbm_free_mib, settings.hbm_leak_min_mib, held_numbers, proc_mem_errors)
            )
        holders_out, out_of_band, shared_out_of_band = holder_findings(
            chips, davinci, holder_scan, settings.holder_ignore_commands, ctx.host.dev, settings.holder_devices
        )
        out.extend(holders_out)
        out.extend(chip_samples(chips, out_of_band))
        if holder_scan is not None:
            out.append(
                Sample(
                    "nodehealth_npu_shared_out_of_band_holders",
                    "Processes outside pods holding only shared NPU nodes (davinci_manager, devmm_svm, hisi_hdc).",
                    shared_out_of_band,
                )
            )
        return out

    # --- steps ---

    @staticmethod
    def _no_table(status: Status, reason: str, message: str, hint: str, observed: dict[str, Any]) -> list[Finding]:
        """npu.smi failed: it says why; npu.health and npu.hbm have no chip data (unknown, node-wide)."""
        out = [Finding("npu.smi", "", status, reason, message, hint, observed)]
        out.extend(
            Finding(check, "", Status.UNKNOWN, reason, f"no chip data: {message}", hint, observed)
            for check in ("npu.health", "npu.hbm")
        )
        return out

    def _resolve(self, ctx: ProbeContext, info: NpuInfo) -> tuple[tuple[NpuChip, ...], str]:
        if all(c.logical_id is not None for c in info.chips):
            return info.chips, ""
        key = tuple((c.card_id, c.chip_index, c.bus_id) for c in info.chips)
        if self._mapping_cache is not None and self._mapping_cache[0] == key:
            return resolve_ids(info.chips, self._mapping_cache[1]), ""
        text, failure = self._smi(ctx, ["info", "-m"], reserve=0.5)
        if failure is not None:
            return resolve_ids(info.chips, None), f"npu-smi info -m: {failure.message}"
        try:
            mapping = parse_mapping(text or "")
        except ProbeParseError as exc:
            return resolve_ids(info.chips, None), f"npu-smi info -m not understood: {exc}"
        self._mapping_cache = (key, mapping)
        return resolve_ids(info.chips, mapping), ""

    def _detail_args(self, info: NpuInfo, chip: NpuChip, kind: str) -> list[str]:
        args = ["info", "-t", kind, "-i", str(chip.card_id)]
        if info.has_chip_column:
            args += ["-c", str(chip.chip_index)]
        return args

    def _complete_processes(
        self,
        ctx: ProbeContext,
        info: NpuInfo,
        chips: tuple[NpuChip, ...],
        errors: dict[tuple[int, int], str],
    ) -> tuple[NpuChip, ...]:
        """Chips showing the table's 8-process limit: take the full list from `-t proc-mem`."""
        out = list(chips)
        for i, chip in enumerate(chips):
            if not chip.processes_truncated:
                continue
            key = (chip.card_id, chip.chip_index)
            if ctx.remaining(0) < 1.0:
                errors[key] = "proc-mem not asked: probe deadline near"
                continue
            text, failure = self._smi(ctx, self._detail_args(info, chip, "proc-mem"), reserve=0.5)
            if failure is not None:
                errors[key] = f"npu-smi info -t proc-mem: {failure.message}"
                continue
            try:
                processes = parse_proc_mem(text or "")
            except ProbeParseError as exc:
                errors[key] = f"npu-smi info -t proc-mem not understood: {exc}"
                continue
            if len(processes) >= len(chip.processes or ()):
                out[i] = replace(chip, processes=processes)
        return tuple(out)

    def _health_details(
        self, ctx: ProbeContext, info: NpuInfo, chips: tuple[NpuChip, ...], health_status: dict[str, str]
    ) -> dict[tuple[int, int], HealthDetail | str]:
        """Error codes of every chip whose health is not ok."""
        ok_words = {w.lower() for w, s in health_status.items() if s == "ok"}
        details: dict[tuple[int, int], HealthDetail | str] = {}
        for chip in chips:
            if chip.health.lower() in ok_words:
                continue
            key = (chip.card_id, chip.chip_index)
            if ctx.remaining(0) < 1.0:
                details[key] = "health detail not asked: probe deadline near"
                continue
            text, failure = self._smi(ctx, self._detail_args(info, chip, "health"), reserve=0.5)
            if failure is not None:
                details[key] = f"npu-smi info -t health: {failure.message}"
                continue
            try:
                details[key] = parse_health(text or "")
            except ProbeParseError as exc:
                details[key] = f"npu-smi info -t health not understood: {exc}"
        return details

    def _scan(self, ctx: ProbeContext) -> tuple[_procfs.ScanResult | None, dict[int, str], str]:
        settings = ctx.config.npu
        rdevs = _procfs.device_rdevs(ctx.host.dev, settings.holder_devices)
        if not rdevs:
            return None, rdevs, ""
        timeout = max(0.1, min(settings.holder_scan_timeout_seconds, ctx.remaining() * 0.4))
        try:
            return _procfs.scan_open_files(ctx.host, rdevs=rdevs.keys(), timeout=timeout), rdevs, ""
        except _procfs.ScanError as exc:
            return None, rdevs, str(exc)

    def _holders(
        self,
        ctx: ProbeContext,
        scan: tuple[_procfs.ScanResult | None, dict[int, str], str],
        smi_pids: dict[int, set[str]],
    ) -> HolderScan | None:
        result, rdevs, error = scan
        if result is None and not error and not smi_pids:
            return None  # no NPU device nodes and no processes: nothing to say
        holders, vanished = collect_holders(ctx.host.proc, result, rdevs, smi_pids)
        return HolderScan(
            holders,
            vanished=vanished + (result.vanished if result else 0),
            permission_denied=result.permission_denied if result else 0,
            processes=result.processes if result else 0,
            duration=result.duration if result else 0.0,
            error=error,
        )
