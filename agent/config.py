"""Configuration: one YAML document, every key defaulted, validated strictly.

The config keys are a contract (operators and tests write them); add keys freely, rename none.
The agent owns the sections of its machinery (http, logging, health, probes, kubernetes) below; every other
section belongs to a probe family, which declares its model beside its probes (`probes/<family>/config.py`).
`config_model()` assembles the families it discovers into one model.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, create_model, field_validator, model_validator

from agent.configcompat import ConfigNotes, newer_release_note, take_config_version, without_keys
from agent.configfile import ERROR_MESSAGE_CHARS, ConfigFileError, excerpt, parse_yaml, read_bounded
from agent.labelselector import label_selector_problem
from probes import all_families
from probes.base import CATEGORIES, COMMON_REASONS
from probes.family import PositiveSeconds, Section, family_settings
from probes.npu.public_faults import DEFAULT_PUBLIC_FAULT_CODES
from probes.text import clip

SectionT = TypeVar("SectionT", bound=Section)


class ConfigError(Exception):
    """An invalid config. The message names the key and the allowed values."""


# --- machinery -------------------------------------------------------------------------------------


class HttpConfig(Section):
    address: str = "0.0.0.0"
    port: int = Field(9100, ge=0, le=65535)
    # /metrics and /status (and /healthz, /started) on a port of their own, which a NetworkPolicy can open to the
    # monitoring namespace only (deploy/components/network-policy); 0: no second port.
    metrics_port: int = Field(9101, ge=0, le=65535)
    # /metrics and /status on `port` too, as before 0.3 (scrape configs and dashboards that name 9100). The
    # network-policy component turns it off (env NODE_HEALTH_HTTP_STATUS_ON_MAIN_PORT, docs/http.md).
    status_on_main_port: bool = True
    # /healthz and /started alone, for the kubelet's probes (the DaemonSet's port `health`), on a connection pool of
    # their own with slots kept for the node's own addresses, so the probes get in whatever pods hold on the other
    # ports (docs/http.md, The kubelet's probes); 0: no health port.
    health_port: int = Field(9102, ge=0, le=65535)
    max_wait_seconds: PositiveSeconds = 300.0

    @model_validator(mode="after")
    def _ports(self) -> HttpConfig:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"http.metrics_port: {self.metrics_port} is http.port too; give it a port of its own")
        if self.health_port and self.health_port in (self.port, self.metrics_port):
            raise ValueError(
                f"http.health_port: {self.health_port} is http.port or http.metrics_port too; give it a port of its own"
            )
        if not self.status_on_main_port and not self.metrics_port:
            raise ValueError(
                "http.status_on_main_port: false needs http.metrics_port (not 0), else no port serves /metrics and "
                "/status"
            )
        return self


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


# Set by deploy/components/network-policy on the agent's container: whether /metrics and /status stay on http.port,
# overriding http.status_on_main_port (a component cannot edit a key inside the shipped ConfigMap's file).
STATUS_ON_MAIN_PORT_ENV = "NODE_HEALTH_HTTP_STATUS_ON_MAIN_PORT"


def status_on_main_port(http: HttpConfig, environ: dict[str, str] | None = None) -> bool:
    """http.status_on_main_port, or $NODE_HEALTH_HTTP_STATUS_ON_MAIN_PORT (true/false) when set; ConfigError for
    any other value of it, or for false without a metrics port."""
    value = (os.environ if environ is None else environ).get(STATUS_ON_MAIN_PORT_ENV)
    if value is None:
        return http.status_on_main_port
    if value.strip().lower() not in ("true", "false"):
        raise ConfigError(f"${STATUS_ON_MAIN_PORT_ENV}: true or false, got {clip(value, 40)!r}")
    on = value.strip().lower() == "true"
    if not on and not http.metrics_port:
        raise ConfigError(
            f"${STATUS_ON_MAIN_PORT_ENV}=false needs http.metrics_port (not 0), else no port serves /metrics and "
            "/status"
        )
    return on


# --- kubernetes ------------------------------------------------------------------------------------

# Label and taint prefixes Kubernetes reserves for its own components (node.kubernetes.io/not-ready, ...).
RESERVED_KEY_PREFIXES = ("kubernetes.io", "k8s.io")


FaultCode = Annotated[str, Field(pattern=r"^[0-9]{9}$")]


class PublicFaultConfig(Section):
    """MindCluster ClusterD public faults: per-chip NPU problems written to a ConfigMap ClusterD reads."""

    enabled: bool = False
    # The fault sender (`resource`), registered in publicFaultResource of ClusterD's publicCustomization.json.
    sender: str = Field("node-health", pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")
    namespace: str = Field("mindx-dl", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    # Reason → faultCode; a per-chip NPU reason not listed takes default_code.
    codes: dict[str, FaultCode] = DEFAULT_PUBLIC_FAULT_CODES
    default_code: FaultCode = "160010000"


class MindClusterConfig(Section):
    public_fault: PublicFaultConfig = PublicFaultConfig()


class KubernetesConfig(Section):
    enabled: bool = True
    key_prefix: str = "node-health"
    dry_run: bool = False
    max_unhealthy: str = "10%"
    kubeconfig: str | None = None
    # NoExecute evicts every pod on the node that does not tolerate the taint: refused unless this is true.
    allow_noexecute: bool = False
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
    budget_retry_seconds: PositiveSeconds = 60.0  # a suppressed node asks for a slot again after this...
    budget_retry_max_seconds: PositiveSeconds = 300.0  # ...doubling (jittered) up to this
    budget_grace_seconds: PositiveSeconds = 120.0  # a slot whose node is not tainted yet survives pruning
    # The eligible nodes a percentage counts are listed (from the API server's cache) by one agent this often.
    budget_recount_seconds: PositiveSeconds = 900.0
    # API errors (unreachable, 429, 5xx, 403) back off exponentially with jitter between these bounds.
    backoff_initial_seconds: PositiveSeconds = 1.0
    backoff_max_seconds: PositiveSeconds = 300.0
    request_timeout_seconds: PositiveSeconds = 10.0
    # The kubelet's PodResources API (the device plugins' ledger), read by npu and gpu; empty: not read.
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    # Deadline of one ledger read (List and GetAllocatableResources on the unix socket).
    pod_resources_timeout_seconds: PositiveSeconds = 1.0
    conflict_retries: int = Field(5, ge=0, le=50)
    poll_seconds: PositiveSeconds = 1.0
    # Device isolation (docs/kubernetes.md, Device isolation): a problem of one NPU or GPU is isolated on that
    # device through the cluster's device APIs, the node taint only where nothing finer applies.
    device_isolation: bool = True  # DRA DeviceTaintRules where the cluster serves them
    # Where neither a DeviceTaintRule nor a public fault applies: node (taint the node, as for any problem),
    # prefer (PreferNoSchedule while fewer than device_fallback_max_fraction of the node's devices are bad,
    # NoSchedule above), none (leave scheduling alone; the job pre-flight /ready?devices= turns jobs away).
    device_fallback: Literal["node", "prefer", "none"] = "node"
    device_fallback_max_fraction: float = Field(0.5, gt=0, le=1)
    # Device budget: at most this many of the fleet's devices isolated at once (count or percentage).
    max_unhealthy_devices: str = "10%"
    device_budget_configmap: str = "node-health-device-budget"
    # DRA drivers whose ResourceSlices name the node's accelerators (matched and counted).
    dra_drivers: list[str] = ["gpu.nvidia.com", "npu.huawei.com", "ascend.project-hami.io"]
    # Extended resources a device-plugin node advertises its accelerators as (fnmatch), for the device count.
    device_resources: list[str] = ["nvidia.com/gpu", "huawei.com/Ascend*", "huawei.com/npu*"]
    # Which resource.k8s.io version serves DeviceTaintRules is asked again, and the node's slices re-read, this
    # often while devices are isolated.
    dra_recheck_seconds: PositiveSeconds = 600.0
    # Schedulers whose huawei.com/AscendReal annotation is trusted for a pod's real chips (spec.schedulerName):
    # a pod's own annotation, from any other scheduler's pod, is ignored (anyone who can create a pod can write it).
    ascend_real_schedulers: list[str] = ["volcano"]
    mindcluster: MindClusterConfig = MindClusterConfig()

    @field_validator("key_prefix")
    @classmethod
    def _dns_prefix(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
            raise ValueError("must be a DNS subdomain (lowercase letters, digits, '-', '.'), e.g. node-health")
        reserved = next((r for r in RESERVED_KEY_PREFIXES if value == r or value.endswith("." + r)), None)
        if reserved is not None:
            # kubelet, the scheduler and the node lifecycle controller own those keys; cleanup removes every
            # key under the prefix, so a reserved one would remove theirs.
            raise ValueError(f"{reserved} and its subdomains are reserved for Kubernetes' own labels and taints")
        return value

    @field_validator("budget_node_selector")
    @classmethod
    def _label_selector(cls, value: str) -> str:
        problem = label_selector_problem(value)
        if problem:
            # Checked here, not by the API server at the first recount (400): a budget that never counts.
            raise ValueError(f"not a label selector the API server accepts: {problem}")
        return value

    @field_validator("events_namespace")
    @classmethod
    def _node_events_namespace(cls, value: str) -> str:
        if value != "default":
            # kube-apiserver refuses an Event for a cluster-scoped object anywhere else (422: involvedObject.namespace
            # does not match event.namespace): every Event would be lost.
            raise ValueError(
                "must be default: the API server accepts Events for a Node (cluster-scoped) only in the namespace "
                "default"
            )
        return value

    @field_validator("default_effect", "effects")
    @classmethod
    def _noexecute_allowed(cls, value: Any, info: ValidationInfo) -> Any:
        effects = value.values() if isinstance(value, dict) else [value]
        if "NoExecute" in effects and not info.data.get("allow_noexecute"):
            raise ValueError(
                "NoExecute evicts the pods running on the node; set kubernetes.allow_noexecute: true to allow it"
            )
        return value

    @field_validator("max_unhealthy", "max_unhealthy_devices", mode="before")
    @classmethod
    def _count_or_percent(cls, value: Any) -> str:
        text = str(value).strip()
        number = text[:-1] if text.endswith("%") else text
        try:
            ok = float(number) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("must be a count (e.g. 5) or a percentage (e.g. '10%')")
        return text


class Config(Section):
    """The agent's own sections; `config_model()` adds one section per probe family (host, npu, storage...)."""

    node_name: str = ""  # empty: $NODE_NAME, else the hostname
    # Findings, /status, events and conditions name a process by PID, executable and pod; its full command
    # line (which may hold another tenant's secrets) only when this is false.
    redact_cmdlines: bool = True
    http: HttpConfig = HttpConfig()
    logging: LoggingConfig = LoggingConfig()
    health: HealthConfig = HealthConfig()
    probes: dict[str, ProbeSchedule] = {}
    kubernetes: KubernetesConfig = KubernetesConfig()

    @field_validator("node_name")
    @classmethod
    def _matches_node_name_env(cls, value: str) -> str:
        env = os.environ.get("NODE_NAME", "")
        if value and env and value != env:
            raise ValueError(
                f"differs from $NODE_NAME ({env!r}): a config shared by every agent would make them all reconcile "
                f"node {value!r}; leave node_name empty where $NODE_NAME is set"
            )
        return value

    @property
    def resolved_node_name(self) -> str:
        return self.node_name or os.environ.get("NODE_NAME") or socket.gethostname()

    def schedule(self, probe_name: str) -> ProbeSchedule:
        return self.probes.get(probe_name) or ProbeSchedule()

    def section(self, model: type[SectionT]) -> SectionT:
        """A probe family's section, typed: `config.section(StorageConfig)`."""
        return family_settings(self, model)


# Sections printed before the families in `config --defaults`; kubernetes comes last.
_LEADING_SECTIONS = ("node_name", "redact_cmdlines", "http", "logging", "health", "probes")


@functools.cache
def config_model() -> type[Config]:
    """The whole config model: the agent's sections plus one per discovered probe family."""
    fields: dict[str, Any] = {}
    for key, family in all_families().items():
        if key in Config.model_fields:
            raise TypeError(f"probe family {family.module} declares section {key!r}, which the agent owns")
        fields[key] = (family.config, Field(default_factory=family.config))
    return create_model("AssembledConfig", __base__=Config, **fields)


def default_config() -> Config:
    return config_model()()


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


def did_you_mean(word: str, candidates: Any) -> str:
    """` (did you mean 'dry_run'?)` for the closest candidate (difflib), "" when none is close."""
    close = difflib.get_close_matches(word, [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model allows where `loc` ends (loc's last part is the unknown key itself)."""
    model: Any = config_model()
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = model.model_fields.get(str(part))
        if field is None:  # a dict's key (probes.<name>): its values' model
            continue
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        model = args[-1] if args else annotation
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _describe_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = _format_location(tuple(error["loc"]))
        if error["type"] == "extra_forbidden":
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            hint = did_you_mean(str(error["loc"][-1]), _keys_at(tuple(error["loc"])))
            lines.append(f"config key {key}: unknown key" + (f" under {parent}" if parent else "") + hint)
        else:
            lines.append(
                f"config key {key}: {clip(str(error['msg']), ERROR_MESSAGE_CHARS)} (got {excerpt(error.get('input'))})"
            )
    more = f"; and {len(lines) - 10} more errors" if len(lines) > 10 else ""
    return "; ".join(lines[:10]) + more


def parse_config(data: Any, known_probes: dict[str, Any] | None = None) -> Config:
    """Validate a loaded YAML document. `known_probes` (name → probe class) checks `probes:` keys. Strict: an
    unknown key is an error (check, config --validate)."""
    return _parse(data, known_probes, tolerant=False)[0]


def parse_config_tolerant(data: Any, known_probes: dict[str, Any] | None = None) -> tuple[Config, ConfigNotes]:
    """As parse_config, but keys (and probes) this release does not know are set aside and returned in the notes
    instead of failing: what the daemon runs with, so a rollback under a newer ConfigMap does not crash-loop."""
    return _parse(data, known_probes, tolerant=True)


# Unknown keys inside values that fail for another reason appear only once those are removed: a few passes.
_TOLERANT_PASSES = 4


def _parse(data: Any, known_probes: dict[str, Any] | None, tolerant: bool) -> tuple[Config, ConfigNotes]:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: the document must be a mapping, got {type(data).__name__}")
    try:
        data, config_version = take_config_version(data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    data, unknown = _without_unknown_probes(data, known_probes, tolerant, config_version)
    for attempt in range(_TOLERANT_PASSES):
        try:
            config = config_model().model_validate(data)
            break
        except ValidationError as exc:
            errors = exc.errors()
            extra = [tuple(error["loc"]) for error in errors if error["type"] == "extra_forbidden"]
            if not tolerant or not extra or len(extra) < len(errors) or attempt == _TOLERANT_PASSES - 1:
                raise ConfigError(_describe_errors(exc) + newer_release_note(config_version)) from None
            data, removed = without_keys(data, extra)
            unknown.extend(removed)
        except (RecursionError, ValueError, OverflowError) as exc:  # a value no validator can even look at
            raise ConfigError(f"config: unreadable value: {clip(str(exc), ERROR_MESSAGE_CHARS)}") from None
    if known_probes is not None:
        names = unknown_names(config, known_probes)
        if names and not tolerant:
            more = f"; and {len(names) - 10} more" if len(names) > 10 else ""
            raise ConfigError("; ".join(f"config key {name}" for name in names[:10]) + more)
        unknown.extend(names)
    return config, ConfigNotes(tuple(unknown), config_version)


def unknown_names(config: Config, known_probes: dict[str, Any]) -> list[str]:
    """The entries of health.required_checks, kubernetes.disabled_checks, kubernetes.disabled_reasons and
    kubernetes.effects that name no declared check, category or reason: they would select nothing, silently
    (`storage.mount` for storage.mounts). Each as `key[i] ('name' ...; did you mean ...)`."""
    from agent.ready import selector_known  # agent.ready is the one definition of what a selector selects
    from agent.reasons import AGENT_REASONS

    checks = sorted({check for cls in known_probes.values() for check in getattr(cls, "checks", ())})
    declared = (*AGENT_REASONS, *COMMON_REASONS, *(r for cls in known_probes.values() for r in cls.reasons))
    reasons = sorted({reason.code for reason in declared})
    selectors = [*checks, *CATEGORIES]
    out: list[str] = []
    named = [
        ("health.required_checks", config.health.required_checks, selectors, "check or category"),
        ("kubernetes.disabled_checks", config.kubernetes.disabled_checks, selectors, "check or category"),
        ("kubernetes.disabled_reasons", config.kubernetes.disabled_reasons, reasons, "reason"),
        ("kubernetes.effects", list(config.kubernetes.effects), reasons, "reason"),
    ]
    for key, values, known, what in named:
        for i, value in enumerate(values):
            ok = selector_known(value, checks) if what != "reason" else value in reasons
            if not ok:
                where = f"{key}.{value}" if key == "kubernetes.effects" else f"{key}[{i}]"
                out.append(f"{where}: {clip(value, 64)!r} is no declared {what}{did_you_mean(value, known)}")
    return out


def _without_unknown_probes(
    data: dict[str, Any], known_probes: dict[str, Any] | None, tolerant: bool, config_version: str | None
) -> tuple[dict[str, Any], list[str]]:
    schedules = data.get("probes")
    if known_probes is None or not isinstance(schedules, dict):
        return data, []
    unknown = sorted(str(name) for name in schedules if name not in known_probes)
    if not unknown:
        return data, []
    if not tolerant:
        raise ConfigError(
            f"config key probes.{unknown[0]}: unknown probe (allowed: {', '.join(sorted(known_probes))})"
            + newer_release_note(config_version)
        )
    kept = {name: schedule for name, schedule in schedules.items() if name in known_probes}
    return {**data, "probes": kept}, [f"probes.{name}" for name in unknown]


def _read_document(path: str | Path) -> Any:
    try:
        return parse_yaml(read_bounded(path), f"config file {path}")
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: str | Path | None, known_probes: dict[str, Any] | None = None) -> Config:
    """Read, parse and validate a config file; every problem is a ConfigError (exit 2, or a rejected reload)."""
    if path is None:
        return parse_config({}, known_probes)
    return parse_config(_read_document(path), known_probes)


def load_config_tolerant(
    path: str | Path | None, known_probes: dict[str, Any] | None = None
) -> tuple[Config, ConfigNotes]:
    """load_config for the daemon: unknown keys are set aside (agent/configcompat.py), every other problem is
    still a ConfigError."""
    if path is None:
        return parse_config_tolerant({}, known_probes)
    return parse_config_tolerant(_read_document(path), known_probes)


def default_config_yaml(known_probes: dict[str, Any]) -> str:
    """The full default config, every key spelled out, as valid YAML."""
    dumped = default_config().model_dump(mode="json")
    ordered = [*_LEADING_SECTIONS, *(key for key in dumped if key not in _LEADING_SECTIONS and key != "kubernetes")]
    data = {key: dumped[key] for key in [*ordered, "kubernetes"]}
    data["probes"] = {
        name: ProbeSchedule(interval_seconds=cls.default_interval, timeout_seconds=cls.default_timeout).model_dump(
            mode="json"
        )
        for name, cls in sorted(known_probes.items())
    }
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
