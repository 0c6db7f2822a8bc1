"""`node-health cleanup`, for devices: the agents' DeviceTaintRules deleted, their public faults recovered, their
device budget slots given back; nothing that is not the agents' is touched.

Rules are found by the agents' labels (of one node, or of every node) and their labels checked again before each
delete, which carries the rule's resourceVersion as a precondition. A public fault is cleared by its `recover`,
not by deleting the ConfigMap (ClusterD keeps a fault whose ConfigMap is gone): each of the agents' ConfigMaps is
rewritten with every fault recovered, and left in place. They are looked for whether public faults are on or off
in the config now (faults written while they were on outlive the setting); while they are off, a list refused
with 403 or 404 (the public-fault component, with the cleanup's Role, not installed) is reported as not checked,
not as an error. A line is printed only for what there was to do, or could not be checked.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.config import Config
from agent.kube.client import KubeApi, agent_namespace, is_status, short_error
from agent.kube.devices.budget import DeviceBudget
from agent.kube.devices.dra import discover, own_rules
from agent.kube.devices.match import node_label_value
from agent.kube.devices.publicfault import occurring_count, own_selector, recover_all


def _rules(api: KubeApi, prefix: str, label: str | None, dry_run: bool, out: Callable[[str], None], now: float) -> bool:
    try:
        version = discover(api, now).rules
        if version is None:
            return True
        mine = own_rules(api, version, prefix, label)
    except Exception as exc:  # noqa: BLE001 - reported, and the exit status says it
        out(f"devicetaintrules: not read: {short_error(exc)}")
        return False
    removed, ok = [], True
    for name, rule in sorted(mine.items()):
        if dry_run:
            removed.append(name)
            continue
        try:
            api.delete_device_taint_rule(version, name, str(rule["metadata"].get("resourceVersion")))
        except Exception as exc:  # noqa: BLE001 - the others are still removed
            out(f"devicetaintrule {name}: not removed: {short_error(exc)}")
            ok = False
            continue
        removed.append(name)
    if removed:
        out(f"devicetaintrules: {'would remove' if dry_run else 'removed'} {len(removed)} ({', '.join(removed)})")
    return ok


def _faults(
    api: KubeApi,
    config: Config,
    label: str | None,
    dry_run: bool,
    out: Callable[[str], None],
    clock: Callable[[], float],
) -> bool:
    policy = config.kubernetes
    settings = policy.mindcluster.public_fault
    try:
        found = api.list_configmaps(settings.namespace, own_selector(policy.key_prefix, label))
    except Exception as exc:  # noqa: BLE001
        if not settings.enabled and is_status(exc, 403, 404):
            why = f"public faults are off and their ConfigMaps cannot be listed ({short_error(exc)})"
            out(f"public faults {settings.namespace}: not checked: {why}")
            return True
        out(f"public faults {settings.namespace}: not read: {short_error(exc)}")
        return False
    ok = True
    for configmap in sorted(found, key=lambda c: c["metadata"]["name"]):
        where = f"public faults {settings.namespace}/{configmap['metadata']['name']}"
        try:
            if dry_run:
                count = occurring_count(configmap)
                if count:
                    out(f"{where}: would recover {count} fault(s)")
                continue
            count = recover_all(api, configmap, clock)
            if count:
                out(f"{where}: recovered {count} fault(s)")
        except Exception as exc:  # noqa: BLE001
            out(f"{where}: not recovered: {short_error(exc)}")
            ok = False
    return ok


def _slots(
    api: KubeApi,
    config: Config,
    nodes: list[str] | None,
    dry_run: bool,
    out: Callable[[str], None],
    clock: Callable[[], float],
) -> bool:
    policy = config.kubernetes
    namespace = agent_namespace(policy)
    where = f"device budget {namespace}/{policy.device_budget_configmap}"
    budget = DeviceBudget(
        api, "", namespace, policy.device_budget_configmap, policy.key_prefix, clock, lambda what: None
    )
    try:
        gone = budget.release_nodes(nodes, "node-health cleanup", dry_run)
    except Exception as exc:  # noqa: BLE001
        out(f"{where}: slots not released: {short_error(exc)}")
        return False
    if gone:
        verb = "would release" if dry_run else "released"
        out(f"{where}: {verb} {sum(gone.values())} device slot(s) ({', '.join(sorted(gone))})")
    return True


def clean_devices(
    api: KubeApi,
    config: Config,
    node: str | None,
    release: list[str] | None,
    dry_run: bool,
    out: Callable[[str], None],
    clock: Callable[[], float],
) -> bool:
    """node None: every node's. release: the nodes whose device slots go (None: every slot). False when an API
    error left something undone (the lines say what)."""
    prefix = config.kubernetes.key_prefix
    label = node_label_value(node) if node is not None else None
    if node is not None and label is None:
        out(f"node {node}: its name cannot be a label value: its devicetaintrules and public faults are not listed")
        return _slots(api, config, release, dry_run, out, clock)
    rules = _rules(api, prefix, label, dry_run, out, clock())
    faults = _faults(api, config, label, dry_run, out, clock)
    # The slots go only once what they stand for is gone.
    return rules and faults and _slots(api, config, release, dry_run, out, clock)
