"""Whether the cluster acts on DeviceTaintRules, so that a rule counts as an isolation only where it isolates.

A cluster can serve DeviceTaintRules and ignore them: 1.36 serves them in `resource.k8s.io/v1beta2` whatever its
DRADeviceTaintRules gate says, and with the gate off the scheduler and the eviction controller pass them by. The
signal that works on 1.36 and 1.37: kube-controller-manager's device-taint-eviction controller, running with the
gates on, writes each rule's `status.conditions` within about a second of its create or spec change; with the gates
off it never does.

- `saw`: any of the agent's rules read with a status proves it (the rules read at start and on each recheck).
- `check`: after a write, a rule without one is read again (every POLL_SECONDS, at most CONFIRM_SECONDS, once per
  run); without a status by then the cluster is taken as not acting (`NOT_ACTED`): the device falls back to the
  node taint while its rule stays, and the recheck of the rules (`dra_recheck_seconds`) looks again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.kube.devices.dra import RuleWriter, acted_on

NOT_ACTED = "not_acted"
CONFIRM_SECONDS = 10.0
POLL_SECONDS = 0.25
WHY = (
    "the cluster does not act on DeviceTaintRules: no device-taint-eviction status on the rule "
    "(DRADeviceTaints/DRADeviceTaintRules off in kube-controller-manager?)"
)


class Acting:
    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep
        self.known: bool | None = None  # None: not judged yet this run

    def saw(self, rules: Iterable[Mapping[str, Any]]) -> None:
        if any(acted_on(rule) for rule in rules):
            self.known = True

    def check(self, writer: RuleWriter, names: list[str], rules: dict[str, dict[str, Any]]) -> str:
        """'' once the cluster showed it acts on rules; else why the device falls back. Waits (bounded) only the
        first time a rule is written in this run."""
        if self.known:
            return ""
        self.saw(rules[name] for name in names if name in rules)
        if self.known or self.known is False:
            return "" if self.known else WHY
        for _ in range(round(CONFIRM_SECONDS / POLL_SECONDS)):
            self._sleep(POLL_SECONDS)
            for name in names:
                try:
                    fresh = writer.api.get_device_taint_rule(writer.version, name)
                except Exception:  # noqa: BLE001 - not known yet: judged again on a later write
                    return WHY
                if fresh is not None:
                    rules[name] = fresh
                if acted_on(fresh):
                    self.known = True
                    return ""
        self.known = False
        return WHY
