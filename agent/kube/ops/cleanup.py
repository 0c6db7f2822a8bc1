"""`node-health cleanup`: take off the Nodes what the agent put there, before it is uninstalled.

Removes taints and labels under `<key_prefix>/` and the agent's conditions (nothing else: every other taint,
label and condition stays), each write guarded by the Node's resourceVersion and redone on 409, then gives
back the budget slots of the nodes it cleaned; then the agents' DeviceTaintRules and public faults
(agent.kube.devices.cleanup). Run it after the DaemonSet is gone (a running agent would put
its taints back at its next heartbeat). Prints one line per node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.config import Config, KubernetesConfig
from agent.kube.client import KubeApi, agent_namespace, is_status, run_command, short_error
from agent.kube.devices.cleanup import clean_devices
from agent.kube.node.budget import TaintBudget
from agent.kube.node.plan import plan_cleanup

EXIT_DONE, EXIT_API_ERROR = 0, 1


def clean_node(api: KubeApi, node: dict[str, Any], policy: KubernetesConfig, dry_run: bool) -> str:
    """One node: its line of output. Raises on an API error other than a conflict it could redo."""
    name = node["metadata"]["name"]
    removed: list[str] = []
    for attempt in range(policy.conflict_retries + 1):
        plan = plan_cleanup(node, policy.key_prefix)
        if not plan.removed:
            break
        if dry_run:
            return f"node {name}: would remove {', '.join(plan.removed)}"
        try:
            if plan.node_patch is not None:
                node = api.patch_node(name, plan.node_patch)
            if plan.status_patch is not None:
                version = {"resourceVersion": node["metadata"].get("resourceVersion")}
                api.patch_node_status(name, {**plan.status_patch, "metadata": version})
        except Exception as exc:
            if not is_status(exc, 409) or attempt == policy.conflict_retries:
                raise
            node = api.get_node(name)  # another controller wrote: plan again on its version
            continue
        removed.extend(plan.removed)
        break
    if not removed:
        return f"node {name}: nothing to remove"
    return f"node {name}: removed {', '.join(dict.fromkeys(removed))}"


def cleanup(
    api: KubeApi,
    config: Config,
    node: str | None,
    dry_run: bool,
    out: Callable[[str], None],
    clock: Callable[[], float] = time.time,
) -> int:
    """node None: every node. EXIT_DONE, or EXIT_API_ERROR when an API error left something undone."""
    policy = config.kubernetes
    try:
        targets = api.list_nodes() if node is None else [api.get_node(node)]
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
        out(f"{'nodes' if node is None else 'node ' + node}: {short_error(exc)}")
        return EXIT_API_ERROR
    failed: list[str] = []
    cleaned: list[str] = []
    for target in targets:
        name = target["metadata"]["name"]
        try:
            out(clean_node(api, target, policy, dry_run))
            cleaned.append(name)
        except Exception as exc:  # noqa: BLE001 - the other nodes are still cleaned
            out(f"node {name}: not cleaned: {short_error(exc)}")
            failed.append(name)
    # Every node cleaned: every slot goes (nodes gone since included). Otherwise only the cleaned nodes' slots.
    release = None if node is None and not failed else cleaned
    if not _release(api, policy, release, dry_run, out, clock):
        return EXIT_API_ERROR
    if not clean_devices(api, config, node, release, dry_run, out, clock):
        return EXIT_API_ERROR
    return EXIT_API_ERROR if failed else EXIT_DONE


def _release(
    api: KubeApi,
    policy: KubernetesConfig,
    nodes: list[str] | None,
    dry_run: bool,
    out: Callable[[str], None],
    clock: Callable[[], float],
) -> bool:
    namespace = agent_namespace(policy)
    where = f"budget {namespace}/{policy.budget_configmap}"
    budget = TaintBudget(api, "", namespace, policy.budget_configmap, policy.key_prefix, clock, lambda what: None)
    try:
        gone = budget.release_nodes(nodes, "node-health cleanup", dry_run)
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
        out(f"{where}: slots not released: {short_error(exc)}")
        return False
    verb = "would release" if dry_run else "released"
    out(f"{where}: {verb} {len(gone)} slot(s)" + (f" ({', '.join(gone)})" if gone else ""))
    return True


def main_cleanup(config: Config, node: str | None, all_nodes: bool, dry_run: bool) -> int:
    """The CLI: --node NAME, --all-nodes, or (neither) this node."""
    target = None if all_nodes else (node or config.resolved_node_name)
    return run_command(config, "cleanup", lambda api: cleanup(api, config, target, dry_run, print))
