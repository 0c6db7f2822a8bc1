"""The reasons the agent itself gives (not a probe), declared once: the findings that carry them are built
from these declarations (`Check(...).report(REASON, ...)`), so the fix a finding shows is the documented one.

WarmingUp and Stale block readiness whether the check is required or not: they say the agent has no fresh
result to vouch for the node with. The reference lists these beside the probes' own (node-health probes
--reasons); ParseError, which any probe's parser may cause, is declared with the common reasons in
probes.base.
"""

from __future__ import annotations

from probes.base import Reason, Status

WARMING_UP = Reason(
    "WarmingUp",
    Status.UNKNOWN,
    "the check has not produced a result since the agent started; never ready meanwhile",
    "wait one probe interval; /status shows when each probe last ran",
)
STALE = Reason(
    "Stale",
    Status.UNKNOWN,
    "the last result is older than health.stale_after_intervals intervals: the probe is not running on schedule",
    "see /healthz, /status and the agent log; a probe stuck on a hung filesystem or tool shows there",
)
PROBE_TIMEOUT = Reason(
    "ProbeTimeout",
    Status.UNKNOWN,
    "the probe overran its deadline (a hung tool or filesystem); it is not restarted while it runs",
    "see the agent log for the probe; check the host command or mount it was using",
)
PROBE_ERROR = Reason(
    "ProbeError",
    Status.UNKNOWN,
    "the probe raised an exception; the message names it",
    "see the agent log (logging.level: debug shows the traceback) and report it",
)
HBM_BELOW_REQUEST = Reason(
    "HbmBelowRequest",
    Status.FAIL,
    "/ready?min_hbm_free_mib=N: a considered device has less free device memory than the job asked for",
    "another process holds device memory: see the device's holders (npu.holders, gpu.holders), or ask for less",
)
HOST_MEM_BELOW_REQUEST = Reason(
    "HostMemoryBelowRequest",
    Status.FAIL,
    "/ready?min_host_mem_mib=N or min_hugepages=N: the host has less available memory or fewer free hugepages "
    "than the job asked for; unknown when host.memory has no current value to compare (never ready then)",
    "stop leftovers of earlier jobs (processes: ps aux --sort=-rss | head; files left in tmpfs, which no process "
    "shows: df -h -t tmpfs), or ask for less; when unknown, see the host probe in /status (a host may reserve no "
    "hugepages at all)",
    also=(Status.UNKNOWN,),
)
NO_SUCH_DEVICE = Reason(
    "NoSuchDevice",
    Status.FAIL,
    "/ready?devices=N names a device index no npu or gpu result of this node carries (a 4-chip node asked for "
    "device 7), or min_hbm_free_mib=N was asked of a node where no considered device reports free device memory "
    "(no accelerator at all): the agent cannot vouch for what the node does not have; never ready then",
    "ask the agent of the node the job is placed on, with the devices the device plugin gave the job "
    "(*_VISIBLE_DEVICES, or pod=<namespace>/<name>); /status lists the node's devices",
)

# /ready?pod=<namespace>/<name> (agent/http/pod.py): the pod's devices come from the kubelet's ledger; when they
# cannot be told the answer is not ready with one of these, unless the query gave devices= to fall back to.
LEDGER_UNAVAILABLE = Reason(
    "LedgerUnavailable",
    Status.UNKNOWN,
    "/ready?pod=: the kubelet's ledger (PodResources API) could not be read (no socket, the kubelet did not answer "
    "in time or answered an error, its answer is larger than the agent reads, nothing read yet), or cannot tell an "
    "Ascend pod's chips with Kubernetes off "
    "(Volcano's real chips are in the pod list), so the pod's devices are unknown; never ready then",
    "see npu.ledger / gpu.ledger in /status for the read's error; check kubernetes.pod_resources_socket and the "
    "DaemonSet's /var/lib/kubelet/pod-resources mount; deploy/examples/preflight.sh asks about the whole node then",
)
LEDGER_STALE = Reason(
    "LedgerStale",
    Status.UNKNOWN,
    "/ready?pod=: the last ledger read is too old to vouch for the pod's devices (a newer read was asked for and has "
    "not finished: the kubelet is slow or hung); never ready then",
    "retry in a few seconds; see npu.ledger / gpu.ledger in /status and the kubelet's health on the node",
)
POD_NOT_IN_LEDGER = Reason(
    "PodNotInLedger",
    Status.UNKNOWN,
    "/ready?pod=: the kubelet's ledger, read within the last second, does not list this pod: a name or namespace "
    "that is not the pod's, a pod on another node (the kubelet lists only its own node's pods), or one admitted "
    "since that read; never ready then",
    "retry once (a pod admitted just now is listed by the next read); else pass the pod's own namespace and name "
    "(downward API: metadata.namespace, metadata.name) and ask the agent on the pod's node",
)
POD_DEVICES_UNKNOWN = Reason(
    "PodDevicesUnknown",
    Status.UNKNOWN,
    "/ready?pod=: the ledger lists the pod's devices, but the agent cannot tell yet which of its devices they are "
    "(a GPU id no gpu result names, a chip no npu result lists, or Volcano's huawei.com/AscendReal not in the "
    "node's pod list yet); never ready then",
    "retry in a few seconds (the npu and gpu results and the node's pod list catch up); or pass devices= as well, "
    "which is judged instead",
)

AGENT_REASONS: tuple[Reason, ...] = (
    WARMING_UP,
    STALE,
    PROBE_TIMEOUT,
    PROBE_ERROR,
    HBM_BELOW_REQUEST,
    HOST_MEM_BELOW_REQUEST,
    NO_SUCH_DEVICE,
    LEDGER_UNAVAILABLE,
    LEDGER_STALE,
    POD_NOT_IN_LEDGER,
    POD_DEVICES_UNKNOWN,
)

# No fresh result to judge by: never ready, and Kubernetes holds what the Node carries until one comes.
NO_FRESH_RESULT = frozenset({WARMING_UP.code, STALE.code})
