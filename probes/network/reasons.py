"""Reasons shared by the network family's probes (network.dns and network.egress)."""

from __future__ import annotations

from probes.base import Reason, Status

# A check run by `probes.runtime.parallel` that did not finish by the probe's deadline.
DEADLINE_EXCEEDED = Reason(
    "DeadlineExceeded",
    Status.UNKNOWN,
    "a DNS lookup or egress check did not finish (or could not start) within the probe's deadline",
    "raise the probe's timeout_seconds (probes.<probe>.timeout_seconds) above the targets' own timeouts, "
    "or check fewer names or targets",
)
