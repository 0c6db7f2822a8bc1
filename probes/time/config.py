"""Config of the time family (`time:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from probes.family import PositiveSeconds, Section
from probes.runtime.addresses import split_host_port


class TimeConfig(Section):
    # "host" or "host:port"; empty: the servers of the host's chrony, ntpd or timesyncd config (under host.root).
    ntp_servers: list[str] = []
    warn_offset_seconds: PositiveSeconds = 0.1
    fail_offset_seconds: PositiveSeconds = 1.0
    ntp_timeout_seconds: PositiveSeconds = 2.0
    # argv prefix for chronyc; `-n tracking` is appended. e.g. [nsenter, -t, 1, -m, -n, --, chronyc]
    chronyc_command: list[str] = ["chronyc"]
    chronyc_timeout_seconds: PositiveSeconds = 2.0
    # Status of an unsynchronised kernel clock (ClockUnsynced), whatever the servers' offsets: warn or fail.
    unsynced_status: Literal["warn", "fail"] = "warn"
    # time.sync is required on a node where NTP servers are configured (here or in the host's daemon): when none
    # of them gives a usable answer (names resolve nowhere, no reply), its unknown findings block /ready.
    # false: only when health.required_checks names time.sync. A node with no server has nothing to require.
    required: bool = True

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
