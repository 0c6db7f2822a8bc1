"""The checks of the npu probe and every reason it can give, with its status, meaning and fix."""

from __future__ import annotations

import re
from collections.abc import Mapping

from probes.base import Check, Reason, Status
from probes.ledger import POD_RESOURCES_UNAVAILABLE

SMI = Check("npu.smi")
HEALTH = Check("npu.health")
HBM = Check("npu.hbm")
HOLDERS = Check("npu.holders")
LEDGER = Check("npu.ledger")

NPU_SMI_FAILED = Reason(
    "NpuSmiFailed",
    Status.FAIL,
    "npu-smi failed: -8020 (device held elsewhere), -8005 (DCMI init failed), permission, timeout, other DCMI "
    "error; npu.health and npu.hbm are then unknown (no chip data)",
    "find and stop the holder (see npu.holders), run the agent as root; check `dmesg`, reload the driver or reboot",
    also=(Status.UNKNOWN,),
)
_HEALTH_FIX = (
    "look the error codes up in Ascend's fault-code table (faultCode.json of the device plugin); drain the node "
    "and reset the chip (npu-smi set -t reset -i CARD -c CHIP) or reboot; replace the card if it comes back"
)
NPU_TOOL_MISSING = Reason(
    "NpuToolMissing",
    Status.UNKNOWN,
    "/dev/davinciN nodes but no npu-smi the agent can run: not through npu.smi_command, not on PATH, not in the "
    "host's bin directories nor the driver's /usr/local/Ascend/driver/tools under host.root; npu.smi, npu.health "
    "and npu.hbm cannot be read (npu.holders still runs)",
    "install the Ascend driver's tools (the run package puts npu-smi in /usr/local/Ascend/driver/tools and links "
    "/usr/local/sbin/npu-smi), or point npu.smi_command at it, e.g. [nsenter, -t, 1, -m, --, "
    "/usr/local/Ascend/driver/tools/npu-smi]; the node is not ready meanwhile (the finding is required; "
    "npu.unreadable_blocks_ready: false lets a node whose chips cannot be read be ready)",
)
NPU_TABLE_TRUNCATED = Reason(
    "NpuTableTruncated",
    Status.UNKNOWN,
    "`npu-smi info` ended early: before its process section (a chip table without its closing border), or it "
    "lists fewer chips than expected "
    "(/dev/davinciN nodes, npu.expected_chips) and `npu-smi info -l` counts more (or cannot count them and the "
    "table's process section does not name every card); the chips left out are not judged missing, npu.smi, "
    "npu.health and npu.hbm are unknown. A table cut after its process header is read: only the processes the cut "
    "took are unknown (npu.smi's observed.processes_cut)",
    "a cut table is a tool problem, not a card problem: run `npu-smi info` on the host and compare with "
    "`npu-smi info -l`; npu-smi killed part-way (raise npu.smi_timeout_seconds) or a driver that stops answering "
    "mid-query (check `dmesg` for davinci/drv errors) cuts it",
)
NPU_HEALTH_WARNING = Reason(
    "NpuHealthWarning",
    Status.WARN,
    "chip health Warning (a minor alarm); the status is npu.health_status's",
    _HEALTH_FIX,
    also=(Status.FAIL,),
)
NPU_HEALTH_ALARM = Reason(
    "NpuHealthAlarm",
    Status.FAIL,
    "chip health Alarm (a major alarm); the status is npu.health_status's",
    _HEALTH_FIX,
    also=(Status.WARN,),
)
NPU_HEALTH_CRITICAL = Reason(
    "NpuHealthCritical",
    Status.FAIL,
    "chip health Critical (an urgent alarm); the status is npu.health_status's",
    _HEALTH_FIX,
    also=(Status.WARN,),
)
NPU_HEALTH_UNRECOGNIZED = Reason(
    "NpuHealthUnrecognized",
    Status.UNKNOWN,
    "a health word the agent does not know",
    "map it in npu.health_status (ok, warn or fail)",
)
NPU_MISSING = Reason(
    "NpuMissing",
    Status.FAIL,
    "a /dev/davinciN (or npu.expected_chips) chip a whole npu-smi table does not list (a cut table is "
    "NpuTableTruncated), or a chip with health UNKNOWN (absent or not started)",
    "the chip fell off the bus or did not start: check `dmesg` for davinci/PCIe errors and `lspci -d 19e5:`; "
    "reset or reboot the node; reseat or replace the card if it stays missing",
)
NPU_HBM_LOW = Reason(
    "NpuHbmLow",
    Status.FAIL,
    "free HBM (DDR on 310/310P) below npu.min_hbm_free_mib",
    "stop the leftover processes on the chip (npu-smi info lists them); if none, reset the chip or reboot",
)
NPU_HBM_LEAKED = Reason(
    "NpuHbmLeaked",
    Status.FAIL,
    "more than npu.hbm_leak_min_mib of HBM in use with no process on the chip",
    "memory of an exited job was not released: reset the chip (npu-smi set -t reset -i CARD -c CHIP) or reboot",
)
NPU_HBM_UNREPORTED = Reason(
    "NpuHbmUnreported",
    Status.UNKNOWN,
    "npu-smi shows no device memory figures for the chip",
    "run `npu-smi info` on the host to see what it prints for the chip",
)
NPU_HELD_OUT_OF_BAND = Reason(
    "NpuHeldOutOfBand",
    Status.FAIL,
    "a process outside any pod holds the chip's /dev/davinciN (fail), or only the shared nodes davinci_manager, "
    "devmm_svm, hisi_hdc (warn)",
    "stop the process, container or service (the hint names the command and PIDs), or run it through "
    "Kubernetes; a node daemon that must stay goes into npu.holder_ignore_commands",
    also=(Status.WARN,),
)
NPU_SHARED_BY_PODS = Reason(
    "NpuSharedByPods",
    Status.FAIL,
    "processes of two or more pods hold the same chip (two schedulers placed jobs on one NPU)",
    "delete one of the pods (the hint names them) and let one scheduler own the NPUs (Volcano or the default "
    "scheduler with the device plugin, not both)",
)
NPU_HOLDER_SCAN_FAILED = Reason(
    "NpuHolderScanFailed",
    Status.UNKNOWN,
    "the /proc/*/fd scan failed, or some processes could not be read (named in the message); out-of-band "
    "holders it did find are still reported",
    "look for processes in D state (ps -eo pid,stat,cmd) and hung mounts (storage.mounts)",
)
NPU_HELD_OUTSIDE_ALLOCATION = Reason(
    "NpuHeldOutsideAllocation",
    Status.FAIL,
    "a pod holds the chip's /dev/davinciN although the device plugin's ledger (the kubelet's PodResources API) "
    "allocated the chip to no pod, or to another pod (both are named); vNPUs and Volcano's huawei.com/AscendReal "
    "are followed",
    "delete the pod that holds the chip without an allocation (a privileged debug pod that mounts /dev, a job a "
    "second scheduler placed without the device plugin): the next job the plugin gives the chip to fails with "
    "-8020 / davinci already in use",
)
NPU_ALLOCATION_DISAGREES = Reason(
    "NpuAllocationDisagrees",
    Status.WARN,
    "a pod holds the chip the kubelet's ledger allocated to it, but Volcano's huawei.com/AscendReal on the pod names "
    "other chips (both are named): the holder scan is believed, never a fail on the annotation's word alone; only "
    "pods a trusted scheduler placed (kubernetes.ascend_real_schedulers) have their annotation read at all",
    "compare `kubectl get pod -o jsonpath='{.metadata.annotations.huawei\\.com/AscendReal}'` with the chip the "
    "pod opened (npu.holders' observed holders); a Volcano that writes another chip than it mounts is a Volcano or "
    "device-plugin problem: see their logs",
)
NPU_DEVICE_PLUGIN_UNHEALTHY = Reason(
    "DevicePluginUnhealthy",
    Status.WARN,
    "the device plugin no longer offers the chip (absent from the kubelet's GetAllocatableResources: it marked it "
    "unhealthy), shown beside the agent's own verdict on the chip; the status is npu.device_plugin_unhealthy_status",
    "the plugin keeps jobs off the chip already: if the agent finds the chip healthy, read the device plugin's log "
    "(it lost the chip, or its health check disagrees); if both find it unhealthy, drain the node and reset the chip",
    also=(Status.FAIL,),
)

REASONS = (
    NPU_SMI_FAILED,
    NPU_TOOL_MISSING,
    NPU_TABLE_TRUNCATED,
    NPU_HEALTH_WARNING,
    NPU_HEALTH_ALARM,
    NPU_HEALTH_CRITICAL,
    NPU_HEALTH_UNRECOGNIZED,
    NPU_MISSING,
    NPU_HBM_LOW,
    NPU_HBM_LEAKED,
    NPU_HBM_UNREPORTED,
    NPU_HELD_OUT_OF_BAND,
    NPU_SHARED_BY_PODS,
    NPU_HOLDER_SCAN_FAILED,
    NPU_HELD_OUTSIDE_ALLOCATION,
    NPU_ALLOCATION_DISAGREES,
    NPU_DEVICE_PLUGIN_UNHEALTHY,
    POD_RESOURCES_UNAVAILABLE,
)
_BY_CODE = {reason.code: reason for reason in REASONS}


def health_reason(word: str) -> Reason:
    """The reason of a health word mapped in npu.health_status: NpuHealthWarning, NpuHealthAlarm, ... and, for a
    word an operator added, NpuHealth<Word> (warn or fail, as mapped)."""
    code = "NpuHealth" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", word))
    return _BY_CODE.get(code) or Reason(
        code, Status.FAIL, f"chip health {word} (mapped in npu.health_status)", _HEALTH_FIX, also=(Status.WARN,)
    )


def configured_health_reasons(health_status: Mapping[str, str]) -> list[Reason]:
    """The reasons the configured health words can produce (the probe allows them beside REASONS)."""
    return [health_reason(word) for word, status in health_status.items() if status != "ok"]
