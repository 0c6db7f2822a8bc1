"""The MindCluster ClusterD public-fault codes of the per-chip NPU problems: 9 digits each, registered by the
operator in ClusterD's publicCustomization.json (docs/kubernetes.md lists them and how ClusterD grades each).
The agent's `kubernetes.mindcluster.public_fault.codes` defaults to this table; a per-chip reason not listed takes
its `default_code`."""

from __future__ import annotations

DEFAULT_PUBLIC_FAULT_CODES = {
    "NpuHeldOutOfBand": "160010001",
    "NpuSharedByPods": "160010002",
    "NpuHbmLeaked": "160010003",
    "NpuHbmLow": "160010004",
    "NpuHealthWarning": "160010005",
    "NpuHealthAlarm": "160010006",
    "NpuHealthCritical": "160010007",
    "NpuMissing": "160010008",
    "PcieFatalErrors": "160010009",
    "PcieNonFatalErrors": "160010010",
    "PcieCorrectableBurst": "160010011",
    "PcieLinkDegraded": "160010012",
    # The chip's RoCE port (npu.roce): HCCL over it hangs until its timeout.
    "NpuLinkDown": "160010013",
    "NpuLinkFlapping": "160010014",
    "NpuNetUnhealthy": "160010015",
    "NpuOpticalAbsent": "160010016",
    "NpuOpticalSignalLost": "160010017",
    "NpuOpticalPower": "160010018",
    "NpuOpticalHot": "160010019",
    "NpuAddressMissing": "160010020",
    "NpuAddressMismatch": "160010021",
    # Huawei's own grading (npu.grade) and HBM ECC (npu.ecc).
    "NpuFaultSeparate": "160010022",
    "NpuFaultReset": "160010023",
    "NpuEccDoubleBit": "160010024",
    "NpuEccPendingPages": "160010025",
}
