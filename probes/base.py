"""The probe contract: what a probe declares, what it returns, and the registry.

A probe reads the host and returns findings (and optional metric samples). It knows nothing of HTTP,
metrics exposition or Kubernetes; the agent schedules it, bounds it with a deadline and keeps its results.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from agent.config import Config
    from agent.host import Host


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

# Categories of DESIGN.md: one taint and one condition each. A check belongs to the category named by
# its first dotted segment when that is a category; anything else (pcie, kernel) falls back to "host"
# unless the finding names its category explicitly.
CATEGORIES = ("npu", "gpu", "storage", "network", "time", "host")

# Key in Finding.observed under which device probes report free HBM / framebuffer per chip, so that
# /ready?min_hbm_free_mib=N can be answered from cached results without knowing the probe.
OBSERVED_HBM_FREE_MIB = "hbm_free_mib"


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

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            object.__setattr__(self, "status", Status(self.status))

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
            "observed": dict(self.observed),
            "category": self.category,
        }
        if self.device is not None:
            out["device"] = self.device
        return out


def category_of(check: str, override: str | None = None) -> str:
    if override in CATEGORIES:
        return override  # type: ignore[return-value]
    head = check.split(".", 1)[0]
    return head if head in CATEGORIES else "host"


@dataclass(frozen=True)
class Sample:
    """A metric sample a probe exports beside its findings (device gauges, latencies, counters)."""

    name: str
    help: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    kind: Literal["gauge", "counter"] = "gauge"


ProbeOutput = list[Finding | Sample]


class ProbeContext:
    """What a probe gets for one run: the host, the config in force, and its deadline."""

    def __init__(self, host: Host, config: Config, timeout: float) -> None:
        self.host = host
        self.config = config
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def remaining(self, floor: float = 0.05) -> float:
        """Seconds left before the deadline (never below `floor`, so a last call still gets a chance)."""
        return max(floor, self.deadline - time.monotonic())


class Probe(ABC):
    """One schedulable unit. Subclasses set the class attributes and implement `run`.

    One instance lives as long as the agent, so a probe may keep state between runs (AER counter deltas,
    link flap history). `run` is called from one thread at a time; it must bound everything it does by
    `ctx.deadline` (host commands and filesystem calls through `ctx.host` do).
    """

    name: ClassVar[str]
    checks: ClassVar[tuple[str, ...]]
    default_interval: ClassVar[float] = 30.0
    default_timeout: ClassVar[float] = 10.0
    needs: ClassVar[str] = "nothing beyond /proc"

    def applicable(self, ctx: ProbeContext) -> str | None:
        """Return why this probe does not apply to this host (→ skip), or None when it does."""
        return None

    @abstractmethod
    def run(self, ctx: ProbeContext) -> ProbeOutput:
        """Read the host and return findings (and samples)."""


class ProbeParseError(ValueError):
    """Tool output that a parser could not make sense of; the check becomes unknown / ParseError."""


REGISTRY: dict[str, type[Probe]] = {}


def register(cls: type[Probe]) -> type[Probe]:
    """Class decorator: add a probe to the registry (probe names are unique)."""
    if not getattr(cls, "name", None) or not getattr(cls, "checks", None):
        raise TypeError(f"probe {cls.__name__} must declare name and checks")
    existing = REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"probe name {cls.name!r} registered twice ({existing.__name__}, {cls.__name__})")
    REGISTRY[cls.name] = cls
    return cls
