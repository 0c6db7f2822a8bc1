"""Config of the pcie family (`pcie:`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from probes.family import PositiveSeconds, Section


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
