"""Config of the kernel log family (`kernel_log:`)."""

from __future__ import annotations

import re
from typing import Literal

import regex
from pydantic import Field, field_validator

from probes.base import CATEGORIES
from probes.family import PositiveSeconds, Section

# A rule's reason becomes a taint value and a Node condition reason: Kubernetes takes at most 63 characters
# there (a longer one made every Node PATCH fail with 422), and CamelCase is what condition reasons use.
RULE_REASON = re.compile(r"^[A-Z][A-Za-z0-9]{0,62}$")
# The kernel.log probe's own reasons (and the common ones): a rule may not raise them.
RESERVED_REASONS = frozenset({"OK", "NotApplicable", "ParseError", "KernelLogUnavailable", "KernelLogReadFailed"})


class KernelLogRule(Section):
    """One node-problem-detector style rule: a regex over kernel-facility /dev/kmsg messages → a reason."""

    reason: str
    pattern: str
    # temporary: reported with `status`; permanent: reported as fail. Both clear after the quiet period.
    type: Literal["temporary", "permanent"] = "temporary"
    count: int = Field(1, ge=1)  # matches needed within window_seconds to raise the problem
    window_seconds: PositiveSeconds = 60.0
    status: Literal["warn", "fail"] = "warn"
    category: str = "host"
    # Named group → values that make a match fail (e.g. {xid: ["79"]}) whatever `status` says.
    fail_on: dict[str, list[str]] = {}
    # A line matching this clears the problem at once (e.g. "nfs: server X OK").
    recover_pattern: str | None = None
    quiet_period_seconds: PositiveSeconds | None = None  # None: kernel_log.quiet_period_seconds
    hint: str = ""
    # What the reason means, for the reason reference (node-health probes --reasons, the docs' tables).
    meaning: str = ""

    @field_validator("reason")
    @classmethod
    def _kubernetes_reason(cls, value: str) -> str:
        if not RULE_REASON.fullmatch(value):
            raise ValueError(
                f"must be CamelCase letters and digits starting with a capital, at most 63 characters "
                f"(it becomes a taint value and a Node condition reason); got {len(value)} characters"
            )
        if value in RESERVED_REASONS:
            raise ValueError(f"{value!r} is a reason of the kernel.log probe itself; choose another")
        return value

    @field_validator("category")
    @classmethod
    def _known_category(cls, value: str) -> str:
        if value not in CATEGORIES:
            raise ValueError(f"unknown category {value!r} (allowed: {', '.join(CATEGORIES)})")
        return value

    @field_validator("pattern", "recover_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                regex.compile(value)  # the engine's: the regex module (Python's re syntax, and more)
            except regex.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


def _default_kernel_log_rules() -> list[KernelLogRule]:
    from probes.kernel.default_rules import DEFAULT_RULES

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
    # Rules see at most this much of a message, and messages show at most this much.
    max_line_chars: int = Field(240, ge=40)
    # One match of one rule on one line: beyond it the match is given up (counted, taken as no match).
    match_timeout_seconds: PositiveSeconds = 0.05
