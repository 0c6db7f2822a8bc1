"""The default kernel.log rules (config: kernel_log.rules), with where each spelling comes from."""

from __future__ import annotations

from typing import Any

# XIDs that mean the GPU needs a reset or replacement (NVIDIA XID catalogue; 48/63/64 from the page retirement
# doc, 94/95 from ml-engineering's debug guide, 74 NVLink, 79 fallen off the bus, 92 high SBE rate).
GPU_FATAL_XIDS = ("48", "63", "64", "74", "79", "92", "94", "95")

# Every default rule is anchored at the start of the message, to the prefix its driver prints: the kernel logs
# text a task chooses (its name, the file it crashed in) inside and at the start of other records, and an
# unanchored rule would let any pod raise or clear a fault with a file name.
#
# dev_printk's "<driver> <device>: " (pcieport 0000:00:01.0: AER: ..., nvidia 0000:3b:00.0: PCIe Bus Error: ...).
DEVICE_PREFIX = r"^\S+ \S+: "
# drv_printk's "[ascend] [module] [function line] ", then the task it runs for, "<name:pid:tid> ": skipped to
# the line's last ":pid:tid> ", so a task name holding a fault's words is never what a rule reads. The prefix is
# an atomic group: once it has matched, a rule that fails on the rest cannot backtrack into it, neither to an
# earlier ":pid:tid> " inside the name (<:1:1> heartbeat:4242:4243>) nor to skipping the optional "[ERROR] ",
# which reads [ERROR] as the module and the module as the function and leaves the whole "<name:pid:tid> " to
# the rule.
ASCEND_PREFIX = r"^(?>\[ascend\] (?:\[ERROR\] )?\[[^\]]+\] \[[^\]]+\] (?:<.*:\d+:\d+> |(?!<)))"
# The mlx5 driver's dev_printk prefix, with the device's PCI address in full ("mlx5_core 0000:5c:00.0: "): a task
# name is at most 15 bytes and the kernel follows it with "[pid]", so a name can never spell a whole address.
# mlx5_core_err() adds "<function>:<line>:(pid N): " after it (drivers/net/ethernet/mellanox/mlx5/core/
# mlx5_core.h); netdev_info() prints "mlx5_core <address> <interface>: " instead (include/linux/netdevice.h).
MLX5_DEVICE = r"mlx5_core (?P<pci>[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])"
MLX5_PREFIX = r"^" + MLX5_DEVICE + r": (?:\w+:\d+:\(pid \d+\): )?"
# Loop devices hold images (CI runners, snaps, containers' filesystems): their errors are not the node's disks'.
NOT_LOOP = r"(?!loop\d)"

# Default rules (config: kernel_log.rules). Spellings and sources: README.md, Troubleshooting, Kernel log.
DEFAULT_RULES: list[dict[str, Any]] = [
    {
        "reason": "PcieAerFatal",
        "meaning": "the kernel logged a fatal uncorrectable PCIe AER error (drivers/pci/pcie/aer.c)",
        "pattern": DEVICE_PREFIX + r"(?:AER: (?:Multiple )?Uncorrect(?:ed|able) \(Fatal\) error"
        r"|PCIe Bus Error: severity=Uncorrect(?:ed|able) \(Fatal\))",
        "type": "permanent",
        "status": "fail",
        "hint": "a PCIe device reported a fatal uncorrectable error: find it in dmesg (lspci -vvv -s BDF), "
        "drain the node and have the device or riser checked",
    },
    {
        "reason": "PcieAerNonFatal",
        "meaning": "the kernel logged a non-fatal uncorrectable PCIe AER error",
        "pattern": DEVICE_PREFIX + r"(?:AER: (?:Multiple )?Uncorrect(?:ed|able) \(Non-Fatal\) error"
        r"|PCIe Bus Error: severity=Uncorrect(?:ed|able) \(Non-Fatal\))",
        "status": "warn",
        "hint": "uncorrectable non-fatal PCIe errors: watch pcie.aer; repeated errors on one device call for a reseat",
    },
    {
        "reason": "PcieCorrectableBurst",
        "meaning": "the kernel logged corrected PCIe AER errors at 10 or more within 60 s (a marginal link)",
        "pattern": DEVICE_PREFIX
        + r"(?:AER: (?:Multiple )?Correct(?:ed|able) error|PCIe Bus Error: severity=Correct(?:ed|able))",
        "count": 10,
        "window_seconds": 60,
        "status": "warn",
        "hint": "a burst of corrected PCIe errors usually means a marginal link: check pcie.link for a degraded width "
        "or speed and reseat the card or cable",
    },
    {
        "reason": "GpuXid",
        "meaning": "the NVIDIA driver logged an XID error (NVRM: Xid); XIDs 48, 63, 64, 74, 79, 92, 94 and 95 fail",
        "pattern": r"^NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>\d+)",
        "status": "warn",
        "category": "gpu",
        "fail_on": {"xid": list(GPU_FATAL_XIDS)},
        "hint": "look the XID up in NVIDIA's XID catalogue; 48/63/64/74/79/92/94/95 need a GPU reset "
        "(nvidia-smi -r) or a reboot, repeated ones an RMA",
    },
    {
        "reason": "NpuDriverHeartbeatLost",
        "meaning": "the Ascend driver logged a lost or timed-out heartbeat of an NPU (spelling inferred)",
        "pattern": r"(?i)" + ASCEND_PREFIX + r".*heart ?beat.*(?:lost|timeout|timed out|abnormal)",
        "status": "fail",
        "category": "npu",
        "hint": "the NPU stopped answering its driver's heartbeat: check npu-smi info -t health; a chip that stays "
        "lost needs a hot reset (npu-smi set -t reset) or a reboot",
    },
    {
        "reason": "NpuDriverError",
        "meaning": "the Ascend driver logged 20 or more errors within 300 s (spelling inferred)",
        "pattern": ASCEND_PREFIX + r".*(?i:fail|error|timeout|abnormal)",
        "count": 20,
        "window_seconds": 300,
        "status": "warn",
        "category": "npu",
        "hint": "the Ascend driver logs errors at a high rate: read them (dmesg | grep ascend) and check "
        "npu-smi info -t health",
    },
    {
        "reason": "OomKill",
        "meaning": "the kernel's OOM killer (global or a memory cgroup) killed a process",
        "pattern": r"^(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process \d+",
        "status": "warn",
        "hint": "the kernel killed a process for memory: compare the job's memory limit with its use, and look for "
        "leftover processes holding host memory",
    },
    {
        "reason": "HungTask",
        "meaning": "a task was blocked in uninterruptible sleep for more than the hung-task timeout",
        "pattern": r"^INFO: task .+:\d+ blocked for more than \d+ seconds",
        "status": "warn",
        "hint": "a task sat in uninterruptible sleep for minutes, usually on a hung filesystem (NFS) or device: "
        "the lines after it in dmesg show its stack",
    },
    {
        "reason": "NfsServerNotResponding",
        "meaning": "an NFS server stopped answering (cleared at once by its `nfs: server X OK` line)",
        "pattern": r"^nfs: server (?P<server>\S+) not responding",
        "recover_pattern": r"^nfs: server \S+ OK",
        "status": "warn",
        "category": "storage",
        "hint": "an NFS server stopped answering: check the network path to it (storage.mounts shows which mount "
        "hangs); jobs reading from it will stall",
    },
    {
        "reason": "Ext4Error",
        "meaning": "ext4 reported an error or remounted a filesystem read-only",
        "pattern": r"^EXT4-fs (?:error \(device " + NOT_LOOP + r"(?P<device>[^)]+)\)"
        r"|\(" + NOT_LOOP + r"(?P<device>[^)]+)\): Remounting filesystem read-only)",
        "type": "permanent",
        "status": "fail",
        "category": "storage",
        "hint": "ext4 found corruption or an I/O error: check the disk (smartctl -a), unmount and run e2fsck",
    },
    {
        "reason": "XfsError",
        "meaning": "XFS reported an I/O error, corruption or a shutdown",
        "pattern": r"^XFS \(" + NOT_LOOP + r"(?P<device>[^)]+)\): .*(?i:error|corrupt|shut ?down|shutting down)",
        "type": "permanent",
        "status": "fail",
        "category": "storage",
        "hint": "XFS found corruption or an I/O error: check the disk (smartctl -a), unmount and run xfs_repair",
    },
    {
        "reason": "Mlx5ModuleError",
        "meaning": "the mlx5 driver reported a port module (cable/transceiver) error: high temperature, bad or "
        "shorted cable, power budget exceeded, bus stuck (mlx5 core events.c, `Port module event[error]`)",
        "pattern": MLX5_PREFIX + r"Port module event\[error\]: module (?P<module>\d+), (?P<error>.+)",
        "status": "fail",
        "category": "interconnect",
        "hint": "the HCA's cable or transceiver failed (the error names why): check the module with "
        "`mlxlink -d <pci> -m` or `ethtool -m <interface>`, cool it or replace it; interconnect.ports shows the port",
    },
    {
        "reason": "Mlx5CableUnplugged",
        "meaning": "the mlx5 driver reported a port module unplugged (`Port module event: module N, Cable unplugged`)",
        "pattern": MLX5_PREFIX + r"Port module event: module (?P<module>\d+), Cable unplugged",
        "status": "warn",
        "category": "interconnect",
        "hint": "a cable or transceiver of the HCA was pulled or lost contact: reseat it; the port is down until then",
    },
    {
        "reason": "Mlx5LinkDown",
        "meaning": "an mlx5 network interface (RoCE/Ethernet) went down (`mlx5_core <pci> <interface>: Link down`)",
        "pattern": r"^" + MLX5_DEVICE + r" (?P<interface>[^\s:]+)(?: \([a-z]+\))?: Link down",
        "status": "warn",
        "category": "interconnect",
        "hint": "the HCA's link went down: check the cable and the switch port; repeated lines within the quiet "
        "period mean a flapping link (interconnect.ports counts link_downed)",
    },
    {
        "reason": "Mlx5InsufficientPower",
        "meaning": "the mlx5 driver found too little power on the HCA's PCIe slot (mlx5_pcie_event)",
        "pattern": MLX5_PREFIX + r"Detected insufficient power on the PCIe slot",
        "status": "warn",
        "category": "interconnect",
        "hint": "the HCA's slot gives less power than the card needs (it may throttle or drop its link): move the "
        "card to a slot with enough power or fix the riser's power cable",
    },
]
