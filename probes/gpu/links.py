"""gpu.nvlink and gpu.fabric: each GPU's NVLinks and, on NVSwitch systems, its fabric state and the fabric manager.

Its own probe (not part of `gpu`), so a hung NVML call or `nvidia-smi nvlink` delays no other check. Through NVML
where it loads (found like the gpu probe's, probes/gpu/backends.py; the reads in probes/gpu/links_nvml.py: link
states, error counters and fabric info per GPU in one pass), else through nvidia-smi (probes/gpu/links_smi.py):
`nvidia-smi -q` for each GPU's identity and Fabric section, `nvidia-smi nvlink -s` for link states,
`nvidia-smi nvlink -e` for the error counters; each call bounded by `gpu.smi_timeout_seconds` and the run's
deadline. Both give the counters the same names, so the window goes on when the backend changes. An NVML error
on one GPU makes that GPU's check unknown (GpuLinksUnreadable with the error); NOT_SUPPORTED (a GPU without
NVLink, a fabric before Hopper) is no finding about it. Every finding is about one GPU and carries its identity
(device index, UUID, PCI Bus-Id, /dev minor under the OBSERVED_* keys) as gpu.health's do, so a bad link
isolates that GPU, not the node. The thresholds are in the `interconnect:` section (docs/probes/interconnect.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from probes.base import (
    NOT_APPLICABLE,
    OBSERVED_DEVICE_IDS,
    OBSERVED_DEVICE_MINOR,
    OBSERVED_PCI_BUS_ID,
    PARSE_ERROR,
    Check,
    Finding,
    Probe,
    ProbeContext,
    ProbeOutput,
    ProbeParseError,
    Reason,
    Sample,
    Status,
    register,
)
from probes.gpu.backends import find_tools
from probes.gpu.config import GpuConfig
from probes.gpu.gpu import device_minors
from probes.gpu.links_nvml import read_links_nvml
from probes.gpu.links_smi import FabricState, GpuLinks, parse_errors, parse_fabric, parse_status
from probes.gpu.nvml import NvmlUnavailable
from probes.interconnect.config import NVLINK_STATE, InterconnectConfig
from probes.interconnect.window import CounterWindows
from probes.runtime.procfs import process_info

NVLINK = Check("gpu.nvlink")
FABRIC = Check("gpu.fabric")

NVLINK_DOWN = Reason(
    "NvlinkDown",
    Status.FAIL,
    "a GPU has fewer active NVLinks than expected (interconnect.nvlink_expected_active_links, else the most any "
    "GPU of the node has)",
    "an NVLink of this GPU is down: `nvidia-smi nvlink -s -i N` names it; reset the GPU (`nvidia-smi -r -i N`) "
    "with no job on it, else drain the node for a reseat or RMA",
)
NVLINK_ERRORS = Reason(
    "NvlinkErrors",
    Status.WARN,
    "NVLink replay + CRC errors rose by interconnect.nvlink_error_threshold within the window (warn), or a "
    "recovery error occurred (fail)",
    "the GPU's NVLinks retrain or retransmit (`nvidia-smi nvlink -e -i N`): a recovery error stalls collectives; "
    "reset the GPU, and replace it if the counters keep rising; it clears when the window passes quietly",
    also=(Status.FAIL,),
)
FABRIC_NOT_READY = Reason(
    "FabricNotReady",
    Status.FAIL,
    "on an NVSwitch system, the GPU's fabric state is not Completed/Success (`nvidia-smi -q`: Fabric)",
    "the NVSwitch fabric has not registered this GPU (state In Progress/Not Started, or a failure status): check "
    "`systemctl status nvidia-fabricmanager` and /var/log/fabricmanager.log; restart the fabric manager, reset "
    "the GPU, or reboot",
)
FABRIC_MANAGER_DOWN = Reason(
    "FabricManagerDown",
    Status.FAIL,
    "on an NVSwitch system, no nv-fabricmanager process runs on the host (every GPU is affected)",
    "start it: `systemctl start nvidia-fabricmanager` (its version must match the driver's); without it no CUDA "
    "job can use the GPUs' NVLinks",
)
LINKS_UNREADABLE = Reason(
    "GpuLinksUnreadable",
    Status.UNKNOWN,
    "NVML returned an error for the GPU's NVLink or fabric query (not NOT_SUPPORTED), or nvidia-smi did not "
    "answer (timed out or failed)",
    "run `nvidia-smi nvlink -s -i N` and `nvidia-smi -q -i N` by hand; an NVML error such as GPU is lost, or a hung "
    "nvidia-smi, points at a wedged GPU or driver (gpu.health names it): reset the GPU or drain the node",
)
LINK_REASONS = (NVLINK_DOWN, NVLINK_ERRORS, FABRIC_NOT_READY, FABRIC_MANAGER_DOWN, LINKS_UNREADABLE)
FABRIC_MANAGER_COMM = "nv-fabricmanage"  # nv-fabricmanager, as the kernel's 15-byte task name keeps it
HARD_COUNTERS = ("recovery_errors",)
SOFT_COUNTERS = ("replay_errors", "crc_errors")


class Unreadable(Exception):
    pass


def fabric_manager_running(proc: Path) -> bool:
    """A host process (uid 0, not in a pod or container: a tenant cannot stand in for it) named nv-fabricmanager."""
    try:
        pids = [int(name) for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            comm = (proc / str(pid) / "comm").read_text(errors="replace").strip()
        except OSError:
            continue
        if comm != FABRIC_MANAGER_COMM:
            continue
        info = process_info(proc, pid, with_command=False)
        if info is not None and info.uid == 0 and info.cgroup.kind in ("service", "host", "session"):
            return True
    return False


def _identity(fabric: FabricState | None, index: int, links: GpuLinks | None) -> dict[str, object]:
    uuid = (fabric.uuid if fabric else "") or (links.uuid if links else "")
    observed: dict[str, object] = {OBSERVED_DEVICE_IDS: [uuid] if uuid else []}
    if fabric is not None and fabric.bus_id:
        observed[OBSERVED_PCI_BUS_ID] = fabric.bus_id
    if fabric is not None and fabric.minor is not None:
        observed[OBSERVED_DEVICE_MINOR] = fabric.minor
    return observed


def _labels(index: int, fabric: FabricState | None, links: GpuLinks | None) -> dict[str, str]:
    """dcgm-exporter's labels for the same GPU (`gpu`, `UUID`, `pci_bus_id`), as the gpu probe's series have."""
    uuid = (fabric.uuid if fabric else "") or (links.uuid if links else "")
    return {"gpu": str(index), "UUID": uuid, "pci_bus_id": fabric.bus_id if fabric else ""}


@register
class GpuLinksProbe(Probe):
    name = "gpu.links"
    checks = ("gpu.nvlink", "gpu.fabric")
    reasons = LINK_REASONS
    default_interval = 60.0
    default_timeout = 20.0
    needs = "NVML (libnvidia-ml.so.1), else nvidia-smi (nvlink -s, nvlink -e, -q); /proc for nv-fabricmanager"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.time
        self._windows: CounterWindows | None = None

    def applicable(self, ctx: ProbeContext) -> str | None:
        cfg = ctx.settings(GpuConfig)
        if not cfg.expected_gpus and not device_minors(ctx.host.dev):
            return "no NVIDIA GPU on this host (no /dev/nvidiaN, gpu.expected_gpus unset)"
        if find_tools(ctx, cfg).any:
            return None
        return "neither NVML nor nvidia-smi on this host (NVLink and the fabric are read through them)"

    def _run_smi(self, ctx: ProbeContext, command: tuple[str, ...], *args: str) -> str:
        timeout = max(0.1, min(ctx.settings(GpuConfig).smi_timeout_seconds, ctx.remaining()))
        result = ctx.host.run([*command, *args], timeout=timeout)
        if result.not_found:
            raise Unreadable(f"{command[0]} not found")
        if result.timed_out:
            raise Unreadable(f"nvidia-smi {' '.join(args)} did not answer within {timeout:g}s")
        if result.returncode != 0 and "does not have or support" not in result.output.lower():
            first = (result.output.strip().splitlines() or [f"exit status {result.returncode}"])[0]
            raise Unreadable(f"nvidia-smi {' '.join(args)} failed: {first[:200]}")
        return result.output

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        why = self.applicable(ctx)
        if why is not None:
            return [NVLINK.report(NOT_APPLICABLE, "", why), FABRIC.report(NOT_APPLICABLE, "", why)]
        tools = find_tools(ctx, ctx.settings(GpuConfig))
        nvml_error = ""
        if tools.nvml is not None:
            try:
                reading = read_links_nvml(tools.nvml)
                return self._judge(ctx, "nvml", reading.fabric, reading.links, reading.links)
            except NvmlUnavailable as exc:
                nvml_error = f"NVML: {exc}"
        if not tools.smi_commands:
            message = f"{nvml_error}; no nvidia-smi to fall back on ({tools.looked})"
            return [NVLINK.report(LINKS_UNREADABLE, "", message), FABRIC.report(LINKS_UNREADABLE, "", message)]
        command = tools.smi_commands[0]
        try:
            fabric = parse_fabric(self._run_smi(ctx, command, "-q"))
            status = parse_status(self._run_smi(ctx, command, "nvlink", "-s"))
            errors = parse_errors(self._run_smi(ctx, command, "nvlink", "-e"))
        except Unreadable as exc:
            message = f"{nvml_error}; {exc}" if nvml_error else str(exc)
            return [NVLINK.report(LINKS_UNREADABLE, "", message), FABRIC.report(LINKS_UNREADABLE, "", message)]
        except ProbeParseError as exc:
            return [NVLINK.report(PARSE_ERROR, "", str(exc)), FABRIC.report(PARSE_ERROR, "", str(exc))]
        return self._judge(ctx, "nvidia-smi", fabric, status, errors)

    def _judge(
        self,
        ctx: ProbeContext,
        source: str,
        fabric: list[FabricState],
        status: dict[int, GpuLinks],
        errors: dict[int, GpuLinks],
    ) -> ProbeOutput:
        settings = ctx.settings(InterconnectConfig)
        out: ProbeOutput = []
        out.extend(self._nvlink(fabric, status, errors, settings))
        out.extend(self._fabric(ctx, fabric, settings))
        extra = {"source": source}
        if self._windows is not None and self._windows.error:
            extra["state_error"] = self._windows.error  # the NVLink windows will not survive a restart
        return [
            replace(item, observed={**item.observed, **extra}) if isinstance(item, Finding) and item.subject else item
            for item in out
        ]

    def _windows_for(self, settings: InterconnectConfig) -> CounterWindows:
        windows = self._windows
        wanted = (settings.state_path(NVLINK_STATE), settings.window_seconds)
        if windows is None or (windows.state_file, windows.window) != wanted:
            windows = self._windows = CounterWindows(*wanted, self._clock)
        return windows

    def _nvlink(
        self,
        fabric: list[FabricState],
        status: dict[int, GpuLinks],
        errors: dict[int, GpuLinks],
        settings: InterconnectConfig,
    ) -> ProbeOutput:
        if not any(gpu.states or gpu.error for gpu in status.values()):
            return [NVLINK.report(NOT_APPLICABLE, "", "no GPU of this node has NVLinks")]
        expected = settings.nvlink_expected_active_links
        if expected is None:
            expected = max((gpu.active for gpu in status.values() if not gpu.error), default=0)
        windows = self._windows_for(settings)
        out: ProbeOutput = []
        keys: list[str] = []
        for index, links in sorted(status.items()):
            identity = fabric[index] if index < len(fabric) else None
            if links.error:
                message = f"GPU {index}: NVLinks unreadable: {links.error}"
                observed = _identity(identity, index, links)
                out.append(NVLINK.report(LINKS_UNREADABLE, f"gpu{index}", message, observed, device=index))
                keys.extend(windows.keys_of(f"{links.uuid or index}/"))  # its window waits for the next reading
                continue
            if not links.states and settings.nvlink_expected_active_links is None:
                # NVML NOT_SUPPORTED, or no link line: a GPU without NVLink (a PCIe card beside HGX ones)
                message = f"GPU {index} has no NVLinks"
                observed = _identity(identity, index, links)
                out.append(NVLINK.report(NOT_APPLICABLE, f"gpu{index}", message, observed, device=index))
                continue
            labels = _labels(index, identity, links)
            counters = errors.get(index, GpuLinks(index)).counters
            for link, values in counters.items():
                for name, value in values.items():
                    key = f"{links.uuid or index}/{link} {name}"
                    windows.update(key, value)
                    keys.append(key)
                    out.append(
                        Sample(
                            "nodehealth_gpu_nvlink_errors_total",
                            "NVLink error counters of a GPU's link since the driver loaded, by counter",
                            float(value),
                            {**labels, "link": str(link), "counter": name},
                            kind="counter",
                        )
                    )
            for link, up in links.states.items():
                out.append(
                    Sample(
                        "nodehealth_gpu_nvlink_active",
                        "1 while the GPU's NVLink is active",
                        float(up),
                        {**labels, "link": str(link)},
                    )
                )
            out.append(self._judge_links(index, links, counters, windows, expected, settings, identity))
        windows.retain(keys)
        windows.save()
        return out

    @staticmethod
    def _judge_links(
        index: int,
        links: GpuLinks,
        counters: dict[int, dict[str, int]],
        windows: CounterWindows,
        expected: int,
        settings: InterconnectConfig,
        identity: FabricState | None,
    ) -> Finding:
        subject = f"gpu{index}"
        observed = {**_identity(identity, index, links), "active_links": links.active, "expected_links": expected}
        increases: dict[str, int] = {}
        for link, values in counters.items():
            for name in values:
                rise = windows.increase(f"{links.uuid or index}/{link} {name}")
                if rise:
                    increases[name] = increases.get(name, 0) + rise
        observed.update({f"{name}_in_window": value for name, value in increases.items()})
        if links.active < expected:
            down = sorted(link for link, up in links.states.items() if not up)
            message = f"GPU {index}: {links.active} of {expected} NVLinks active (inactive: {down})"
            return NVLINK.report(NVLINK_DOWN, subject, message, observed, device=index)
        hard = sum(increases.get(name, 0) for name in HARD_COUNTERS)
        soft = sum(increases.get(name, 0) for name in SOFT_COUNTERS)
        if hard or soft >= settings.nvlink_error_threshold:
            listed = ", ".join(f"{name} +{value}" for name, value in sorted(increases.items()))
            message = f"GPU {index}: NVLink {listed} within {settings.window_seconds:g}s"
            status = Status.FAIL if hard else Status.WARN
            return NVLINK.report(NVLINK_ERRORS, subject, message, observed, status=status, device=index)
        return NVLINK.ok(subject, f"GPU {index}: {links.active} NVLinks active", observed, device=index)

    @staticmethod
    def _fabric(ctx: ProbeContext, fabric: list[FabricState], settings: InterconnectConfig) -> ProbeOutput:
        if not any(gpu.supported for gpu in fabric):
            why = "not an NVSwitch system (every GPU's fabric state is N/A)"
            out: ProbeOutput = [FABRIC.report(NOT_APPLICABLE, "", why)]
            for index, gpu in enumerate(fabric):  # no GPU has a fabric state; one that could not say is unknown
                if gpu.error:
                    message = f"GPU {index}: fabric state unreadable: {gpu.error}"
                    observed = _identity(gpu, index, None)
                    out.append(FABRIC.report(LINKS_UNREADABLE, f"gpu{index}", message, observed, device=index))
            return out if len(out) == 1 else out[1:]
        manager = not settings.fabric_manager_check or fabric_manager_running(ctx.host.proc)
        out = []
        for index, gpu in enumerate(fabric):
            subject = f"gpu{index}"
            observed = {**_identity(gpu, index, None), "state": gpu.state, "status": gpu.status}
            if gpu.health_mask is not None:
                observed["health_mask"] = gpu.health_mask
            if gpu.error:
                message = f"GPU {index}: fabric state unreadable: {gpu.error}"
                out.append(FABRIC.report(LINKS_UNREADABLE, subject, message, observed, device=index))
                continue
            out.append(
                Sample(
                    "nodehealth_gpu_fabric_completed",
                    "1 while the GPU's NVSwitch fabric state is Completed with status Success",
                    float(gpu.state == "Completed" and gpu.status == "Success"),
                    _labels(index, gpu, None),
                )
            )
            if not manager:
                message = f"GPU {index}: no nv-fabricmanager process on the host (fabric {gpu.state}/{gpu.status})"
                out.append(FABRIC.report(FABRIC_MANAGER_DOWN, subject, message, observed, device=index))
            elif gpu.state != "Completed" or gpu.status != "Success":
                message = f"GPU {index}: fabric state {gpu.state or 'absent'}, status {gpu.status or 'absent'}"
                out.append(FABRIC.report(FABRIC_NOT_READY, subject, message, observed, device=index))
            else:
                out.append(FABRIC.ok(subject, f"GPU {index}: fabric Completed/Success", observed, device=index))
        return out
