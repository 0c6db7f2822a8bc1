"""The agent on the Kubernetes side: taints, labels, conditions and events on its own Node.

- `policy`: what the Node should carry, from a health snapshot (pure).
- `plan`: the patch to send, from the snapshot, the Node as read and the policy (pure).
- `budget`: the cluster taint budget (a ConfigMap of slots, compare-and-swap).
- `reconciler`: the thread that applies plans (`KubeAgent`); `events`: its Event queue; `report`: /status, metrics.
- `client`: loading the client, the API calls the package makes, error classification, backoff.
- `cleanup`: `node-health cleanup`, before an uninstall.
"""

from agent.kube.client import load_api_client
from agent.kube.reconciler import KubeAgent

__all__ = ["KubeAgent", "load_api_client"]
