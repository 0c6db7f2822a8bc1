"""Config of the npu family (`npu:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from probes.family import PositiveSeconds, Section


class NpuConfig(Section):
    smi_command: list[str] = ["npu-smi"]
    smi_timeout_seconds: PositiveSeconds = 8.0
    min_hbm_free_mib: float = Field(0, ge=0)
    # Chips expected on this node; None: one per /dev/davinciN node.
    expected_chips: int | None = Field(None, ge=0)
    # On a node with /dev/davinciN nodes, chips whose health cannot be read (NpuToolMissing, a table not understood
    # or cut short) block readiness (the findings say `required`); false: such a node may be ready meanwhile.
    unreadable_blocks_ready: bool = True
    # npu-smi health word → status.
    health_status: dict[str, Literal["ok", "warn", "fail"]] = {
        "OK": "ok",
        "Warning": "warn",
        "Alarm": "fail",
        "Critical": "fail",
    }
    # HBM in use with no process on the chip above this many MiB → NpuHbmLeaked. An idle chip already
    # shows firmware-reserved memory in use: 910B ~3.4 GiB, A3 ~3 GiB, 950 ~4.4 GiB (npu-smi fixtures).
    hbm_leak_min_mib: float = Field(8192, ge=0)
    # Device nodes (globs under host.dev) whose holders npu.holders reports; matched by device number.
    holder_devices: list[str] = ["davinci[0-9]*", "davinci_manager", "devmm_svm", "hisi_hdc"]
    # Deadline of the /proc/*/fd scan: this, plus holder_scan_seconds_per_1000_fds for every 1,000 fds open on
    # the host at the last scan; at most 40% of the probe's timeout.
    holder_scan_timeout_seconds: PositiveSeconds = 5.0
    # 4-5 ms of CPU per 1,000 fds (benchmarks/scan_quota.py): ~10 ms at the DaemonSet's 500m limit, and the scan
    # may wait behind up to three others (gpu, network.ports, storage.locks) on the same lock.
    holder_scan_seconds_per_1000_fds: float = Field(0.04, ge=0)
    # Holders never reported (fnmatch on the process name): the driver's own host daemons, npu-smi itself.
    holder_ignore_commands: list[str] = ["npu-smi", "dmp_daemon", "slogd", "sklogd", "log-daemon", "hccn_tool"]
    # Status of a chip the device plugin no longer offers (DevicePluginUnhealthy): the plugin keeps jobs off it.
    device_plugin_unhealthy_status: Literal["warn", "fail"] = "warn"
