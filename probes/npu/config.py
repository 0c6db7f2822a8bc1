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

    # --- the parameter plane (npu.roce: hccn_tool per chip) ---
    # hccn_tool as the host runs it; searched like npu-smi (PATH, the host's bin dirs, the driver's tools dir).
    hccn_command: list[str] = ["hccn_tool"]
    hccn_timeout_seconds: PositiveSeconds = 5.0
    # hccn_tool children running at once (the chips are read in parallel, never more than this many).
    hccn_parallel: int = Field(4, ge=1, le=32)
    # The host's HCCN address file (under host.root); absent: addresses are only checked to be present.
    hccn_conf: str = "/etc/hccn.conf"
    # A link flaps when its link-up count rises by more than link_flap_max within link_flap_window_seconds.
    link_flap_window_seconds: PositiveSeconds = 600.0
    link_flap_max: int = Field(1, ge=0)
    # Where the link-up baselines survive an agent restart: a writable directory of the agent's (the DaemonSet
    # mounts the host's /var/lib/node-health there); "" or unwritable: kept in memory, noted on npu.roce.flaps.
    state_dir: str = "/var/lib/node-health"
    # Each verb is re-read when its last read is older than its interval (`link` every run); the last answer
    # stands in between. Optical modules (an I2C transaction per chip) are the slowest read.
    link_stat_interval_seconds: float = Field(240.0, ge=0)
    net_health_interval_seconds: float = Field(240.0, ge=0)
    address_interval_seconds: float = Field(600.0, ge=0)
    optical_interval_seconds: float = Field(300.0, ge=0)
    # hccn_tool calls per run at most, once every verb has been read (the first run reads them all): `link` of
    # every chip first, then the most overdue reads; the rest waits for the next run (DESIGN: <= 32 per interval).
    hccn_max_calls_per_run: int = Field(32, ge=1)
    # Optics thresholds; None: the module's own (its RxPower/TxPower Low/High Thres, Temp High Thres lines).
    optical_rx_power_min_mw: float | None = Field(None, ge=0)
    optical_tx_power_min_mw: float | None = Field(None, ge=0)
    optical_tx_power_max_mw: float | None = Field(None, ge=0)
    optical_temperature_max_celsius: float | None = None
    # Within this margin (a fraction of the threshold) of a power threshold → warn.
    optical_power_margin: float = Field(0.1, ge=0, le=1)

    # --- fault grading (npu.grade) ---
    # MindCluster's faultCode.json (the device plugin's ConfigMap mindx-dl-fault-config, mounted into the agent);
    # the first that exists is used, else the built-in table (probes/npu/fault_codes.py).
    fault_code_files: list[str] = ["/etc/node-health/mindx-dl-fault-config/faultCode.json", "/usr/local/faultCode.json"]

    # --- HBM ECC (npu.ecc) ---
    # Single-bit errors per hour above this → warn (the count's increase between runs, scaled to an hour).
    ecc_single_bit_per_hour_max: float = Field(100.0, ge=0)
    # Isolated HBM pages at or above this → warn (the driver isolates at most a few dozen pages per chip).
    ecc_isolated_pages_warn: int = Field(32, ge=0)
