"""What one ledger answer may hold: read by the reader child (`reader.py`, which imports this file by name, like the
generated modules beside it) before it builds anything, and checked again by the agent's parse (`ledger.py`).

An answer past any of them is not read: the child answers TOO_LARGE naming the part and its size, the ledger is
unknown for that read (npu.ledger and gpu.ledger `unknown`, /ready?pod= LedgerUnavailable), and nothing of it is
kept. Together they bound what the agent and its reader child hold for one answer, whatever the kubelet sends
(docs/kubernetes.md, The kubelet's ledger; tests/runtime/test_podresources_memory.py measures both against the
DaemonSet's memory limit).

Each is far above what a node has: a kubelet runs at most a few hundred pods (max-pods, 110 by default); a node's
device plugins offer a few hundred ids (8 GPUs x 64 time-slicing replicas is 512; an RDMA shared-device plugin
offers 1,000 per resource).
"""

# One gRPC message (the List answer, the GetAllocatableResources answer): its length prefix is read first and an
# answer longer than this is never received. Parsing costs the child up to ~30 MiB per MiB of message (the worst
# shape, a million empty entries, measured), so this is what bounds the child; a node's answer is tens of KiB, and
# 250 pods of 5 containers holding 8 devices each are about 0.6 MiB.
MAX_MESSAGE_BYTES = 2 << 20
MAX_PODS = 2000
MAX_CONTAINERS = 20000  # in all pods together
MAX_ALLOCATED_IDS = 20000  # device ids and DRA devices given to containers, in all
MAX_ALLOCATABLE_IDS = 20000  # device ids the plugins offer, in all resources together
MAX_TEXT_CHARS = 512  # one name, resource name or device id (a pod name is at most 253 characters)
# The child's answer line (JSON, one line): what the agent reads of it at most. The child measures the line it would
# send, and one past this is TOO_LARGE too.
MAX_ANSWER_BYTES = 8 << 20
