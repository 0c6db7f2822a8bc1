"""The agent on the Kubernetes side, in two wings the reconciler composes, and the operator's commands apart.

- `client`: loading the client, the API calls the package makes, error classification, backoff.
- `reconciler`: the thread that applies the node wing's plans and runs the devices wing (`KubeAgent`).
- `slots`: the ConfigMap of slots both cluster budgets share (nodes and devices).
- `pods`: the node's pods as the probes need them (UID, namespace, name, Volcano's placement), and `PodFeed`,
  the one seam by which they reach the probes and `/ready?pod=`.
- `node/`: taints, labels, conditions and Events on the agent's own Node, within the taint budget.
- `devices/`: one bad chip isolated alone (DRA DeviceTaintRules, MindCluster public faults), within the device budget.
- `ops/`: the operator's commands (`cleanup`, `fleet`, `uninstall`); the daemon never imports them.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.kube.client import load_api_client
    from agent.kube.reconciler import KubeAgent

__all__ = ["KubeAgent", "load_api_client"]


def __getattr__(name: str) -> Any:
    """The kubernetes client loads with the Kubernetes side only: `agent.kube.pods.PodFeed` is the daemon's
    from its start, Kubernetes or not."""
    if name == "KubeAgent":
        from agent.kube.reconciler import KubeAgent

        return KubeAgent
    if name == "load_api_client":
        from agent.kube.client import load_api_client

        return load_api_client
    raise AttributeError(name)
