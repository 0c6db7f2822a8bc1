"""The reconciler's device isolation: per-device DeviceTaintRules and public faults, the node taint where nothing
finer applies (agent.kube.devices.isolation decides; this applies it).

Each reconcile pass calls `prepare` before it plans the Node and `finish` after the Node was written:

- `prepare` finds what the cluster offers (DRA discovery, cached for `dra_recheck_seconds`; this node's
  ResourceSlices; the agent's own rules; its public-fault ConfigMap), decides each bad device's isolation, takes
  device budget slots, creates or updates rules and writes `occur` faults, and returns the Node's desired state
  with the finely isolated devices out of its taints. A rule or fault that cannot be written leaves its device on
  the node taint: an API error never leaves a bad device unisolated (fail closed).
- `finish` deletes the rules and writes the `recover` of faults no longer wanted, then gives their budget slots
  back: after the Node patch, so a device moving from its rule to the node taint is never without either.

Nothing is read while no device is bad and the agent owns nothing; a device API error never fails the pass (it is
counted in `nodehealth_kube_device_errors_total`, backs off on its own, and the devices fall back to the node).
Its backoffs, the device budget's retry and the rechecks run on the reconciler's monotonic clock (`tick`), which
no clock step moves; the wall clock (`clock`) only stamps what is written (budget records, public faults).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.client import Backoff, KubeApi, classify, short_error
from agent.kube.devices.acting import NOT_ACTED, Acting
from agent.kube.devices.acting import WHY as WHY_NOT_ACTED
from agent.kube.devices.dra import Discovery, RuleWriter, discover, own_rules, refreshed_rules
from agent.kube.devices.isolation import (
    Isolation,
    Mechanisms,
    active_faults,
    adjust_desired,
    as_fallback,
    decide,
    kept_isolations,
)
from agent.kube.devices.match import (
    DeviceRef,
    Published,
    Want,
    device_wants,
    held_categories,
    identities,
    node_label_value,
    same_spec,
)
from agent.kube.devices.match import published_devices as parse_published
from agent.kube.devices.publicfault import ActiveFault, FaultKey, PublicFaults
from agent.kube.devices.report import IsolatorView
from agent.kube.devices.seats import Seats
from agent.kube.node.policy import Desired
from agent.snapshot import Snapshot

log = logging.getLogger("agent.kube")
DEVICE_SUPPRESSED = "DeviceTaintSuppressedByBudget"


@dataclass
class Hooks:
    """What the isolator tells the reconciler: the writes it made (for the write counters and /status), Events."""

    wrote: Callable[[str, str], None]
    event: Callable[[str, str, bool], None]


@dataclass
class _Removals:
    rules: list[dict[str, Any]] = field(default_factory=list)
    recover: bool = False
    active: dict[FaultKey, ActiveFault] = field(default_factory=dict)
    fault_devices: set[str] = field(default_factory=set)
    keep_faults: set[FaultKey] = field(default_factory=set)
    keep_slots: frozenset[str] | None = None


class DeviceIsolator:
    def __init__(
        self,
        node: str,
        api: Callable[[], KubeApi],
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        rng: random.Random,
        hooks: Hooks,
    ) -> None:
        self.node = node
        self.node_label = node_label_value(node)
        self._api = api
        self._clock = clock
        self._monotonic = monotonic
        self._rng = rng
        self._hooks = hooks
        # The pass lock is held through a pass and its API calls; the view lock only while counters are read or
        # changed, so /status and /metrics never wait for the API.
        self._pass_lock = threading.Lock()
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.last_error = ""
        self.would_write: list[dict[str, Any]] = []
        self.isolations: tuple[Isolation, ...] = ()
        self._faults: PublicFaults | None = None  # kept across reloads: faults turned off are still recovered
        self._backoff = Backoff(1.0, 300.0, rng)
        self._seats = Seats(node, api, clock, rng, functools.partial(hooks.wrote, "device_budget"), self._error)
        self._reset()

    def _reset(self) -> None:
        self._discovery: Discovery | None = None
        self._slices: list[Published] | None = None
        self._slice_notes: list[str] = []
        self._slices_key: frozenset[DeviceRef] | None = None
        self._slices_at = 0.0
        self._rules: dict[str, dict[str, Any]] | None = None  # the agent's rules of this node, as last read
        self._rules_at = 0.0
        self._seats.reset()
        self._retry_at = 0.0
        self._removals: _Removals | None = None
        self._withheld: set[str] = set()
        self._acting = Acting()

    def reconfigure(self) -> None:
        with self._pass_lock:
            self._reset()

    # --- errors ------------------------------------------------------------------------------------

    def _error(self, exc: BaseException, what: str) -> str:
        kind = classify(exc)
        delay = self._backoff.next_delay()
        self._retry_at = self._monotonic() + delay
        with self._lock:
            self.errors[kind] += 1
            self.last_error = f"{what}: {kind}: {short_error(exc)}"
        log.warning("kubernetes: devices: %s; retrying in %.1fs", self.last_error, delay)
        return self.last_error

    # --- what the cluster offers ---------------------------------------------------------------------

    def _mechanisms(self, policy: KubernetesConfig, tick: float, wanted: frozenset[DeviceRef]) -> Mechanisms:
        """What the cluster offers, refreshed when due; on an API error (or while backing off from one) what was
        read before stands, so a transient error does not move isolated devices to the node taint and back."""
        pf = policy.mindcluster.public_fault
        base = Mechanisms(prefix=policy.key_prefix, node=self.node, node_label=self.node_label)
        offline = "the API is backing off" if tick < self._retry_at else ""
        if not offline:
            try:
                self._discover(policy, tick, bool(wanted))
                if self.node_label is not None:
                    self._load_faults(policy)
            except Exception as exc:  # noqa: BLE001 - what was read before stands
                offline = self._error(exc, "resource.k8s.io not read")
        loaded = self._faults is not None
        missing = "the public-fault ConfigMap is not read yet" if pf.enabled and not loaded else ""
        base = replace(base, public_fault=pf.enabled and loaded, public_fault_error=offline and missing)
        discovery = self._discovery
        if not policy.device_isolation:
            return replace(base, no_dra="kubernetes.device_isolation is off")
        if discovery is None:
            return replace(base, no_dra=offline)
        if discovery.rules is None or self.node_label is None:
            return replace(base, no_dra=discovery.why_not)
        if not offline:
            try:
                self._published(policy, discovery, tick, wanted)
            except Exception as exc:  # noqa: BLE001
                offline = self._error(exc, "ResourceSlices not read")
        if self._slices is None:
            return replace(base, no_dra=offline)
        return replace(base, rules_version=discovery.rules, published=self._slices)

    def _discover(self, policy: KubernetesConfig, tick: float, needed: bool) -> Discovery:
        recheck = policy.dra_recheck_seconds
        stale = self._discovery is None or (needed and tick - self._discovery.at > recheck)
        if stale:
            self._discovery = discover(self._api(), tick)
        assert self._discovery is not None
        version = self._discovery.rules
        if version is not None and self.node_label is not None:
            if self._rules is None:  # at start, or after a write whose outcome is not known: find them all
                self._rules = own_rules(self._api(), version, policy.key_prefix, self.node_label)
                self._rules_at = tick
            elif self._rules and tick - self._rules_at > recheck:  # read back by name: O(own rules), no list
                self._rules = refreshed_rules(self._api(), version, self._rules, policy.key_prefix, self.node_label)
                self._rules_at = tick
            self._acting.saw(self._rules.values())
        elif version is None:
            self._rules = {}
        return self._discovery

    def _published(
        self, policy: KubernetesConfig, discovery: Discovery, tick: float, wanted: frozenset[DeviceRef]
    ) -> None:
        """This node's published devices: read when a device to map appears, and again every recheck period."""
        if discovery.slices is None:
            self._slices = []
            return
        if not wanted:
            return
        fresh = tick - self._slices_at <= policy.dra_recheck_seconds
        if self._slices is None or not fresh or not wanted <= (self._slices_key or frozenset()):
            items = self._api().list_resource_slices(discovery.slices, self.node)
            self._slices, self._slice_notes = parse_published(items, self.node, policy.dra_drivers)
            self._slices_key, self._slices_at = wanted, tick

    def _load_faults(self, policy: KubernetesConfig) -> None:
        """This node's public-fault ConfigMap, read once while public faults are on. Turned off on a running
        agent, the faults it wrote are recovered (the reader stays); `node-health cleanup` recovers those of a
        run that is gone."""
        pf = policy.mindcluster.public_fault
        if self._faults is not None and self._faults.namespace == pf.namespace:
            return
        if not pf.enabled:
            return
        assert self.node_label is not None
        faults = PublicFaults(
            self._api(), self.node, self.node_label, pf.namespace, pf.sender, policy.key_prefix, self._clock
        )
        faults.load()
        self._faults = faults

    # --- one pass -------------------------------------------------------------------------------------

    def prepare(self, snapshot: Snapshot, desired: Desired, policy: KubernetesConfig, tick: float) -> Desired:
        with self._pass_lock:
            self.would_write = [] if policy.dry_run else self.would_write
            wants = device_wants(snapshot, policy)
            known = identities(snapshot.checks)
            held = held_categories(snapshot, policy)
            if not wants and not self._owns_anything() and self._discovery is not None:
                self.isolations, self._removals = (), None
                return adjust_desired(desired, snapshot, (), policy, {})
            mechanisms = self._mechanisms(policy, tick, frozenset(wants))
            isolations = decide(wants, known, mechanisms, policy) + self._kept(held, wants, policy)
            isolations = self._unacted(isolations, policy)
            isolations = self._budgeted(isolations, policy, tick)
            isolations = self._write_rules(isolations, policy, mechanisms, tick)
            isolations = self._write_faults(isolations, policy, held, tick)
            self._removals = self._plan_removals(isolations, policy, held)
            self._announce(isolations)
            self.isolations = tuple(isolations)
            counts = Counter(ref.category for ref in known)
            grant = self._seats.grant
            used = f"device budget: {grant.used} of {grant.limit} devices isolated" if grant else ""
            return adjust_desired(desired, snapshot, isolations, policy, counts, used)

    def _unacted(self, isolations: list[Isolation], policy: KubernetesConfig) -> list[Isolation]:
        """While the cluster is known not to act on rules, a rule is no isolation: its device goes to the fallback
        before the budget is asked (no slot taken and given back on every pass); rules already there stay, so the
        recheck can see the controller's status. With none left, the next write asks the cluster again."""
        if self._acting.known is not False:
            return isolations
        if not self._rules:
            self._acting.known = None
            return isolations
        return [
            replace(as_fallback(i, policy, WHY_NOT_ACTED, NOT_ACTED), rules=i.rules) if i.mechanism == "dra" else i
            for i in isolations
        ]

    def _owns_anything(self) -> bool:
        faults = self._faults.occurring() if self._faults is not None else {}
        return bool(self._rules) or bool(faults) or bool(self._seats.held)

    def _kept(self, held: frozenset[str], wants: Mapping[DeviceRef, Want], policy: KubernetesConfig) -> list[Isolation]:
        faults = self._faults_devices() if "npu" in held else []
        return kept_isolations((self._rules or {}).values(), faults, held, wants, policy.key_prefix)

    def _faults_devices(self) -> list[str]:
        return self._faults.isolated_devices() if self._faults is not None else []

    # --- the device budget (agent.kube.devices.seats) ------------------------------------------------

    def _budgeted(self, isolations: list[Isolation], policy: KubernetesConfig, tick: float) -> list[Isolation]:
        api_ok = tick >= self._retry_at
        present = self._present(policy)
        return self._seats.apply(isolations, policy, self._discovery, tick, api_ok, present, self.would_write)

    def _present(self, policy: KubernetesConfig) -> set[str]:
        """Devices a rule or fault of the agent's already isolates (they keep their slot, as a node already
        tainted keeps its node slot)."""
        names = {
            str((r["metadata"].get("annotations") or {}).get(f"{policy.key_prefix}/device", ""))
            for r in (self._rules or {}).values()
        }
        return (names | set(self._faults_devices())) - {""}

    # --- writes -----------------------------------------------------------------------------------------

    def _write_rules(
        self, isolations: list[Isolation], policy: KubernetesConfig, mechanisms: Mechanisms, tick: float
    ) -> list[Isolation]:
        version = mechanisms.rules_version
        if version is None or self.node_label is None:
            return isolations
        writer = RuleWriter(self._api(), version, policy.key_prefix, self.node_label)
        out = []
        for isolation in isolations:
            if isolation.mechanism != "dra" or isolation.want is None:
                out.append(isolation)
                continue
            out.append(self._ensure(writer, isolation, policy, tick))
        return out

    def _ensure(self, writer: RuleWriter, isolation: Isolation, policy: KubernetesConfig, tick: float) -> Isolation:
        """The device's rules written. A rule already stored keeps isolating the device whatever the write meets
        (a 409 retried within the pass and still lost, a backoff, an error): a reason change never moves a device
        to the node taint. A device without its rule falls back; so does one while the cluster does not act on
        rules (`acting`)."""
        rules = self._rules if self._rules is not None else {}
        for rule in isolation.rules:
            current = rules.get(rule.name)
            if policy.dry_run:
                if current is None or not same_spec(current, rule.spec):
                    self.would_write.append({"kind": "device_rule", "what": f"{rule.name}: {rule.spec['taint']}"})
                continue
            if tick < self._retry_at and (current is None or not same_spec(current, rule.spec)):
                if current is not None:
                    continue  # changed once the API is back; the stored rule isolates meanwhile
                return as_fallback(isolation, policy, "the API is backing off: rule not written", "write_failed")
            result = writer.ensure(isolation, rule, current)
            if result.error:
                self._error(result.exc or RuntimeError(result.error), f"DeviceTaintRule {rule.name}")
            if result.rule is None and (current is None or result.gone):
                self._rules = None  # read again: what is stored is not known
                return as_fallback(isolation, policy, f"DeviceTaintRule not written: {result.error}", "write_failed")
            stored = result.rule if result.rule is not None else current
            assert stored is not None
            rules[rule.name] = stored
            self._rules = rules
            if result.wrote:
                self._hooks.wrote("device_rule", f"{result.wrote} {rule.name} {rule.spec['taint']}")
        if policy.dry_run or not isolation.rules:
            return isolation
        why = self._acting.check(writer, [rule.name for rule in isolation.rules], rules)
        if why:
            return replace(as_fallback(isolation, policy, why, NOT_ACTED), rules=isolation.rules)
        return isolation

    def _write_faults(
        self, isolations: list[Isolation], policy: KubernetesConfig, held: frozenset[str], tick: float
    ) -> list[Isolation]:
        faults = self._faults
        chosen = [i for i in isolations if i.mechanism == "public_fault" and i.want is not None]
        if faults is None:
            return isolations
        active = active_faults(chosen)
        # Recoveries wait for finish(): every fault occurring now stays, and so do the devices it names.
        devices = {i.device for i in isolations if i.mechanism == "public_fault"} | set(faults.isolated_devices())
        keep = set(faults.occurring())
        if policy.dry_run:
            if active.keys() - keep:
                self.would_write.append({"kind": "public_fault", "what": f"occur {sorted(active)}"})
            return isolations
        try:
            if tick < self._retry_at and active.keys() - keep:
                raise RuntimeError("the API is backing off")
            what = faults.write(active, keep, devices)
        except Exception as exc:  # noqa: BLE001 - the chips fall back to the node taint
            why = self._error(exc, f"public fault {faults.namespace}/{faults.name}")
            return [as_fallback(i, policy, why, "write_failed") if i in chosen else i for i in isolations]
        if what:
            self._hooks.wrote("public_fault", what)
        return isolations

    def _plan_removals(self, isolations: list[Isolation], policy: KubernetesConfig, held: frozenset[str]) -> _Removals:
        # A rule the cluster does not act on yet stays (its device is on the node taint meanwhile): deleted and
        # made again on every pass, it would never live long enough to be acted on.
        wanted_rules = {
            rule.name for i in isolations if i.mechanism == "dra" or i.why_code == NOT_ACTED for rule in i.rules
        }
        removals = _Removals(rules=[r for n, r in (self._rules or {}).items() if n not in wanted_rules])
        if self._faults is not None:
            chosen = [i for i in isolations if i.mechanism == "public_fault" and i.want is not None]
            removals.active = active_faults(chosen)
            removals.keep_faults = set(self._faults.occurring()) if "npu" in held else set()
            removals.fault_devices = {i.device for i in isolations if i.mechanism == "public_fault"}
            removals.recover = bool(set(self._faults.occurring()) - removals.active.keys() - removals.keep_faults)
        fine = frozenset(i.device for i in isolations if i.fine)
        slots = self._seats.held
        removals.keep_slots = fine if slots and slots - fine else None
        return removals

    def finish(self, policy: KubernetesConfig, tick: float) -> None:
        """What prepare planned to take away: rules deleted, faults recovered, then their slots given back."""
        with self._pass_lock:
            removals, self._removals = self._removals, None
            if removals is None or tick < self._retry_at:
                return
            if policy.dry_run:
                for rule in removals.rules:
                    self.would_write.append({"kind": "device_rule", "what": f"delete {rule['metadata']['name']}"})
                return
            clean = self._delete_rules(removals, policy) and self._recover(removals)
            if clean and removals.keep_slots is not None:
                self._seats.release(policy, removals.keep_slots)
            if clean:
                self._backoff.reset()

    def _delete_rules(self, removals: _Removals, policy: KubernetesConfig) -> bool:
        if not removals.rules or self._discovery is None or self._discovery.rules is None:
            return True
        assert self.node_label is not None
        writer = RuleWriter(self._api(), self._discovery.rules, policy.key_prefix, self.node_label)
        for rule in removals.rules:
            name = rule["metadata"]["name"]
            error = writer.delete(rule)
            if error is not None:
                self._error(error, f"DeviceTaintRule {name} not deleted")
                self._rules = None
                return False
            (self._rules or {}).pop(name, None)
            self._hooks.wrote("device_rule", f"deleted {name}")
        return True

    def _recover(self, removals: _Removals) -> bool:
        if not removals.recover or self._faults is None:
            return True
        try:
            what = self._faults.write(removals.active, removals.keep_faults, removals.fault_devices)
        except Exception as exc:  # noqa: BLE001 - the faults stay until a later pass recovers them
            self._error(exc, f"public fault {self._faults.namespace}/{self._faults.name} not recovered")
            return False
        if what:
            self._hooks.wrote("public_fault", what)
        return True

    def view(self) -> IsolatorView:
        with self._lock:
            return IsolatorView(
                self._discovery,
                tuple(self._slice_notes),
                self._faults,
                self.isolations,
                self._seats.held,
                self._seats.grant,
                tuple(self.would_write),
                Counter(self.errors),
                self.last_error,
            )

    def _announce(self, isolations: list[Isolation]) -> None:
        """One Event per pass in which devices turn withheld (a fleet-wide false positive must not add one Event per
        chip to the incident)."""
        withheld = {i.device: i for i in isolations if i.mechanism == "withheld"}
        new = sorted(withheld.keys() - self._withheld)
        if new:
            named = ", ".join(f"{device} ({withheld[device].reason})" for device in new)
            self._hooks.event(DEVICE_SUPPRESSED, f"not isolated: {named}: {withheld[new[0]].why}", True)
        self._withheld = set(withheld)
