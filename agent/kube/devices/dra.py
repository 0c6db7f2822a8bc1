"""DRA on the API side: which resource.k8s.io version serves DeviceTaintRules, this node's ResourceSlices, and the
agent's own rules, written so that nothing but its own rules is ever touched.

- Discovery asks `/apis/resource.k8s.io/v1`, then `v1beta2` (1.36 serves DeviceTaintRules there, with the
  DRADeviceTaintRules gate on): at most two GETs, cached by the isolator for `dra_recheck_seconds`.
- Slices: one list with the field selector `spec.nodeName=<node>`.
- Rules: listed by the agent's labels with this node's name at start, later read back by name (`dra_recheck_seconds`);
  created with `fieldValidation=Strict`; changed by a
  JSON merge patch carrying the rule's resourceVersion (and its whole spec, so a selector someone narrowed or
  widened is put back); deleted with the resourceVersion as a precondition. A create answered 409 (the name is
  taken) reads the rule: one carrying the agent's labels for this node is adopted, any other is left alone and the
  device falls back to the node taint. `client.check_device_taint_rule` refuses any rule whose selector does not
  name driver, pool and device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeApi, is_status, short_error
from agent.kube.devices.isolation import Isolation, RuleSpec
from agent.kube.devices.match import is_own_rule, own_rules_selector, rule_body, rule_labels, same_spec

DRA_VERSIONS = ("v1", "v1beta2")
WRITE_ATTEMPTS = 3


@dataclass(frozen=True)
class Discovery:
    rules: str | None  # the version serving devicetaintrules
    slices: str | None  # the version serving resourceslices
    at: float  # when it was read, on the caller's clock (the isolator's: monotonic)

    @property
    def why_not(self) -> str:
        if self.rules is not None:
            return ""
        if self.slices is None:
            return "the cluster serves no resource.k8s.io (no DRA)"
        return "the cluster serves no DeviceTaintRules (resource.k8s.io v1, or v1beta2 with DRADeviceTaintRules)"


def discover(api: KubeApi, now: float) -> Discovery:
    rules = slices = None
    for version in DRA_VERSIONS:
        document = api.get_resource_api(version) or {}
        names = {str(r.get("name")) for r in document.get("resources") or [] if isinstance(r, Mapping)}
        if rules is None and "devicetaintrules" in names:
            rules = version
        if slices is None and "resourceslices" in names:
            slices = version
        if rules is not None and slices is not None:
            break
    return Discovery(rules, slices, now)


def own_rules(api: KubeApi, version: str, prefix: str, node_label: str | None) -> dict[str, dict[str, Any]]:
    """The agents' rules of this node (node_label None: of every node), by name: the label selector, then the
    labels checked again."""
    items = api.list_device_taint_rules(version, own_rules_selector(prefix, node_label))
    return {r["metadata"]["name"]: r for r in items if is_own_rule(r, prefix, node_label)}


def refreshed_rules(
    api: KubeApi, version: str, known: dict[str, dict[str, Any]], prefix: str, node_label: str
) -> dict[str, dict[str, Any]]:
    """The agent's known rules read again by name (a GET each: what the periodic check costs is the node's own
    rules, not a list of every rule of the cluster); one deleted or no longer ours is dropped (and made again)."""
    out = {}
    for name in known:
        rule = api.get_device_taint_rule(version, name)
        if rule is not None and is_own_rule(rule, prefix, node_label):
            out[name] = rule
    return out


@dataclass(frozen=True)
class RuleResult:
    name: str
    rule: dict[str, Any] | None  # as stored after the write; None: not written
    wrote: str = ""  # "created", "updated", "" (already as wanted)
    error: str = ""
    exc: BaseException | None = None  # the API error behind `error`, for its kind
    # With `error` set, the rule still stored (a write that kept meeting 409s): it isolates the device as before.
    gone: bool = False  # the rule was deleted, or is not ours, while it was written: it isolates nothing


class RuleWriter:
    """Creates and updates one node's rules; what it wrote goes to `on_write`."""

    def __init__(self, api: KubeApi, version: str, prefix: str, node_label: str) -> None:
        self.api = api
        self.version = version
        self.prefix = prefix
        self.node_label = node_label

    def ensure(self, isolation: Isolation, rule: RuleSpec, current: dict[str, Any] | None) -> RuleResult:
        labels = rule_labels(self.prefix, self.node_label, isolation.ref.category)
        if current is not None and same_spec(current, rule.spec):
            return RuleResult(rule.name, current)
        try:
            if current is None:
                return self._create(isolation, rule, labels)
            return self._update(rule, current)
        except Exception as exc:  # noqa: BLE001 - the device falls back to the node taint and the error is reported
            return RuleResult(rule.name, None, error=short_error(exc), exc=exc)

    def _create(self, isolation: Isolation, rule: RuleSpec, labels: Mapping[str, str]) -> RuleResult:
        body = rule_body(self.version, rule.name, labels, isolation.device, self.prefix, rule.spec)
        try:
            return RuleResult(rule.name, self.api.create_device_taint_rule(self.version, body), "created")
        except Exception as exc:
            if not is_status(exc, 409):
                raise
        existing = self.api.get_device_taint_rule(self.version, rule.name)
        if existing is None:  # deleted in between: the next pass creates it
            return RuleResult(
                rule.name, None, error=f"DeviceTaintRule {rule.name} changed while it was written", gone=True
            )
        if not is_own_rule(existing, self.prefix, self.node_label):
            error = f"a DeviceTaintRule named {rule.name} exists and is not ours"
            return RuleResult(rule.name, None, error=error, gone=True)
        return self._update(rule, existing)

    def _update(self, rule: RuleSpec, current: Mapping[str, Any]) -> RuleResult:
        """A merge patch carrying the resourceVersion read; a 409 (the device-taint-eviction controller writes each
        rule's status right after every create and spec change, so what was read is often stale) reads the rule
        again and patches that, up to WRITE_ATTEMPTS times within the pass."""
        for _ in range(WRITE_ATTEMPTS):
            if same_spec(current, rule.spec):
                return RuleResult(rule.name, dict(current))
            body = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}, "spec": dict(rule.spec)}
            try:
                return RuleResult(rule.name, self.api.patch_device_taint_rule(self.version, rule.name, body), "updated")
            except Exception as exc:
                if not is_status(exc, 409):
                    raise
                conflict = exc
            fresh = self.api.get_device_taint_rule(self.version, rule.name)
            if fresh is None or not is_own_rule(fresh, self.prefix, self.node_label):
                error = f"DeviceTaintRule {rule.name} changed while it was written"
                return RuleResult(rule.name, None, error=error, gone=True)
            current = fresh
        return RuleResult(rule.name, dict(current), error=short_error(conflict), exc=conflict)

    def delete(self, rule: Mapping[str, Any]) -> BaseException | None:
        """None when the rule is gone (or no longer ours); else the error. A 409 (it changed since it was read: the
        controller's status) reads it again and deletes that, up to WRITE_ATTEMPTS times within the pass."""
        metadata = rule["metadata"]
        name = metadata["name"]
        version = str(metadata.get("resourceVersion"))
        error: BaseException | None = None
        for _ in range(WRITE_ATTEMPTS):
            try:
                self.api.delete_device_taint_rule(self.version, name, version)
                return None
            except Exception as exc:  # noqa: BLE001 - kept, and tried again on the next pass
                if not is_status(exc, 409):
                    return exc
                error = exc
            try:
                fresh = self.api.get_device_taint_rule(self.version, name)
            except Exception as exc:  # noqa: BLE001
                return exc
            if fresh is None or not is_own_rule(fresh, self.prefix, self.node_label):
                return None
            version = str(fresh["metadata"].get("resourceVersion"))
        return error


def acted_on(rule: Mapping[str, Any] | None) -> bool:
    """Whether the cluster shows it acts on DeviceTaintRules: the device-taint-eviction controller (running, with
    the device-taint gates on) writes a rule's status (its conditions) after the rule is created; a cluster that
    serves rules but ignores them (1.36 with DRADeviceTaintRules off in the controller-manager) never does."""
    status = rule.get("status") if isinstance(rule, Mapping) else None
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    return bool(conditions) and isinstance(conditions, list)
