"""The checks and reasons of npu.roce (the parameter plane through hccn_tool), npu.grade (Huawei's fault
grading) and npu.ecc (HBM ECC): each about one chip, so each isolates that chip alone."""

from __future__ import annotations

from probes.base import Check, Reason, Status

LINK = Check("npu.roce.link")
FLAPS = Check("npu.roce.flaps")
NET_HEALTH = Check("npu.roce.net_health")
OPTICAL = Check("npu.roce.optical")
ADDRESS = Check("npu.roce.address")
ROCE_CHECKS = (LINK, FLAPS, NET_HEALTH, OPTICAL, ADDRESS)
GRADE = Check("npu.grade")
ECC = Check("npu.ecc")

_RESEAT = (
    "check the cable and the optical module of the chip's port (hccn_tool -i N -optical -g), reseat or replace "
    "them, and the switch port; bring the port back with `hccn_tool -i N -cfg recovery`"
)
HCCN_TOOL_MISSING = Reason(
    "HccnToolMissing",
    Status.UNKNOWN,
    "NPUs (/dev/davinciN) but no hccn_tool the agent can run: the chips' RoCE ports cannot be read",
    "install the Ascend driver's tools (hccn_tool is in /usr/local/Ascend/driver/tools) or point npu.hccn_command "
    "at it, e.g. [nsenter, -t, 1, -m, --, /usr/local/Ascend/driver/tools/hccn_tool]",
)
HCCN_TOOL_FAILED = Reason(
    "HccnToolFailed",
    Status.UNKNOWN,
    "hccn_tool did not answer within npu.hccn_timeout_seconds, exited with an error or printed too much for one "
    "chip: that chip's port is not judged this run (other chips and probes are not held up)",
    "run the command in the message on the host; a hung hccn_tool means the chip's firmware is not answering: "
    "check `dmesg`, reset the chip or reboot",
)
NPU_LINK_DOWN = Reason(
    "NpuLinkDown",
    Status.FAIL,
    "the chip's RoCE port (the HCCL parameter plane) is DOWN (`hccn_tool -i N -link -g`)",
    _RESEAT,
)
NPU_LINK_FLAPPING = Reason(
    "NpuLinkFlapping",
    Status.FAIL,
    "the port's link-up count rose by more than npu.link_flap_max within npu.link_flap_window_seconds "
    "(`-link_stat -g`); a count that went down (driver reload) restarts the window",
    _RESEAT + "; flapping with a healthy module points at the cable or the switch port (check its error counters)",
)
NPU_NET_UNHEALTHY = Reason(
    "NpuNetUnhealthy",
    Status.FAIL,
    "the firmware's gateway probe (`-net_health -g`) says anything but Success: Fault, Socket failed, "
    "Receive timeout, ...; HCCL jobs over this port hang until their timeout",
    "check the port's address and gateway (hccn_tool -i N -ip -g / -gateway -g against /etc/hccn.conf), the "
    "switch and the route to the gateway; `hccn_tool -i N -net_health -g` again after the fix",
)
NPU_NET_HEALTH_INIT = Reason(
    "NpuNetHealthInit",
    Status.UNKNOWN,
    "the gateway probe says Init: it has not run yet (no detect address configured, or just started)",
    "configure the detect address (hccn_tool -i N -netdetect -s address A.B.C.D, netdetect_N in /etc/hccn.conf)",
)
NPU_OPTICAL_ABSENT = Reason(
    "NpuOpticalAbsent",
    Status.FAIL,
    "the port's optical module is not in position (`-optical -g`: present : not present)",
    "insert or reseat the optical module of the chip's port",
)
NPU_OPTICAL_SIGNAL_LOST = Reason(
    "NpuOpticalSignalLost",
    Status.FAIL,
    "the optical module flags loss of signal or loss of lock (Rx/Tx Los or LoL flag not 0)",
    _RESEAT,
)
NPU_OPTICAL_POWER = Reason(
    "NpuOpticalPower",
    Status.FAIL,
    "a lane's TX or RX power is outside its thresholds (npu.optical_*_mw, else the module's own Low/High Thres); "
    "warn within npu.optical_power_margin of one",
    "clean the fibre's connectors, reseat the module; replace the module or fibre if the power stays out of range",
    also=(Status.WARN,),
)
NPU_OPTICAL_HOT = Reason(
    "NpuOpticalHot",
    Status.FAIL,
    "the optical module is above its temperature threshold (npu.optical_temperature_max_celsius, else the "
    "module's Temp High Thres)",
    "check the node's cooling and the module; replace a module that runs hot",
)
NPU_ADDRESS_MISSING = Reason(
    "NpuAddressMissing",
    Status.FAIL,
    "the chip's RoCE port has no IP address (`-ip -g` printed none): HCCL cannot use it",
    "configure it (hccn_tool -i N -ip -s address A.B.C.D netmask M) or restore /etc/hccn.conf and restart the "
    "driver's network service",
)
NPU_ADDRESS_MISMATCH = Reason(
    "NpuAddressMismatch",
    Status.FAIL,
    "the port's address, netmask or gateway differs from /etc/hccn.conf (address_N, netmask_N, gateway_N)",
    "set the port from /etc/hccn.conf (hccn_tool -i N -ip -s ..., -gateway -s ...) or correct the file",
)
ROCE_REASONS = (
    HCCN_TOOL_MISSING,
    HCCN_TOOL_FAILED,
    NPU_LINK_DOWN,
    NPU_LINK_FLAPPING,
    NPU_NET_UNHEALTHY,
    NPU_NET_HEALTH_INIT,
    NPU_OPTICAL_ABSENT,
    NPU_OPTICAL_SIGNAL_LOST,
    NPU_OPTICAL_POWER,
    NPU_OPTICAL_HOT,
    NPU_ADDRESS_MISSING,
    NPU_ADDRESS_MISMATCH,
)

# --- grade ---
NPU_FAULT_SEPARATE = Reason(
    "NpuFaultSeparate",
    Status.FAIL,
    "an error code graded SeparateNPU or PreSeparateNPU (faultCode.json, else the built-in table): the chip must "
    "leave service whatever its health word says",
    "drain the chip's jobs and have the card inspected or replaced (Huawei's fault handling for the code)",
)
NPU_FAULT_RESET = Reason(
    "NpuFaultReset",
    Status.FAIL,
    "an error code graded RestartRequest, RestartBusiness, RestartNPU or FreeRestartNPU: the chip needs its "
    "job restarted or a reset",
    "restart the job; for RestartNPU/FreeRestartNPU reset the chip (npu-smi set -t reset -i CARD -c CHIP) when "
    "it is idle, or reboot",
)
NPU_FAULT_MINOR = Reason(
    "NpuFaultMinor",
    Status.WARN,
    "an error code graded NotHandleFault or SubHealthFault, or not in the table (treated as NotHandleFault)",
    "nothing to do at once; look the code up in Ascend's fault-code reference if it stays",
)
NPU_FAULT_CODES_INVALID = Reason(
    "NpuFaultCodesInvalid",
    Status.UNKNOWN,
    "the faultCode.json in use (npu.fault_code_files) could not be read or is not the device plugin's format",
    "fix or remove the file (the message names it); the ConfigMap mindx-dl-fault-config holds the plugin's copy",
)
NPU_HEALTH_UNREAD = Reason(
    "NpuHealthUnread",
    Status.UNKNOWN,
    "`npu-smi info -t health` or `-t ecc` failed for the chip",
    "run the command in the message on the host; check `dmesg` for driver errors",
)
GRADE_REASONS = (NPU_FAULT_SEPARATE, NPU_FAULT_RESET, NPU_FAULT_MINOR, NPU_FAULT_CODES_INVALID, NPU_HEALTH_UNREAD)

# --- ecc ---
NPU_ECC_DOUBLE_BIT = Reason(
    "NpuEccDoubleBit",
    Status.FAIL,
    "HBM double-bit (uncorrectable) ECC errors on the chip",
    "drain the chip and reset it (npu-smi set -t reset -i CARD -c CHIP) so the bad pages are isolated; replace "
    "the card if they come back",
)
NPU_ECC_PENDING_PAGES = Reason(
    "NpuEccPendingPages",
    Status.FAIL,
    "HBM pages pending isolation (Next-Isolated Pages): they are isolated at the next reset",
    "reset the chip when it is idle (npu-smi set -t reset -i CARD -c CHIP)",
)
NPU_ECC_SINGLE_BIT_RATE = Reason(
    "NpuEccSingleBitRate",
    Status.WARN,
    "HBM single-bit errors rising faster than npu.ecc_single_bit_per_hour_max",
    "watch the chip; plan its replacement if the rate stays high",
)
NPU_ECC_ISOLATED_PAGES = Reason(
    "NpuEccIsolatedPages",
    Status.WARN,
    "isolated HBM pages at or above npu.ecc_isolated_pages_warn: the chip nears its isolation limit",
    "plan the card's replacement",
)
ECC_REASONS = (NPU_ECC_DOUBLE_BIT, NPU_ECC_PENDING_PAGES, NPU_ECC_SINGLE_BIT_RATE, NPU_ECC_ISOLATED_PAGES)
