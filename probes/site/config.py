"""Config of the site checks (`site_checks:`): a list of operator-owned commands.

Only the config file names a command: nothing a pod controls (an annotation, a label, a query of /ready) reaches
this list, and a command is an argv run without a shell, so no value is ever interpreted by one.
"""

from __future__ import annotations

from pydantic import Field, RootModel, field_validator, model_validator

from probes.base import CATEGORIES
from probes.family import Section

MIN_INTERVAL_SECONDS = 10.0  # a site command is a process on every node: not more often than this
MAX_DEADLINE_SECONDS = 60.0
MAX_OUTPUT_CAP_BYTES = 1 << 20
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_-]{0,46}[a-z0-9])?$"


class SiteCheck(Section):
    # The check is `site.<name>`: lower case letters, digits, `-` and `_`.
    name: str = Field(pattern=NAME_PATTERN)
    # argv, run as is (no shell): e.g. [/etc/node-health/site/driver-pin.sh, "550.54.15"]; under hostPID,
    # [nsenter, -t, 1, -m, --, ...] runs it in the host's mount namespace as the vendor tools are.
    command: list[str] = Field(min_length=1)
    # The category whose condition and taint the check counts under: npu, gpu, storage, network, time, host.
    category: str = "host"
    interval_seconds: float = Field(60.0, ge=MIN_INTERVAL_SECONDS)
    # The deadline: past it the command's process group is killed and the check is unknown (SiteCheckTimeout).
    timeout_seconds: float = Field(10.0, gt=0, le=MAX_DEADLINE_SECONDS)
    # stdout and stderr are each read up to this many bytes; past it the command is killed (SiteCheckOutputCapped).
    output_cap_bytes: int = Field(65536, ge=1024, le=MAX_OUTPUT_CAP_BYTES)
    # The fix shown with a warn, fail or unknown result (the table's `fix:` line, /status `hint`).
    fix: str = ""
    # An unknown result (timeout, signal, another exit status) blocks readiness too, as health.required_checks.
    required: bool = False

    @field_validator("command")
    @classmethod
    def _argv(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("the command's first element (the program) is empty")
        if any("\x00" in part for part in value):
            raise ValueError("an argument holds a NUL byte")
        return value

    @field_validator("category")
    @classmethod
    def _category(cls, value: str) -> str:
        if value not in CATEGORIES:
            raise ValueError(f"unknown category {value!r} (allowed: {', '.join(CATEGORIES)})")
        return value

    @model_validator(mode="after")
    def _deadline_within_interval(self) -> SiteCheck:
        if self.timeout_seconds >= self.interval_seconds:
            raise ValueError("timeout_seconds must be shorter than interval_seconds")
        return self


class SiteChecksConfig(RootModel[list[SiteCheck]]):
    """The `site_checks:` list (empty by default: no site check runs)."""

    root: list[SiteCheck] = []
    model_config = {"frozen": True}

    @field_validator("root")
    @classmethod
    def _unique_names(cls, value: list[SiteCheck]) -> list[SiteCheck]:
        seen: set[str] = set()
        for check in value:
            if check.name in seen:
                raise ValueError(f"site check name {check.name!r} given twice")
            seen.add(check.name)
        return value
