"""The probe contract: statuses, findings, reasons, categories, the probe base class and registry.

A probe reads the host and returns findings (and optional metric samples). It knows nothing of HTTP,
metrics exposition or Kubernetes; the agent schedules it, bounds it with a deadline and keeps its results.

Everything a probe may say is declared: each probe lists the reason codes it can emit (`Probe.reasons`,
each with its status, a one-line meaning and the fix), and each family (a package such as `probes/storage/`)
declares its config section and its docs page (`Family`, in `probes.family`). The agent assembles these;
nothing here imports it.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from probes.family import SectionT, family_of, family_settings
from probes.runtime.resolver import HostResolverSettings
from probes.text import escape, escape_value

if TYPE_CHECKING:
    from probes.runtime.host import Host
    from probes.runtime.podresources.pods import KubeletAccess

log = logging.getLogger(__name__)


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    UNKNOWN = "unknown"
    # The probe does not apply to this host (no NPU, no npu-smi): never blocks readiness.
    SKIP = "skip"

    @property
    def metric_value(self) -> int:
        return _STATUS_METRIC_VALUE[self]


_STATUS_METRIC_VALUE = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2, Status.UNKNOWN: 3, Status.SKIP: 4}


# --- categories: one taint and one condition each ----------------------------------------------------


@dataclass(frozen=True)
class Category:
    name: str  # also the taint key's name: <kubernetes.key_prefix>/<name>
    condition_type: str  # the Node condition, positive polarity (True = healthy)
    title: str


# The one table of categories. A check belongs to the category named by its first dotted segment when that
# is a category; anything else (pcie, kernel) is "host" unless the finding names its category explicitly.
CATEGORIES: Mapping[str, Category] = {
    category.name: category
    for category in (
        Category("npu", "NPUHealthy", "Ascend NPU"),
        Category("gpu", "GPUHealthy", "NVIDIA GPU"),
        Category("storage", "StorageHealthy", "Storage"),
        Category("network", "NetworkHealthy", "Network"),
        # The links between the nodes' chips (InfiniBand/RoCE HCA ports, the collective's interface): a problem
        # here hurts multi-node jobs only, so single-node jobs may tolerate its taint (docs/kubernetes.md).
        Category("interconnect", "InterconnectHealthy", "Interconnect"),
        Category("time", "ClockSynced", "Clock"),
        Category("host", "HostHealthy", "Host"),
    )
}
DEFAULT_CATEGORY = "host"


def category_of(check: str, override: str | None = None) -> str:
    if override is not None and override in CATEGORIES:
        return override
    head = check.split(".", 1)[0]
    return head if head in CATEGORIES else DEFAULT_CATEGORY


# Key in Finding.observed under which device probes report free HBM / framebuffer per chip, so that
# /ready?min_hbm_free_mib=N can be answered from cached results without knowing the probe.
OBSERVED_HBM_FREE_MIB = "hbm_free_mib"
# Other names a device finding's device is known by (GPU UUID, MIG device UUIDs), so /ready?devices= takes
# what NVIDIA_VISIBLE_DEVICES holds under the device plugin's uuid strategy: a list of strings.
OBSERVED_DEVICE_IDS = "device_ids"
# The pods the device plugins' ledger (the kubelet's PodResources API) allocated a device to, on the npu.ledger
# and gpu.ledger finding about that device: a list of {namespace, name, container, resource, device_id}.
OBSERVED_ALLOCATED_TO = "allocated_to"
# How the cluster's device APIs know the device a finding is about (agent/kube matches a DRA ResourceSlice's
# device by these, never by position): its PCI address as the tool prints it, the NPU's physical id (the N of
# /dev/davinciN, what MindCluster publishes as `physicId` and takes in a public fault's deviceIds) and the
# device node's minor (/dev/nvidiaN: the NVIDIA DRA driver's device `gpu-<minor>`, not the NVML index).
OBSERVED_PCI_BUS_ID = "pci_bus_id"
OBSERVED_PHYSICAL_ID = "physical_id"
OBSERVED_DEVICE_MINOR = "device_minor"
# host.memory reports MemAvailable (subject "") and free hugepages (subject "hugepages") under these keys, so
# /ready?min_host_mem_mib=N and min_hugepages=N are answered from cached results.
OBSERVED_HOST_MEM_AVAILABLE_MIB = "available_mib"
OBSERVED_HUGEPAGES_FREE = "hugepages_free"


# --- findings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Something the agent did or saw that must be told on the Node as a Kubernetes event (a removed lock)."""

    reason: str
    message: str
    warning: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", escape(self.message))


@dataclass(frozen=True)
class Finding:
    """One judgement about one subject, the unit that flows from probes to state, HTTP and Kubernetes."""

    check: str
    subject: str
    status: Status
    reason: str
    message: str
    hint: str = ""
    observed: Mapping[str, Any] = field(default_factory=dict)
    # Logical device index (NPU logical id / GPU index) this finding is about, for /ready?devices=.
    device: int | None = None
    # Overrides the category derived from the check name (e.g. a kernel.log rule about NFS → storage).
    category_override: str | None = None
    event: Event | None = None
    # The probe judged this check required on this node: an unknown result blocks readiness whatever
    # health.required_checks says (time.sync when NTP servers are configured and none of them answered).
    required: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            object.__setattr__(self, "status", Status(self.status))
        # Where every message is made: a process name, a path, tool or kernel output in any of these reaches
        # terminals, logs, /status and the Node only escaped (probes/text.py). The subject too, although it is
        # a key and a metric label: escaping is idempotent, so the same subject is always the same key.
        # `observed` keeps what was measured (/ready matches device ids in it); it leaves only by to_dict,
        # which escapes it, and is not walked again by every replace().
        for name in ("subject", "message", "hint"):
            object.__setattr__(self, name, escape(getattr(self, name)))

    @property
    def category(self) -> str:
        return category_of(self.check, self.category_override)

    @property
    def key(self) -> tuple[str, str]:
        return (self.check, self.subject)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "check": self.check,
            "subject": self.subject,
            "status": self.status.value,
            "reason": self.reason,
            "message": self.message,
            "hint": self.hint,
            "observed": dict(escape_value(self.observed)),
            "category": self.category,
        }
        if self.device is not None:
            out["device"] = self.device
        if self.required:
            out["required"] = True
        return out


@dataclass(frozen=True)
class Sample:
    """A metric sample a probe exports beside its findings (device gauges, latencies, counters)."""

    name: str
    help: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    kind: Literal["gauge", "counter"] = "gauge"

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", escape_value(self.labels))  # a path or device name from the host


ProbeOutput = list[Finding | Sample]


# --- reasons ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    """A reason code a probe may emit: the status it comes with, what it means, and the fix.

    `also` lists other statuses the same code may carry (a configurable severity, a warn that turns into a
    fail past a threshold). The hint is the documented fix; a finding may give a more specific one.
    """

    code: str
    status: Status
    meaning: str
    hint: str = ""
    also: tuple[Status, ...] = ()

    @property
    def statuses(self) -> tuple[Status, ...]:
        return (self.status, *self.also)


OK = Reason("OK", Status.OK, "the check passed")
NOT_APPLICABLE = Reason(
    "NotApplicable", Status.SKIP, "the probe does not apply to this host (no such device, nothing configured)"
)
# A probe's parser met tool output it does not understand: emitted by the scheduler for ProbeParseError.
PARSE_ERROR = Reason(
    "ParseError",
    Status.UNKNOWN,
    "a tool's output could not be parsed",
    "the tool's output format is new to the agent: report it with the tool's version and output",
)
# Declared for every probe: OK, NotApplicable and ParseError can come from any of them.
COMMON_REASONS: tuple[Reason, ...] = (OK, NOT_APPLICABLE, PARSE_ERROR)


class Check:
    """Builds the findings of one check, so a probe names the reason and the subject, not eight positions.

    `SPACE = Check("storage.space")`, then `SPACE.report(DISK_FULL, "/data", "98% used", observed)` or
    `SPACE.ok("/data", "40% used", observed)`. The reason's hint is used unless a finding gives its own.
    """

    def __init__(self, name: str, category: str | None = None) -> None:
        self.name = name
        self.category = category

    def report(
        self,
        reason: Reason,
        subject: str,
        message: str,
        observed: Mapping[str, Any] | None = None,
        *,
        hint: str | None = None,
        status: Status | None = None,
        device: int | None = None,
        category: str | None = None,
        event: Event | None = None,
        required: bool = False,
    ) -> Finding:
        return Finding(
            self.name,
            subject,
            status or reason.status,
            reason.code,
            message,
            reason.hint if hint is None else hint,
            dict(observed or {}),
            device,
            category or self.category,
            event,
            required,
        )

    def ok(
        self,
        subject: str,
        message: str,
        observed: Mapping[str, Any] | None = None,
        *,
        device: int | None = None,
        category: str | None = None,
    ) -> Finding:
        return self.report(OK, subject, message, observed, hint="", device=device, category=category)


class UndeclaredReason(TypeError):
    """A probe emitted a reason code (or a status for it) that it does not declare."""


STRICT_REASONS_ENV = "NODE_HEALTH_STRICT_REASONS"
_warned_undeclared: set[tuple[str, str, str]] = set()


def check_declared(probe: Probe, findings: Sequence[Finding], allowed: Mapping[str, Reason]) -> None:
    """Raise UndeclaredReason (tests, NODE_HEALTH_STRICT_REASONS=1) or log once (in production, where an
    undeclared reason must never hide the finding) for each finding whose reason or status is not declared."""
    for finding in findings:
        reason = allowed.get(finding.reason)
        if reason is not None and finding.status in reason.statuses:
            continue
        what = (
            f"probe {probe.name} emitted {finding.reason!r} with status {finding.status.value} for {finding.check}, "
            + (
                "which it does not declare"
                if reason is None
                else f"declared only as {[s.value for s in reason.statuses]}"
            )
        )
        if os.environ.get(STRICT_REASONS_ENV) == "1":
            raise UndeclaredReason(what)
        key = (probe.name, finding.reason, finding.status.value)
        if key not in _warned_undeclared:
            _warned_undeclared.add(key)
            log.warning("%s", what)


# --- probes -----------------------------------------------------------------------------------------


class ProbeContext:
    """What a probe gets for one run, set by the agent: the host, the config in force, the deadline, and the
    facts of the agent's own settings a probe needs, as typed fields (a probe never reads agent settings).

    - `host`: where the host's filesystems are (`ctx.host.paths`), host commands and child calls;
    - `node_name`: the Kubernetes node this agent runs on ("" where none is known);
    - `redact_cmdlines`: other tenants' command lines can hold secrets, so processes are named by PID,
      executable and pod unless the operator opts in (config: redact_cmdlines: false);
    - `host_resolver`: how the node's own resolver is set up (network.dns.nameservers, else the host's
      resolv.conf), for every family that resolves a name the way the node does;
    - `kubelet`: the kubelet's PodResources socket (the device plugins' ledger) and the node's pods, when known.

    A family's own section is `ctx.settings(FamilyConfig)`.
    """

    def __init__(
        self,
        host: Host,
        config: Any,
        timeout: float,
        *,
        node_name: str = "",
        redact_cmdlines: bool = True,
        host_resolver: HostResolverSettings | None = None,
        kubelet: KubeletAccess | None = None,
    ) -> None:
        self.host = host
        self.config = config
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.node_name = node_name
        self.redact_cmdlines = redact_cmdlines
        self.host_resolver = host_resolver if host_resolver is not None else HostResolverSettings()
        if kubelet is None:
            from probes.runtime.podresources.pods import KubeletAccess

            kubelet = KubeletAccess()
        self.kubelet = kubelet

    def remaining(self, floor: float = 0.05) -> float:
        """Seconds left before the deadline (never below `floor`, so a last call still gets a chance)."""
        return max(floor, self.deadline - time.monotonic())

    def settings(self, model: type[SectionT]) -> SectionT:
        """This run's settings of one family: `ctx.settings(StorageConfig)`."""
        return family_settings(self.config, model)


class Probe(ABC):
    """One schedulable unit. Subclasses set the class attributes and implement `run`.

    One instance lives as long as the agent, so a probe may keep state between runs (AER counter deltas,
    link flap history). `run` is called from one thread at a time; it must bound everything it does by
    `ctx.deadline` (host commands and filesystem calls through `ctx.host` do).

    Every finding `run` returns is checked against `reasons` (plus OK, NotApplicable and ParseError).
    """

    name: ClassVar[str]
    checks: ClassVar[tuple[str, ...]]
    reasons: ClassVar[tuple[Reason, ...]] = ()
    default_interval: ClassVar[float] = 30.0
    default_timeout: ClassVar[float] = 10.0
    needs: ClassVar[str] = "nothing beyond /proc"
    # The checks are the config's (site checks): `configure` sets them on the instance, `checks` is empty here.
    checks_from_config: ClassVar[bool] = False
    # Config lists whose emptiness makes the probe not apply (e.g. ("mounts",) in its family's section).
    skip_when_empty: ClassVar[tuple[str, ...]] = ()
    # Categories its findings can carry besides their checks' own (a Check's or a finding's category override,
    # such as network.collective's interconnect), so selecting a category selects the probe (`check --only`).
    categories: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is not None and not getattr(run, "_checks_reasons", False):

            @functools.wraps(run)
            def checked_run(self: Probe, ctx: ProbeContext) -> ProbeOutput:
                output = run(self, ctx)
                if isinstance(output, (list, tuple)):
                    findings = [item for item in output if isinstance(item, Finding)]
                    check_declared(self, findings, self.allowed_reasons(ctx))
                return output

            checked_run._checks_reasons = True  # type: ignore[attr-defined]
            cls.run = checked_run  # type: ignore[method-assign]

    def configure(self, config: Any) -> None:
        """Called with each config in force before the agent reads `checks`; a probe whose checks come from the
        config (`checks_from_config`) sets them here."""
        return None  # the others take their checks from the class

    @classmethod
    def declared_reasons(cls) -> tuple[Reason, ...]:
        """The reasons this probe documents: its own and the common ones, each code once."""
        seen: dict[str, Reason] = {}
        for reason in (*COMMON_REASONS, *cls.reasons):
            seen.setdefault(reason.code, reason)
        return tuple(seen.values())

    def allowed_reasons(self, ctx: ProbeContext) -> Mapping[str, Reason]:
        """Reasons a run may emit; a probe whose reasons come from config (kernel.log rules) widens this."""
        return {reason.code: reason for reason in self.declared_reasons()}

    def applicable(self, ctx: ProbeContext) -> str | None:
        """Return why this probe does not apply to this host (→ skip), or None when it does."""
        family = family_of(type(self))
        if family is None or not self.skip_when_empty:
            return None
        section = ctx.settings(family.config)
        for key in self.skip_when_empty:
            if not getattr(section, key, None):
                return f"nothing configured in {family.key}.{key}"
        return None

    @abstractmethod
    def run(self, ctx: ProbeContext) -> ProbeOutput:
        """Read the host and return findings (and samples)."""


class ProbeParseError(ValueError):
    """Tool output that a parser could not make sense of; the check becomes unknown / ParseError."""


REGISTRY: dict[str, type[Probe]] = {}


def register(cls: type[Probe]) -> type[Probe]:
    """Class decorator: add a probe to the registry (probe names are unique)."""
    if not getattr(cls, "name", None) or not (getattr(cls, "checks", None) or cls.checks_from_config):
        raise TypeError(f"probe {cls.__name__} must declare name and checks")
    existing = REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"probe name {cls.name!r} registered twice ({existing.__name__}, {cls.__name__})")
    REGISTRY[cls.name] = cls
    return cls
