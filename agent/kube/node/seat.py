"""The node's seat in the taint budget: whether it holds a slot, why it was refused, when it asks again.

The reconciler asks the seat before a blocking taint is added (`ask`), shows the planner what it knows (`view`),
records what a plan withheld (`withheld`) and gives the slot back once the last blocking taint is gone
(`release`). Refusals back off on their own jittered exponential schedule (`budget_retry_seconds` to
`budget_retry_max_seconds`), apart from the API's backoff; the schedule runs on the monotonic clock.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from agent.config import KubernetesConfig
from agent.kube.client import Backoff, KubeApi, agent_namespace
from agent.kube.node.budget import BudgetResult, BudgetSettings, TaintBudget
from agent.kube.node.plan import Plan, SlotView

log = logging.getLogger("agent.kube")

Would = Callable[[str, str, Any], None]


class BudgetSeat:
    def __init__(
        self,
        node: str,
        api: Callable[[], KubeApi],
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        rng: random.Random,
        wrote: Callable[[str], None],
        policy: KubernetesConfig,
    ) -> None:
        self._node = node
        self._api = api
        self._clock = clock
        self._monotonic = monotonic
        self._rng = rng
        self._wrote = wrote
        self._budget: TaintBudget | None = None
        self.held: bool | None = None  # None: not known yet (a previous run may hold one)
        self._denied: BudgetResult | None = None
        self._seen: BudgetResult | None = None
        self._retry_at = 0.0
        self._backoff = self._new_backoff(policy)
        self._suppressed: dict[str, str] = {}
        self._wanted_taints = ""

    def _new_backoff(self, policy: KubernetesConfig) -> Backoff:
        return Backoff(policy.budget_retry_seconds, policy.budget_retry_max_seconds, self._rng)

    def reconfigure(self, policy: KubernetesConfig) -> None:
        """A new config: the ConfigMap's name or namespace may have changed, and the refusal schedule."""
        self._budget = None
        self._backoff = self._new_backoff(policy)

    def forget_client(self) -> None:
        self._budget = None

    def _taint_budget(self, policy: KubernetesConfig) -> TaintBudget:
        if self._budget is None:
            self._budget = TaintBudget(
                self._api(),
                self._node,
                agent_namespace(policy),
                policy.budget_configmap,
                policy.key_prefix,
                self._clock,
                self._wrote,
            )
        return self._budget

    @property
    def suppressed(self) -> dict[str, str]:
        return dict(self._suppressed)

    def due(self, tick: float) -> bool:
        """A node waiting for a slot asks again once its refusal's delay is over."""
        return bool(self._suppressed) and tick >= self._retry_at

    def granted(self, policy: KubernetesConfig, would: Would) -> bool:
        return self.ask(policy, self._wanted_taints, False, would).state == "held"

    def view(self) -> SlotView:
        if self.held:
            return SlotView("held")
        denied = self._denied
        if denied is not None and self._monotonic() < self._retry_at:
            return SlotView("denied", denied.used, denied.limit, denied.counting)
        return SlotView("unknown" if self.held is None else "free")

    def ask(self, policy: KubernetesConfig, taints: str, already_tainted: bool, would: Would) -> SlotView:
        budget = self._taint_budget(policy)
        settings = BudgetSettings.from_policy(policy)
        if policy.dry_run:
            result = budget.usage(settings)
            if result.granted and not self.held:
                would("budget", f"take a slot for {taints}", None)
        else:
            result = budget.acquire(settings, taints, already_tainted, peek_first=self.held is False)
        self._seen = result
        if result.granted:
            if not policy.dry_run:
                self.held = True
            self._denied = None
            self._backoff.reset()
            return SlotView("held")
        self.held = False
        self._denied = result
        delay = self._backoff.next_delay()
        self._retry_at = self._monotonic() + delay
        log.warning(
            "kubernetes: taint budget spent (%d of %d slots taken): not tainting for %s; asking again in %.0fs",
            result.used,
            result.limit,
            taints,
            delay,
        )
        return SlotView("denied", result.used, result.limit, result.counting)

    def withheld(self, plan: Plan) -> None:
        """What the plan wanted and what it withheld for want of a slot."""
        self._wanted_taints = plan.blocking_taints
        self._suppressed = dict(plan.suppressed)
        if not plan.suppressed:
            self._denied = None
            self._backoff.reset()

    def release(self, plan: Plan, policy: KubernetesConfig, would: Would) -> None:
        if not plan.release:
            return
        if policy.dry_run:
            if self.held:
                would("budget", "release this node's slot", None)
        else:
            self._taint_budget(policy).release()
            self.held = False

    def status(self, max_unhealthy: Any) -> dict[str, Any]:
        seen = self._seen
        return {
            "max_unhealthy": max_unhealthy,
            "slot_held": self.held,
            "used": seen.used if seen else None,
            "limit": seen.limit if seen else None,
            "suppressed": dict(self._suppressed),
            "next_request_in_seconds": round(max(0.0, self._retry_at - self._monotonic()), 1)
            if self._suppressed
            else None,
        }
