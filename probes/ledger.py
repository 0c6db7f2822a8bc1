"""What the npu and gpu families say alike of the device plugins' ledger (the kubelet's PodResources API, read by
`probes.runtime.podresources`): the reason of a ledger that could not be read, and the node-wide finding of a
read that gave no ledger. What each family makes of a ledger it has is its own (`<family>/ledger_findings.py`)."""

from __future__ import annotations

from probes.base import NOT_APPLICABLE, Check, Finding, Reason, Status
from probes.runtime.podresources.client import LedgerRead

POD_RESOURCES_UNAVAILABLE = Reason(
    "PodResourcesUnavailable",
    Status.UNKNOWN,
    "the kubelet's PodResources API had not answered by the end of the probe's run (a quarter second after its own "
    "checks; the read goes on), did not answer within kubernetes.pod_resources_timeout_seconds, answered an error "
    "(UNAVAILABLE, RESOURCE_EXHAUSTED), sent what is not a ledger, or sent an answer larger than the agent reads "
    "(TOO_LARGE: more pods, containers or device ids, or a longer message, than docs/probes/npu.md's bounds admit; "
    "nothing of it is kept); the holder checks stand without it",
    "check the kubelet (`systemctl status kubelet`), the socket kubernetes.pod_resources_socket and the DaemonSet's "
    "pod-resources mount; the message names the error (for TOO_LARGE, the part and its size: a device plugin "
    "offering that many ids?)",
)


def unread_ledger(check: Check, read: LedgerRead) -> list[Finding] | None:
    """The node-wide finding of a read that gave no ledger (skip: no socket; unknown: the kubelet failed), or None
    when there is a ledger to judge."""
    if read.state == "skip":
        return [check.report(NOT_APPLICABLE, "", read.why, read.observed())]
    if not read.ok or read.ledger is None:
        message = f"device plugin ledger unknown: {read.why}; the holder checks stand without it"
        return [check.report(POD_RESOURCES_UNAVAILABLE, "", message, read.observed())]
    return None
