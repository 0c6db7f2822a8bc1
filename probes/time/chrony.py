"""chronyd's own view of the clock (`chronyc -n tracking`), added to the kernel finding when chronyd answers."""

from __future__ import annotations

from typing import Any

from probes.base import ProbeContext, ProbeParseError
from probes.time.config import TimeConfig

_CHRONY_SECONDS = {
    "Last offset": "last_offset_seconds",
    "RMS offset": "rms_offset_seconds",
    "Root delay": "root_delay_seconds",
    "Root dispersion": "root_dispersion_seconds",
    "Update interval": "update_interval_seconds",
}
_CHRONY_PPM = {"Residual freq": "residual_freq_ppm", "Skew": "skew_ppm"}


def _number(text: str, key: str) -> float:
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):
        raise ProbeParseError(f"chronyc tracking: {key}: not a number: {text!r}") from None


def parse_chrony_tracking(text: str) -> dict[str, Any]:
    """`chronyc -n tracking` → numbers in seconds and ppm; offsets positive when the clock is fast."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    missing = [k for k in ("Reference ID", "Stratum", "Leap status") if k not in fields]
    if missing:
        raise ProbeParseError(f"chronyc tracking: no {', '.join(missing)} line in {text[:120]!r}")
    out: dict[str, Any] = {
        "reference_id": fields["Reference ID"],
        "stratum": int(_number(fields["Stratum"], "Stratum")),
        "leap_status": fields["Leap status"],
    }
    if "Ref time (UTC)" in fields:
        out["ref_time_utc"] = fields["Ref time (UTC)"]
    if "System time" in fields:
        # "0.000006523 seconds slow of NTP time": slow means behind, a negative offset.
        value = fields["System time"]
        number = _number(value, "System time")
        out["system_time_offset_seconds"] = -number if " slow" in value else number
    if "Frequency" in fields:
        value = fields["Frequency"]
        number = _number(value, "Frequency")
        out["frequency_ppm"] = -number if value.endswith("slow") else number
    for key, name in {**_CHRONY_SECONDS, **_CHRONY_PPM}.items():
        if key in fields:
            out[name] = _number(fields[key], key)
    return out


def chrony_tracking(ctx: ProbeContext) -> tuple[dict[str, Any] | None, str]:
    """(tracking data, parse error); (None, "") when chronyc is absent or chronyd does not answer."""
    settings = ctx.settings(TimeConfig)
    if not settings.chronyc_command:
        return None, ""
    result = ctx.host.run(
        [*settings.chronyc_command, "-n", "tracking"], timeout=min(settings.chronyc_timeout_seconds, ctx.remaining())
    )
    if not result.ok:  # not installed, timed out, "506 Cannot talk to daemon"
        return None, ""
    try:
        return parse_chrony_tracking(result.stdout), ""
    except ProbeParseError as exc:
        return None, str(exc)
