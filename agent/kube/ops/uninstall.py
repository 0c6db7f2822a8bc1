"""`node-health uninstall`: the whole uninstall in one step (`kubectl apply -k deploy/uninstall` runs it as a Job).

In this order, each step only once the one before has succeeded:

1. the agents stop: the install's DaemonSets (labelled app.kubernetes.io/name=node-health, in the install's
   namespace) are deleted, and it waits until their pods are gone. A running agent puts its taints back at its next
   pass, so nothing is cleaned before. A pod on a node that is not Ready does not hold it up: no kubelet there
   finishes its deletion, so it is deleted at once (its token dies with it: its agent cannot write if the node
   comes back), and its node is cleaned all the same;
2. `cleanup --all-nodes` (agent.kube.ops.cleanup): every node's taints, labels, annotation and conditions of the agent,
   its DeviceTaintRules, its public faults recovered, the budget slots released;
3. the budget ConfigMaps deleted;
4. the install's cluster-scoped objects and its Roles and RoleBindings in any namespace deleted, found by the
   install's label (the Job's own excepted: app.kubernetes.io/component=uninstall);
5. the Job's own ClusterRole and ClusterRoleBinding handed to the namespace (an ownerReference: the garbage
   collector deletes them once the namespace is gone), then the namespace deleted, with everything in it, this
   Job included.

A step that fails ends the run with exit 1 before the next one: the Job runs it again (every step can be redone),
and what is left is still there to read. Nothing else ever cleans up: a rolling update, a restart or a
`kubectl delete pod` of an agent leaves its node's taints where they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from agent.config import Config
from agent.kube.client import KubeApi, agent_namespace, own_namespace, run_command, short_error
from agent.kube.ops.cleanup import EXIT_DONE, cleanup

EXIT_FAILED = 1
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTALL = "node-health"
OWN_COMPONENT = "uninstall"
INSTALL_SELECTOR = f"{NAME_LABEL}={INSTALL}"
# The DaemonSet's pod template labels (deploy/daemonset.yaml): found also when an earlier run deleted the DaemonSet.
AGENT_PODS = f"{NAME_LABEL}={INSTALL},{COMPONENT_LABEL}=agent"
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Kind:
    name: str
    group_version: str  # "v1" for the core group
    resource: str
    namespaced: bool

    def path(self, namespace: str = "", name: str = "") -> str:
        path = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        if self.namespaced and namespace:
            path += f"/namespaces/{quote(namespace, safe='')}"
        path += f"/{self.resource}"
        return f"{path}/{quote(name, safe='')}" if name else path


DAEMONSETS = Kind("daemonset", "apps/v1", "daemonsets", True)
PODS = Kind("pod", "v1", "pods", True)
CONFIGMAPS = Kind("configmap", "v1", "configmaps", True)
NAMESPACES = Kind("namespace", "v1", "namespaces", False)
# What the install puts outside its namespace (deploy/, its components, examples/cleanup-job.yaml and
# deploy/prometheus; tests/kube/ops/test_kube_uninstall.py checks every kind they hold is here or in the namespace).
# Bindings go before what they bind.
INSTALLED = (
    Kind(
        "validatingadmissionpolicybinding",
        "admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
    Kind("validatingadmissionpolicy", "admissionregistration.k8s.io/v1", "validatingadmissionpolicies", False),
    # deploy/components/preflight-injection (beta in 1.34 to 1.36: absent where the API is off, which is no error)
    Kind(
        "mutatingadmissionpolicybinding",
        "admissionregistration.k8s.io/v1beta1",
        "mutatingadmissionpolicybindings",
        False,
    ),
    Kind("mutatingadmissionpolicy", "admissionregistration.k8s.io/v1beta1", "mutatingadmissionpolicies", False),
    Kind("clusterrolebinding", "rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    Kind("clusterrole", "rbac.authorization.k8s.io/v1", "clusterroles", False),
    Kind("rolebinding", "rbac.authorization.k8s.io/v1", "rolebindings", True),
    Kind("role", "rbac.authorization.k8s.io/v1", "roles", True),
    # deploy/prometheus, where the Prometheus Operator serves them
    Kind("podmonitor", "monitoring.coreos.com/v1", "podmonitors", True),
    Kind("prometheusrule", "monitoring.coreos.com/v1", "prometheusrules", True),
)

Out = Callable[[str], None]
Owned = list[tuple[Kind, dict[str, Any]]]


def _where(kind: Kind, item: dict[str, Any]) -> str:
    meta = item["metadata"]
    return f"{kind.name} {meta['namespace']}/{meta['name']}" if meta.get("namespace") else f"{kind.name} {meta['name']}"


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def stop_agents(
    api: KubeApi,
    namespace: str,
    wait_seconds: float,
    dry_run: bool,
    out: Out,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Step 1: True once no agent pod runs on a Ready node."""
    for daemonset in api.list_objects(DAEMONSETS.path(namespace), INSTALL_SELECTOR) or []:
        where = _where(DAEMONSETS, daemonset)
        if dry_run:
            out(f"{where}: would delete")
            continue
        if api.delete_object(DAEMONSETS.path(namespace, daemonset["metadata"]["name"]), daemonset["metadata"]["uid"]):
            out(f"{where}: deleted")
    if dry_run:
        return True
    deadline = monotonic() + wait_seconds
    waited = False
    while True:
        pods = api.list_objects(PODS.path(namespace), AGENT_PODS) or []
        ready = _ready_nodes(api) if pods else set()
        running = sorted((p["metadata"]["name"], (p.get("spec") or {}).get("nodeName", "")) for p in pods)
        blocking = [(pod, node) for pod, node in running if node in ready]
        if not blocking:
            _force_delete(api, namespace, pods, out)
            out("agents: stopped")
            return True
        if monotonic() >= deadline:
            listed = ", ".join(f"{pod} on {node}" for pod, node in blocking)
            out(f"agents: {len(blocking)} still running after {wait_seconds:g}s ({listed}); nothing cleaned yet")
            return False
        if not waited:
            out(f"agents: waiting for {len(blocking)} pod(s) to stop")
            waited = True
        sleep(POLL_SECONDS)


def _force_delete(api: KubeApi, namespace: str, pods: list[dict[str, Any]], out: Out) -> None:
    """The pods left are on nodes that are not Ready, where no kubelet finishes their deletion: without this the
    namespace would stay Terminating. Their agents cannot write: a pod's token dies with the pod object."""
    if not pods:
        return
    for pod in pods:
        meta = pod["metadata"]
        api.delete_object(PODS.path(namespace, meta["name"]), meta["uid"], grace_seconds=0)
    listed = ", ".join(f"{p['metadata']['name']} on {(p.get('spec') or {}).get('nodeName') or 'no node'}" for p in pods)
    out(f"agents: {len(pods)} pod(s) on nodes that are not Ready deleted at once: {listed}")


def _ready_nodes(api: KubeApi) -> set[str]:
    return {n["metadata"]["name"] for n in api.list_nodes() if _ready(n)}


def delete_budgets(api: KubeApi, config: Config, dry_run: bool, out: Out) -> bool:
    """Step 3: the taint and device budget ConfigMaps (their slots released by step 2)."""
    policy = config.kubernetes
    namespace = agent_namespace(policy)
    ok = True
    for name in (policy.budget_configmap, policy.device_budget_configmap):
        where = f"configmap {namespace}/{name}"
        try:
            found = api.get_configmap_metadata(namespace, name)
            if found is None:
                continue
            if dry_run:
                out(f"{where}: would delete")
            elif api.delete_object(CONFIGMAPS.path(namespace, name), found["uid"]):
                out(f"{where}: deleted")
        except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
            out(f"{where}: not deleted: {short_error(exc)}")
            ok = False
    return ok


def delete_installed(api: KubeApi, namespace: str, dry_run: bool, out: Out) -> tuple[bool, Owned]:
    """Step 4: the install's objects outside its namespace (those in it go with it). Also returns the uninstaller's
    own, left for step 5."""
    own: Owned = []
    ok = True
    for kind in INSTALLED:
        try:
            found = api.list_objects(kind.path(), INSTALL_SELECTOR)
        except Exception as exc:  # noqa: BLE001
            out(f"{kind.resource}: not read: {short_error(exc)}")
            ok = False
            continue
        for item in sorted(found or [], key=lambda i: (i["metadata"].get("namespace", ""), i["metadata"]["name"])):
            meta = item["metadata"]
            if (meta.get("labels") or {}).get(COMPONENT_LABEL) == OWN_COMPONENT:
                own.append((kind, item))
                continue
            if meta.get("namespace") == namespace:
                continue
            where = _where(kind, item)
            if dry_run:
                out(f"{where}: would delete")
                continue
            try:
                if api.delete_object(kind.path(meta.get("namespace", ""), meta["name"]), meta["uid"]):
                    out(f"{where}: deleted")
            except Exception as exc:  # noqa: BLE001 - the others are still deleted
                out(f"{where}: not deleted: {short_error(exc)}")
                ok = False
    return ok, own


def delete_namespace(api: KubeApi, namespace: str, own: Owned, dry_run: bool, out: Out) -> bool:
    """Step 5: the namespace, once the uninstaller's cluster-scoped objects are the namespace's dependents."""
    where = f"namespace {namespace}"
    found = api.get_object(NAMESPACES.path(name=namespace))
    if found is None:
        out(f"{where}: already gone")
        return True
    meta = found["metadata"]
    if (meta.get("labels") or {}).get(NAME_LABEL) != INSTALL:
        out(
            f"{where}: not node-health's own (no label {INSTALL_SELECTOR}): it and what the install put in it are "
            f"left in place (kubectl -n {namespace} delete all,configmaps,serviceaccounts,roles,rolebindings -l "
            f"{INSTALL_SELECTOR})"
        )
        return True
    owner = {"apiVersion": "v1", "kind": "Namespace", "name": namespace, "uid": meta["uid"]}
    handed = [(kind, item) for kind, item in own if not kind.namespaced]
    for kind, item in handed:
        if dry_run:
            continue
        patch = {"metadata": {"ownerReferences": [owner], "resourceVersion": item["metadata"]["resourceVersion"]}}
        api.merge_patch_object(kind.path(name=item["metadata"]["name"]), patch)
    names = ", ".join(_where(kind, item) for kind, item in handed)
    if dry_run:
        out(f"{where}: would delete, with everything in it" + (f"; then {names}" if names else ""))
        return True
    api.delete_object(NAMESPACES.path(name=namespace), meta["uid"])
    out(f"{where}: deleted, with everything in it (this uninstaller too)" + (f"; then {names}" if names else ""))
    return True


def uninstall(
    api: KubeApi,
    config: Config,
    namespace: str,
    wait_seconds: float,
    dry_run: bool,
    out: Out,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """EXIT_DONE, or EXIT_FAILED when a step did not finish (the lines say which; run it again)."""
    try:
        if not stop_agents(api, namespace, wait_seconds, dry_run, out, monotonic, sleep):
            return EXIT_FAILED
        if cleanup(api, config, None, dry_run, out) != EXIT_DONE:
            return EXIT_FAILED
        if not delete_budgets(api, config, dry_run, out):
            return EXIT_FAILED
        done, own = delete_installed(api, namespace, dry_run, out)
        if not done:
            return EXIT_FAILED
        delete_namespace(api, namespace, own, dry_run, out)
    except Exception as exc:  # noqa: BLE001 - one line, and the Job runs it again
        out(f"uninstall: stopped: {short_error(exc)}")
        return EXIT_FAILED
    return EXIT_DONE


def main_uninstall(config: Config, namespace: str | None, wait_seconds: float, dry_run: bool) -> int:
    """The CLI: the install's namespace is --namespace, else this pod's own."""
    where = namespace or own_namespace()
    return run_command(config, "uninstall", lambda api: uninstall(api, config, where, wait_seconds, dry_run, print))
