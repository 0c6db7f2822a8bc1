"""The isolator's device budget seats: which finely isolated devices (a DeviceTaintRule, a public fault) hold a slot
of the fleet's device budget (agent.kube.devices.budget), and what becomes of those that cannot have one.

- `apply` asks the budget for a slot per finely isolated device not holding one yet (not while the API backs off,
  nor while a refusal's backoff runs: 60 s to 300 s), and turns a device without a slot `withheld` (the budget is
  spent, being counted, or counts no device) unless a rule or fault of the agent already isolates it (`present`:
  it keeps its slot, as a tainted node keeps its node slot). The budget not read sends the devices without a
  present isolation to the fallback (`budget_error`): fail closed. In dry-run it says what it would take.
- `release` gives back the slots of devices no longer finely isolated, after their rules and faults are gone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from agent.config import KubernetesConfig
from agent.kube.client import Backoff, KubeApi, agent_namespace
from agent.kube.devices.budget import DeviceBudget, DeviceBudgetSettings, DeviceGrant
from agent.kube.devices.dra import Discovery
from agent.kube.devices.isolation import Isolation, as_fallback


class Seats:
    def __init__(
        self,
        node: str,
        api: Callable[[], KubeApi],
        clock: Callable[[], float],
        rng: random.Random,
        wrote: Callable[[str], None],
        error: Callable[[BaseException, str], str],
    ) -> None:
        self._node = node
        self._api = api
        self._clock = clock
        self._wrote = wrote
        self._error = error
        self._backoff = Backoff(60.0, 300.0, rng)
        self._budget_obj: DeviceBudget | None = None
        self._budget_at: tuple[KubeApi, str, str, str] | None = None
        self.grant: DeviceGrant | None = None
        self.reset()

    def reset(self) -> None:
        self._denied = False
        self.held: frozenset[str] | None = None  # slots held (None: not asked since start)
        self._retry_at = 0.0

    def _budget(self, policy: KubernetesConfig) -> DeviceBudget:
        """One per ConfigMap, as the reconciler keeps its node budget: it remembers the garbage it has logged."""
        key = (self._api(), agent_namespace(policy), policy.device_budget_configmap, policy.key_prefix)
        if self._budget_obj is None or self._budget_at != key:
            api, namespace, name, prefix = self._budget_at = key
            self._budget_obj = DeviceBudget(api, self._node, namespace, name, prefix, self._clock, self._wrote)
        return self._budget_obj

    @staticmethod
    def _settings(policy: KubernetesConfig, discovery: Discovery | None) -> DeviceBudgetSettings:
        return DeviceBudgetSettings.from_policy(
            policy, discovery.slices if discovery else None, discovery.rules if discovery else None
        )

    def apply(
        self,
        isolations: list[Isolation],
        policy: KubernetesConfig,
        discovery: Discovery | None,
        tick: float,
        api_ok: bool,
        present: set[str],
        would_write: list[dict[str, str]],
    ) -> list[Isolation]:
        fine = {i.device for i in isolations if i.fine}
        present = present & fine
        if fine <= (self.held or frozenset()):
            return isolations
        if policy.dry_run:
            return self._would(isolations, policy, discovery, fine, present, would_write)
        if api_ok and tick >= self._retry_at:
            try:
                budget, settings = self._budget(policy), self._settings(policy, discovery)
                refused = budget.peek(settings) if self._denied else None
                self.grant = refused or budget.acquire(settings, fine, present)
                if refused is None:
                    self.held = self.grant.held
            except Exception as exc:  # noqa: BLE001 - not known to fit: the node taint, fail closed
                why = self._error(exc, "device budget not read")
                return [
                    as_fallback(i, policy, why, "budget_error") if i.device not in present else i for i in isolations
                ]
            self._denied = bool(fine - (self.held or frozenset()))
            if self._denied:
                self._retry_at = tick + self._backoff.next_delay()
            else:
                self._backoff.reset()
        granted = (self.held or frozenset()) | present
        return [i if not i.fine or i.device in granted else self._withhold(i) for i in isolations]

    def _would(
        self,
        isolations: list[Isolation],
        policy: KubernetesConfig,
        discovery: Discovery | None,
        fine: set[str],
        present: set[str],
        would_write: list[dict[str, str]],
    ) -> list[Isolation]:
        try:
            self.grant = self._budget(policy).would_grant(self._settings(policy, discovery), fine, present)
        except Exception as exc:  # noqa: BLE001
            why = self._error(exc, "device budget not read")
            return [as_fallback(i, policy, why, "budget_error") if i.fine else i for i in isolations]
        taken = self.grant.held - (self.held or frozenset())
        if taken:
            would_write.append({"kind": "device_budget", "what": f"take slots for {', '.join(sorted(taken))}"})
        return [i if not i.fine or i.device in self.grant.held else self._withhold(i) for i in isolations]

    def _withhold(self, isolation: Isolation) -> Isolation:
        grant = self.grant
        if grant is not None and grant.counting:
            why = "the device budget is being counted"
        elif grant is not None and grant.limit == 0 and grant.devices == 0:
            why = "the device budget counts no device in the fleet (kubernetes.dra_drivers, device_resources)"
        elif grant is not None:
            why = "the device budget is spent"
        else:
            why = "the device budget has not been asked yet"
        return replace(isolation, mechanism="withheld", rules=(), codes={}, why=why, why_code="budget")

    def release(self, policy: KubernetesConfig, keep: frozenset[str]) -> None:
        try:
            self.held = self._budget(policy).release(keep)
        except Exception as exc:  # noqa: BLE001 - kept, given back on a later pass
            self._error(exc, "device budget slots not released")
