"""Events about the Node: queued by the reconciler, sent on their own schedule.

An Event is a courtesy to whoever runs `kubectl describe node`; the taints and conditions are the contract.
So an Event that cannot be sent never fails the reconcile pass and never delays a taint's removal: 403 and
404 (RBAC, a missing namespace) and other permanent refusals drop the Event (logged and counted); throttling,
timeouts, 5xx and an unreachable API keep it queued and back off on this queue only.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.kube.client import Backoff, KubeApi, classify, retry_after, short_error
from agent.kube.node.policy import MESSAGE_LIMIT, FindingEvent
from agent.timestamps import rfc3339
from probes.text import clip, escape, redact_userinfo

log = logging.getLogger("agent.kube")

COMPONENT = "node-health"
QUEUE_LIMIT = 100
# Kinds worth retrying: the API will answer later. Anything else (forbidden, not_found, an invalid Event) would
# be refused again.
TRANSIENT = frozenset({"unreachable", "timeout", "throttled", "server", "conflict"})


@dataclass(frozen=True)
class QueuedEvent:
    reason: str
    message: str
    warning: bool
    at: float  # when it happened: its timestamps, even when the API took it later


class EventQueue:
    def __init__(
        self,
        node: str,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        rng: random.Random,
        on_write: Callable[[str], None],
        backoff_initial: float,
        backoff_max: float,
    ) -> None:
        self.node = node
        self._clock = clock  # the wall clock: an Event's timestamps
        self._monotonic = monotonic  # its backoff, which no clock step may stretch
        self._rng = rng
        self._on_write = on_write
        self._queue: deque[QueuedEvent] = deque(maxlen=QUEUE_LIMIT)
        self._seen: set[tuple[str, str, str, str]] = set()
        self.backoff = Backoff(backoff_initial, backoff_max, rng)
        self.retry_at = 0.0
        self.errors: Counter[str] = Counter()
        self.dropped = 0
        self.last_error = ""

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, reason: str, message: str, warning: bool) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1  # the oldest goes: the API has been away for a long while
        # Every Event the agent makes passes here: escaped (probes/text.py) whatever built its message, and with
        # no URL's userinfo (a proxy password).
        text = clip(escape(redact_userinfo(message)), MESSAGE_LIMIT)
        self._queue.append(QueuedEvent(reason, text, warning, self._clock()))

    def add_findings(self, events: tuple[FindingEvent, ...]) -> None:
        """One Event per distinct finding event; one that leaves the snapshot and comes back is a new one."""
        keys = set()
        for event in events:
            key = (event.check, event.subject, event.reason, event.message)
            keys.add(key)
            if key not in self._seen:
                self.add(event.reason, f"{event.check} {event.subject}: {event.message}", event.warning)
        self._seen = keys

    def pending(self) -> list[QueuedEvent]:
        return list(self._queue)

    def clear(self) -> None:
        self._queue.clear()

    def flush(self, api: KubeApi, namespace: str) -> None:
        """Send what is queued, unless this queue is backing off. Never raises."""
        now = self._monotonic()
        if now < self.retry_at:
            return
        while self._queue:
            event = self._queue[0]
            try:
                api.create_event(namespace, self._body(event, namespace))
            except Exception as exc:  # noqa: BLE001 - an Event must never fail the pass
                kind = classify(exc)
                self.errors[kind] += 1
                self.last_error = f"{kind}: {short_error(exc)}"
                if kind in TRANSIENT:
                    delay = self.backoff.next_delay(retry_after(exc))
                    self.retry_at = now + delay
                    log.warning("kubernetes: event not sent (%s); retrying in %.1fs", self.last_error, delay)
                    return
                self._queue.popleft()
                self.dropped += 1
                log.warning("kubernetes: event %s dropped (%s)", event.reason, self.last_error)
                continue
            self._queue.popleft()
            self.backoff.reset()
            self.retry_at = 0.0
            self._on_write(f"{event.reason}: {event.message}")

    def _body(self, event: QueuedEvent, namespace: str) -> dict[str, Any]:
        stamp = rfc3339(event.at)
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{self.node}.{int(event.at * 1e6):x}{self._rng.randrange(16**4):04x}",
                "namespace": namespace,
            },
            # uid = node name, as kubelet and node-problem-detector do, so `kubectl describe node` shows it
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node},
            "reason": event.reason,
            "message": event.message,
            "type": "Warning" if event.warning else "Normal",
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
