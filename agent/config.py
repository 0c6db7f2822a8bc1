"""Configuration: one YAML document, every key defaulted, validated strictly.

The key names of DESIGN.md are a contract (operators and tests write them). The config path of a
check's settings follows the check's name: `host.memory.*` for host.memory, `storage.space` for
storage.space, `npu.*` for the npu.* checks.

Each probe family owns its section model below; add keys freely, rename none.
"""

from __future__ import annotations

import ipaddress
import os
import re
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
    # HBM in use with no process on the chip above this many MiB → NpuHbmLeaked. An idle chip already
    # shows firmware-reserved memory in use: 910B ~3.4 GiB, A3 ~3 GiB, 950 ~4.4 GiB (npu-smi fixtures).
    hbm_leak_min_mib: float = Field(8192, ge=0)
    # Device nodes (globs under host.dev) whose holders npu.holders reports; matched by device number.
    holder_devices: list[str] = ["davinci[0-9]*", "davinci_manager", "devmm_svm", "hisi_hdc"]
    holder_scan_timeout_seconds: PositiveSeconds = 5.0
    # Holders never reported (fnmatch on the process name): the driver's own host daemons, npu-smi itself.
    holder_ignore_commands: list[str] = ["npu-smi", "dmp_daemon", "slogd", "sklogd", "log-daemon", "hccn_tool"]


class PcieConfig(Section):
    # PCI vendor ids whose functions (and the ports above them) are checked; 0x19e5 is Huawei (Ascend).
    vendors: list[str] = ["0x19e5"]
    # Only these device ids of those vendors (e.g. ["0xd802"]); empty: every non-bridge function.
    device_ids: list[str] = []
    # New correctable errors per minute (over at least a minute) above this → PcieCorrectableBurst.
    correctable_burst_per_minute: float = Field(10, ge=0)
    # A new AER error keeps its fail/warn this long after the counter last rose.
    hold_seconds: PositiveSeconds = 3600.0
    # Also check the port above each function (AER may count errors at the link partner only).
    upstream_ports: bool = True
    # A link trained below its speed is PcieLinkDegraded too; turn off where idle power saving lowers speed.
    link_speed_check: bool = True

    @field_validator("vendors", "device_ids", mode="before")
    @classmethod
    def _hex_ids(cls, values: Any) -> Any:
        if not isinstance(values, list):
            return values
        out = []
        for value in values:
            # YAML reads an unquoted 0x19e5 as the integer 6629.
            try:
                number = value if isinstance(value, int) else int(str(value), 16)
            except ValueError:
                number = -1
            if isinstance(value, bool) or not 0 <= number <= 0xFFFF:
                raise ValueError(f"{value!r} is not a 16-bit hex PCI id like 0x19e5")
            out.append(f"0x{number:04x}")
        return out


class GpuConfig(Section):
    # GPUs expected on this node; None: one per /dev/nvidiaN node.
    expected_gpus: int | None = Field(None, ge=0)
    # Free framebuffer below this many MiB → GpuMemoryLow; 0 disables.
    min_free_mib: float = Field(0, ge=0)
    # Framebuffer in use with no process on the GPU above this many MiB → GpuMemoryLeaked.
    memory_leak_min_mib: float = Field(1024, ge=0)
    # Path of libnvidia-ml.so.1 to load; empty: the dynamic loader's search path.
    nvml_library: str = ""
    # argv prefix of the fallback used when NVML cannot be loaded; e.g. [nsenter, -t, 1, -m, --, nvidia-smi].
    smi_command: list[str] = ["nvidia-smi"]
    smi_timeout_seconds: PositiveSeconds = 8.0
    # Lifetime (aggregate) uncorrectable ECC errors: 1..this → warn, above → fail. Volatile ones always fail.
    ecc_aggregate_uncorrectable_max: int = Field(4, ge=0)
    # Status of a pending page retirement / row remap (takes effect at the next GPU reset).
    retirement_pending_status: Literal["warn", "fail"] = "fail"
    # SW thermal slowdown: warn by default (the driver lowering clocks near its target temperature).
    sw_thermal_status: Literal["ok", "warn", "fail"] = "warn"
    holder_devices: list[str] = ["nvidia[0-9]*"]
    # Commands (fnmatch on the executable's base name) allowed to hold GPUs outside a pod.
    allowed_holders: list[str] = [
        "nvidia-persistenced",
        "nv-hostengine",
        "nvidia-smi",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
        "nv-fabricmanager",
        "dcgm-exporter",
    ]


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
    # One write (N bytes + fsync + close) may take a while on a busy NFS server.
    write_timeout_seconds: PositiveSeconds = 10.0
    space: list[SpaceSpec] = [SpaceSpec(path="/")]
    space_timeout_seconds: PositiveSeconds = 5.0
    lock_globs: list[str] = [
        "/root/.cache/torch_extensions/*/*/lock",
        "/root/.cache/huggingface/hub/.locks/*/*.lock",
        "/root/.cache/modelscope/hub/.lock/*",
    ]
    stale_lock_age_seconds: PositiveSeconds = 1800.0
    remove_stale_locks: bool = False
    # File names (fnmatch) of existence-style locks (torch FileBaton: the file's existence is the lock).
    # Other lock files are flock-style unless they hold a SoftFileLock record ("<pid>\n<hostname>").
    baton_lock_names: list[str] = ["lock"]
    # While stale locks exist: py-spy up to this many sleeping Python processes to find those waiting on
    # them (ProcessWaitingOnFileBaton); 0 turns it off. py-spy pauses each process for a moment.
    lock_waiter_max_processes: int = Field(8, ge=0)
    py_spy_command: list[str] = ["py-spy"]
    # Filesystem types (fnmatch) where a lock holder may sit on another node: stale locks only warn there.
    shared_fstypes: list[str] = [
        "nfs*",
        "lustre",
        "fuse",
        "fuse.*",
        "cifs",
        "smb*",
        "ceph",
        "glusterfs",
        "gpfs",
        "beegfs",
        "afs",
        "9p",
        "virtiofs",
        "ocfs2",
        "gfs2",
        "wekafs",
    ]
    locks_timeout_seconds: PositiveSeconds = 5.0
    model_caches: list[ModelCacheSpec] = []
    model_cache_timeout_seconds: PositiveSeconds = 10.0

    @model_validator(mode="after")
    def _unique_subjects(self) -> StorageConfig:
        for key, paths in (
            ("mounts", [m.path for m in self.mounts]),
            ("write_probes", [w.path for w in self.write_probes]),
        ):
            seen: set[str] = set()
            for path in paths:
                normal = os.path.normpath(path)
                if normal in seen:
                    raise ValueError(f"{key}: path {path} is listed twice")
                seen.add(normal)
        for glob_pattern in self.lock_globs:
            if not glob_pattern.startswith("/"):
                raise ValueError(f"lock_globs: {glob_pattern!r} must be an absolute path")
        return self


# --- network / time --------------------------------------------------------------------------------


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """ "host", "host:port", "[v6]:port" or a bare IPv6 address → (host, port); ValueError when malformed."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: expected [address]:port")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a bare name, IPv4 or IPv6 address
        host, port_text = text, ""
    if not host:
        raise ValueError(f"{text!r}: empty host")
    if port_text == "":
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be 1-65535")
    return host, int(port_text)


class DnsConfig(Section):
    names: list[str] = []
    nameservers: list[str] = []  # "ip" or "ip:port"; empty: the host's resolv.conf
    timeout_seconds: PositiveSeconds = 2.0  # per try, per nameserver
    lifetime_seconds: PositiveSeconds = 4.0  # per name, all tries (bounded by the probe's deadline)
    slow_seconds: PositiveSeconds = 0.5
    # Resolved only when the agent runs in a pod (KUBERNETES_SERVICE_HOST set), with the pod's own
    # /etc/resolv.conf (dnsPolicy ClusterFirstWithHostNet) unless `nameservers` is set.
    cluster_names: list[str] = ["kubernetes.default.svc.cluster.local"]

    @field_validator("nameservers")
    @classmethod
    def _ip_and_port(cls, value: list[str]) -> list[str]:
        for entry in value:
            host, _ = split_host_port(entry, 53)
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"{entry!r}: a nameserver must be an IP address, optionally with :port") from None
        return value


class EgressTarget(Section):
    name: str = ""  # empty: the subject is host:port
    host: str
    port: int = Field(443, ge=1, le=65535)
    tls: bool = True
    http_path: str | None = None
    expect_status: list[int] = [200]
    proxy: str | None = None  # http://host:port (HTTP CONNECT)
    timeout_seconds: PositiveSeconds = 5.0
    # Extra CA bundle (a host path, e.g. a corporate CA) trusted besides the agent's default CAs.
    ca_file: str | None = None

    @field_validator("proxy")
    @classmethod
    def _http_proxy(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith("http://"):
            raise ValueError("proxy must be http://host:port (HTTP CONNECT)")
        split_host_port(value[len("http://") :].rstrip("/"), 3128)
        return value

    @field_validator("http_path")
    @classmethod
    def _absolute_path(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("http_path must start with /")
        return value

    @property
    def subject(self) -> str:
        return self.name or f"{self.host}:{self.port}"


class LinksConfig(Section):
    interfaces: list[str] = []  # empty: every physical NIC
    max_carrier_changes_per_hour: float = Field(6, ge=0)
    # Network namespace to inspect (a path such as /run/netns/x); empty: the host's, <proc>/1/ns/net.
    netns: str = ""


class PortsConfig(Section):
    base: int = Field(60000, ge=1, le=65535)
    count: int = Field(16, ge=1, le=65535)
    # Warn (PortsNotReserved) when net.ipv4.ip_local_reserved_ports does not cover the range.
    check_reserved: bool = True

    @model_validator(mode="after")
    def _fits(self) -> PortsConfig:
        if self.base + self.count - 1 > 65535:
            raise ValueError("base + count - 1 must not exceed 65535")
        return self


class NetworkConfig(Section):
    dns: DnsConfig = DnsConfig()
    egress: list[EgressTarget] = []
    links: LinksConfig = LinksConfig()
    ports: PortsConfig = PortsConfig()


class TimeConfig(Section):
    ntp_servers: list[str] = []  # "host" or "host:port"
    warn_offset_seconds: PositiveSeconds = 0.1
    fail_offset_seconds: PositiveSeconds = 1.0
    ntp_timeout_seconds: PositiveSeconds = 2.0
    # argv prefix for chronyc; `-n tracking` is appended. e.g. [nsenter, -t, 1, -m, -n, --, chronyc]
    chronyc_command: list[str] = ["chronyc"]
    chronyc_timeout_seconds: PositiveSeconds = 2.0
    # An unsynchronised kernel clock that no NTP server could be asked about: warn (default) or fail.
    unsynced_status: Literal["warn", "fail"] = "warn"

    @field_validator("ntp_servers")
    @classmethod
    def _host_and_port(cls, value: list[str]) -> list[str]:
        for entry in value:
            split_host_port(entry, 123)
        return value

    @model_validator(mode="after")
    def _ordered(self) -> TimeConfig:
        if self.warn_offset_seconds > self.fail_offset_seconds:
            raise ValueError("warn_offset_seconds must not exceed fail_offset_seconds")
        return self


# --- kernel log ------------------------------------------------------------------------------------


class KernelLogRule(Section):
    """One node-problem-detector style rule: a regex over kernel-facility /dev/kmsg messages → a reason."""

    reason: str = Field(pattern=r"^[A-Z][A-Za-z0-9]*$")
    pattern: str
    # temporary: reported with `status`; permanent: reported as fail. Both clear after the quiet period.
    type: Literal["temporary", "permanent"] = "temporary"
    count: int = Field(1, ge=1)  # matches needed within window_seconds to raise the problem
    window_seconds: PositiveSeconds = 60.0
    status: Literal["warn", "fail"] = "warn"
    category: Literal["host", "npu", "gpu", "storage", "network"] = "host"
    # Named group → values that make a match fail (e.g. {xid: ["79"]}) whatever `status` says.
    fail_on: dict[str, list[str]] = {}
    # A line matching this clears the problem at once (e.g. "nfs: server X OK").
    recover_pattern: str | None = None
    quiet_period_seconds: PositiveSeconds | None = None  # None: kernel_log.quiet_period_seconds
    hint: str = ""

    @field_validator("pattern", "recover_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


def _default_kernel_log_rules() -> list[KernelLogRule]:
    from probes.kernel_log import DEFAULT_RULES  # the defaults live beside the probe, with their sources

    return [KernelLogRule.model_validate(rule) for rule in DEFAULT_RULES]


class KernelLogConfig(Section):
    # None: <host.dev>/kmsg.
    path: str | None = None
    quiet_period_seconds: PositiveSeconds = 3600.0
    # Replaces the default rules when set; extra_rules are added to whichever set is in force.
    rules: list[KernelLogRule] = Field(default_factory=_default_kernel_log_rules)
    extra_rules: list[KernelLogRule] = []
    # Bounds one run's work when the kernel floods the log.
    max_records_per_run: int = Field(20000, ge=1)
    max_line_chars: int = Field(240, ge=40)


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
    # Effect of warn findings: warn does not block readiness, so by default it only shows in the condition.
    warn_effect: Literal["PreferNoSchedule", "None"] = "None"
    disabled_reasons: list[str] = []
    # Checks (or prefixes: "network", "storage.locks") reported over HTTP and metrics only, never on the Node.
    disabled_checks: list[str] = []
    # Conditions are rewritten (lastHeartbeatTime) at most this often when nothing changes: 6 writes/hour.
    heartbeat_seconds: float = Field(600.0, ge=600)
    events_namespace: str = "default"
    # Cluster taint budget: a ConfigMap of slots, one per node holding a NoSchedule/NoExecute taint.
    budget_configmap: str = "node-health-budget"
    budget_namespace: str = ""  # empty: $POD_NAMESPACE, else the ServiceAccount's namespace, else node-health
    budget_node_selector: str = ""  # label selector of the nodes a percentage counts; empty: every node
    budget_retry_seconds: PositiveSeconds = 60.0  # a suppressed node asks for a slot again this often
    budget_grace_seconds: PositiveSeconds = 120.0  # a slot whose node is not tainted yet survives pruning
    # API errors (unreachable, 429, 5xx, 403) back off exponentially with jitter between these bounds.
    backoff_initial_seconds: PositiveSeconds = 1.0
    backoff_max_seconds: PositiveSeconds = 300.0
    request_timeout_seconds: PositiveSeconds = 10.0
    conflict_retries: int = Field(5, ge=0, le=50)
    poll_seconds: PositiveSeconds = 1.0

    @field_validator("key_prefix")
    @classmethod
    def _dns_prefix(cls, value: str) -> str:
        import re

        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
            raise ValueError("must be a DNS subdomain (lowercase letters, digits, '-', '.'), e.g. node-health")
        return value

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
