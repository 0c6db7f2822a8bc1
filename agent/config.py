"""Configuration: one YAML document, every key defaulted, validated strictly.

The key names of DESIGN.md are a contract (operators and tests write them). The config path of a
check's settings follows the check's name: `host.memory.*` for host.memory, `storage.space` for
storage.space, `npu.*` for the npu.* checks.

Each probe family owns its section model below; add keys freely, rename none.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(Exception):
    """An invalid config. The message names the key and the allowed values."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


PositiveSeconds = Annotated[float, Field(gt=0)]
Percent = Annotated[float, Field(ge=0, le=100)]


# --- machinery -------------------------------------------------------------------------------------


class HttpConfig(Section):
    address: str = "0.0.0.0"
    port: int = Field(9100, ge=0, le=65535)
    max_wait_seconds: PositiveSeconds = 300.0


class LoggingConfig(Section):
    format: Literal["text", "json"] = "text"
    level: Literal["debug", "info", "warning", "error"] = "info"


class HealthConfig(Section):
    # Consecutive failing results before an established check enters fail, and passing ones to leave it.
    fail_threshold: int = Field(2, ge=1)
    recovery_threshold: int = Field(2, ge=1)
    # A result older than this many probe intervals (plus the probe timeout) is stale: unknown, not ready.
    stale_after_intervals: float = Field(3.0, ge=1)
    # Checks (or prefixes: "npu", "storage.mounts") whose unknown result blocks readiness.
    required_checks: list[str] = []
    # /healthz fails when a probe run has been stuck this long (its thread cannot be cancelled).
    wedged_after_seconds: PositiveSeconds = 600.0


class ProbeSchedule(Section):
    enabled: bool = True
    interval_seconds: PositiveSeconds | None = None  # None: the probe's default
    timeout_seconds: PositiveSeconds | None = None
    # Random delay added to each interval, as a fraction of it, so 1,000 nodes do not probe in lockstep.
    jitter_fraction: float = Field(0.1, ge=0, le=1)


class HostMemoryConfig(Section):
    min_available_mib: float = Field(2048, ge=0)
    min_available_percent: Percent = 5.0
    # Free hugepages (of the default size) below this → HostMemoryLow; 0 disables the hugepage check.
    min_free_hugepages: int = Field(0, ge=0)


class HostShmConfig(Section):
    path: str = "/dev/shm"
    min_size_mib: float = Field(1024, ge=0)
    min_free_mib: float = Field(512, ge=0)


class HostConfig(Section):
    proc: str = "/proc"
    sys: str = "/sys"
    dev: str = "/dev"
    root: str = "/"
    memory: HostMemoryConfig = HostMemoryConfig()
    shm: HostShmConfig = HostShmConfig()


# --- npu / pcie / gpu ------------------------------------------------------------------------------


class NpuConfig(Section):
    smi_command: list[str] = ["npu-smi"]
    smi_timeout_seconds: PositiveSeconds = 8.0
    min_hbm_free_mib: float = Field(0, ge=0)
    # Chips expected on this node; None: one per /dev/davinciN node.
    expected_chips: int | None = Field(None, ge=0)
    # npu-smi health word → status.
    health_status: dict[str, Literal["ok", "warn", "fail"]] = {
        "OK": "ok",
        "Warning": "warn",
        "Alarm": "fail",
        "Critical": "fail",
    }
    # HBM in use with no process on the chip above this many MiB → NpuHbmLeaked.
    hbm_leak_min_mib: float = Field(1024, ge=0)
    holder_devices: list[str] = ["davinci[0-9]*", "davinci_manager", "devmm_svm", "hisi_hdc"]


class PcieConfig(Section):
    vendors: list[str] = ["0x19e5"]
    correctable_burst_per_minute: float = Field(10, ge=0)


class GpuConfig(Section):
    expected_gpus: int | None = Field(None, ge=0)
    min_free_mib: float = Field(0, ge=0)
    memory_leak_min_mib: float = Field(1024, ge=0)
    smi_command: list[str] = ["nvidia-smi"]
    holder_devices: list[str] = ["nvidia[0-9]*"]


# --- storage ---------------------------------------------------------------------------------------


class MountSpec(Section):
    path: str
    fstype: str = "*"  # fnmatch pattern: nfs4, nfs*, fuse.*, lustre
    source: str | None = None


class WriteProbeSpec(Section):
    path: str
    uid: int = Field(0, ge=0)
    gid: int = Field(0, ge=0)
    bytes: int = Field(65536, ge=1)


class SpaceSpec(Section):
    path: str
    warn_percent: Percent = 85.0
    fail_percent: Percent = 95.0
    warn_inodes_percent: Percent = 85.0
    fail_inodes_percent: Percent = 95.0

    @model_validator(mode="after")
    def _ordered(self) -> SpaceSpec:
        if self.warn_percent > self.fail_percent:
            raise ValueError("warn_percent must not exceed fail_percent")
        if self.warn_inodes_percent > self.fail_inodes_percent:
            raise ValueError("warn_inodes_percent must not exceed fail_inodes_percent")
        return self


class ModelCacheSpec(Section):
    cache_dir: str
    repo_id: str
    revision: str = "main"


class StorageConfig(Section):
    mounts: list[MountSpec] = []
    mount_timeout_seconds: PositiveSeconds = 5.0
    write_probes: list[WriteProbeSpec] = []
    space: list[SpaceSpec] = [SpaceSpec(path="/")]
    space_timeout_seconds: PositiveSeconds = 5.0
    lock_globs: list[str] = [
        "/root/.cache/torch_extensions/*/*/lock",
        "/root/.cache/huggingface/hub/.locks/*/*.lock",
        "/root/.cache/modelscope/hub/.lock/*",
    ]
    stale_lock_age_seconds: PositiveSeconds = 1800.0
    remove_stale_locks: bool = False
    model_caches: list[ModelCacheSpec] = []


# --- network / time --------------------------------------------------------------------------------


class DnsConfig(Section):
    names: list[str] = []
    nameservers: list[str] = []  # empty: the host's resolv.conf
    timeout_seconds: PositiveSeconds = 2.0
    slow_seconds: PositiveSeconds = 0.5


class EgressTarget(Section):
    name: str
    host: str
    port: int = Field(443, ge=1, le=65535)
    tls: bool = True
    http_path: str | None = None
    expect_status: list[int] = [200]
    proxy: str | None = None
    timeout_seconds: PositiveSeconds = 5.0


class LinksConfig(Section):
    interfaces: list[str] = []  # empty: every physical NIC
    max_carrier_changes_per_hour: float = Field(6, ge=0)


class PortsConfig(Section):
    base: int = Field(60000, ge=1, le=65535)
    count: int = Field(16, ge=1, le=65535)


class NetworkConfig(Section):
    dns: DnsConfig = DnsConfig()
    egress: list[EgressTarget] = []
    links: LinksConfig = LinksConfig()
    ports: PortsConfig = PortsConfig()


class TimeConfig(Section):
    ntp_servers: list[str] = []
    warn_offset_seconds: PositiveSeconds = 0.1
    fail_offset_seconds: PositiveSeconds = 1.0
    ntp_timeout_seconds: PositiveSeconds = 2.0

    @model_validator(mode="after")
    def _ordered(self) -> TimeConfig:
        if self.warn_offset_seconds > self.fail_offset_seconds:
            raise ValueError("warn_offset_seconds must not exceed fail_offset_seconds")
        return self


# --- kernel log ------------------------------------------------------------------------------------


class KernelLogConfig(Section):
    path: str = "/dev/kmsg"
    quiet_period_seconds: PositiveSeconds = 3600.0


# --- kubernetes ------------------------------------------------------------------------------------


class KubernetesConfig(Section):
    enabled: bool = True
    key_prefix: str = "node-health"
    dry_run: bool = False
    max_unhealthy: str = "10%"
    kubeconfig: str | None = None
    # Reason → taint effect; reasons not listed take default_effect. "None" reports without tainting.
    default_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", "None"] = "NoSchedule"
    effects: dict[str, Literal["NoSchedule", "PreferNoSchedule", "NoExecute", "None"]] = {}
    disabled_reasons: list[str] = []

    @field_validator("max_unhealthy", mode="before")
    @classmethod
    def _count_or_percent(cls, value: Any) -> str:
        text = str(value).strip()
        number = text[:-1] if text.endswith("%") else text
        try:
            ok = float(number) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("must be a count (e.g. 5) or a percentage of nodes (e.g. '10%')")
        return text


class Config(Section):
    node_name: str = ""  # empty: $NODE_NAME, else the hostname
    http: HttpConfig = HttpConfig()
    logging: LoggingConfig = LoggingConfig()
    health: HealthConfig = HealthConfig()
    probes: dict[str, ProbeSchedule] = {}
    host: HostConfig = HostConfig()
    npu: NpuConfig = NpuConfig()
    pcie: PcieConfig = PcieConfig()
    gpu: GpuConfig = GpuConfig()
    storage: StorageConfig = StorageConfig()
    network: NetworkConfig = NetworkConfig()
    time: TimeConfig = TimeConfig()
    kernel_log: KernelLogConfig = KernelLogConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()

    @property
    def resolved_node_name(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()

    def schedule(self, probe_name: str) -> ProbeSchedule:
        return self.probes.get(probe_name) or ProbeSchedule()


def _format_location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(("function-", "literal[")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _describe_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = _format_location(tuple(error["loc"]))
        if error["type"] == "extra_forbidden":
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            lines.append(f"config key {key}: unknown key" + (f" under {parent}" if parent else ""))
        else:
            lines.append(f"config key {key}: {error['msg']} (got {error.get('input')!r})")
    return "; ".join(lines)


def parse_config(data: Any, known_probes: dict[str, Any] | None = None) -> Config:
    """Validate a loaded YAML document. `known_probes` (name → probe class) checks `probes:` keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: the document must be a mapping, got {type(data).__name__}")
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe_errors(exc)) from None
    if known_probes is not None:
        unknown = sorted(set(config.probes) - set(known_probes))
        if unknown:
            raise ConfigError(
                f"config key probes.{unknown[0]}: unknown probe (allowed: {', '.join(sorted(known_probes))})"
            )
    return config


def load_config(path: str | Path | None, known_probes: dict[str, Any] | None = None) -> Config:
    if path is None:
        return parse_config({}, known_probes)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    return parse_config(data, known_probes)


def default_config_yaml(known_probes: dict[str, Any]) -> str:
    """The full default config, every key spelled out, as valid YAML."""
    config = Config()
    data = config.model_dump(mode="json")
    data["probes"] = {
        name: ProbeSchedule(interval_seconds=cls.default_interval, timeout_seconds=cls.default_timeout).model_dump(
            mode="json"
        )
        for name, cls in sorted(known_probes.items())
    }
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
