"""/ready?pod=<namespace>/<name>: the devices the kubelet's ledger allocated to one pod, as the device indices the
health state's findings carry, so that /ready judges exactly those (and the node-wide checks).

The ledger is the kubelet's PodResources List (`probes.runtime.podresources`), read by the reader child the npu and
gpu probes share. A fresh read is asked for before a pod is judged (`PodLedger.refresh`, in a thread of its own,
never on a loop; at most one a second, and one every 5 s while reads fail) and waited for at most
`LEDGER_WAIT_SECONDS`, so a pod admitted a moment ago is listed, and a pod re-created under the same name is judged
by its own allocation: by the agent's process when the HTTP server's asks it (`resolve_fresh`; the daemon's way,
agent/http/process.py), on the loop's own process otherwise (`LocalPods`). Then, failing closed (`resolve`):

- no read yet, or the last one failed (no socket, the kubelet did not answer) → LedgerUnavailable;
  an ok read older than `MAX_LEDGER_AGE_SECONDS` (the newer one asked for has not finished) → LedgerStale; its
  age is on the monotonic clock, so a wall clock stepped back never makes an old read look fresh;
- the pod not listed → PodNotInLedger;
- its ids mapped to devices: `nvidia.com/...` ids (`GPU-<uuid>`, `MIG-<uuid>`, `<id>::N` replicas, an index) to
  the GPU whose results name them (`observed.device_ids`); `huawei.com/...` ids (`Ascend910-<phy>`, vNPUs
  `Ascend910-2c-<vdev>-<phy>`) to the chip /dev/davinci<phy>, with Volcano's `huawei.com/AscendReal` in place of
  the kubelet-side ids exactly as npu.ledger does it (the node's pod list; a list older than the pod's first
  sighting in the ledger is not trusted), then to the chip's device index through the npu results. An id no result
  maps → PodDevicesUnknown;
- a DRA claim (`dynamic_resources`): the agent does not map claims to devices, so every device of the node counts;
- other device plugin resources (NICs, ...) are not devices the agent judges: the node-wide checks cover them.

What the query does with an unresolved pod (fall back to devices=, or not ready) is agent/http/routes.py's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.ready import echo
from agent.reasons import LEDGER_STALE, LEDGER_UNAVAILABLE, POD_DEVICES_UNKNOWN, POD_NOT_IN_LEDGER
from agent.snapshot import Snapshot
from probes.base import Check, Finding, Reason
from probes.gpu.ledger_findings import gpu_indices, gpu_of_id
from probes.npu.ledger_findings import FirstSeen, chip_indices, chip_of, real_chips
from probes.runtime.podresources.client import STARTUP_ALLOWANCE_SECONDS, LedgerRead, last_read, ledger_source
from probes.runtime.podresources.ledger import (
    ASCEND_PREFIX,
    NVIDIA_PREFIX,
    Allocation,
    Ledger,
)
from probes.runtime.podresources.pods import PodDirectory

# A read older than this cannot vouch for a pod: the server asks for a new one before each judgement (at most
# REFRESH_SECONDS apart), so an ok read this old means the newer one has not come back.
MAX_LEDGER_AGE_SECONDS = 10.0
REFRESH_SECONDS = 1.0  # reads within this are reused (the client's own MIN_SECONDS_BETWEEN_READS too)
RETRY_FAILED_SECONDS = 5.0  # after a failed read: a hung kubelet costs a reader child restart per read
# How long a request waits for the read asked for before the last one judges: the answer stays prompt (a
# pre-flight gives each attempt 3 s) whatever the kubelet does.
LEDGER_WAIT_SECONDS = 1.0
MAX_IDS_SHOWN = 32

POD_CHECK = Check("ready.pod")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodDevices:
    """What the ledger says of one pod: its devices as (category, index) (`devices`; None: every device of the
    node), or why they are not known (`reason`, a finding that makes the answer not ready)."""

    namespace: str
    name: str
    devices: frozenset[tuple[str, int]] | None = None
    reason: Finding | None = None
    ids: tuple[str, ...] = ()  # the ledger's device ids for the pod (Volcano's real ones where they apply)
    every_device_because: str = ""  # why every device counts (a DRA claim)

    @property
    def known(self) -> bool:
        return self.reason is None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def describe(self, fallback: bool = False) -> str:
        """For the text answer's first line: `pod ns/name (devices 1, 3 from the kubelet's ledger)`."""
        if fallback or not self.known:
            why = self.reason.reason if self.reason is not None else ""
            return f"pod {self.key} ({'devices= as given' if fallback else 'its devices not known'}: {why})"
        if self.devices is None:
            return f"pod {self.key} (every device: {self.every_device_because})"
        listed = ", ".join(f"{category}{index}" for category, index in sorted(self.devices))
        return f"pod {self.key} ({listed or 'no devices'} from the kubelet's ledger)"

    def to_dict(self, fallback: bool = False) -> dict[str, Any]:
        """`pod` in the JSON answer: where the devices judged came from (`ledger`, `devices` for devices=, or
        null: not known, not ready), and which."""
        out: dict[str, Any] = {"namespace": self.namespace, "name": self.name}
        if self.known:
            out["devices_from"] = "ledger"
            listed = sorted(self.devices or ())
            out["devices"] = "all" if self.devices is None else [{"category": c, "device": i} for c, i in listed]
            out["ledger_ids"] = list(self.ids[:MAX_IDS_SHOWN])
        else:
            out["devices_from"] = "devices" if fallback else None
            out["ledger"] = self.reason.reason if self.reason is not None else ""
        return out


def _unknown(namespace: str, name: str, reason: Reason, message: str, observed: Mapping[str, Any]) -> PodDevices:
    finding = POD_CHECK.report(reason, f"{namespace}/{name}", message, observed)
    return PodDevices(namespace, name, reason=finding)


def unavailable(namespace: str, name: str, why: str) -> PodDevices:
    return _unknown(namespace, name, LEDGER_UNAVAILABLE, why, {})


def read_problem(read: LedgerRead | None, now: float) -> tuple[Reason, str, dict[str, Any]] | None:
    """Why this read cannot vouch for a pod, or None when it can; `now` is the monotonic clock."""
    if read is None:
        return LEDGER_UNAVAILABLE, "the kubelet's ledger has not been read yet", {}
    observed = read.observed()
    if not read.ok:
        return LEDGER_UNAVAILABLE, f"the kubelet's ledger could not be read: {read.why}", observed
    age = now - read.read_mono
    if age > MAX_LEDGER_AGE_SECONDS:
        message = f"the last ledger read is {age:.0f}s old (limit {MAX_LEDGER_AGE_SECONDS:g}s): a newer one is late"
        return LEDGER_STALE, message, observed
    return None


class PodLedger:
    """What /ready?pod= reads: the latest ledger read (never blocking), the node's pods for Volcano's real chips, and
    when each pod with Ascend devices was first seen in the ledger. `resolve` runs on the HTTP loop (it only reads
    memory); `refresh` blocks and runs in a thread."""

    def __init__(
        self,
        socket: Callable[[], str],
        timeout: Callable[[], float],
        pods: Callable[[], PodDirectory | None] = lambda: None,
    ) -> None:
        self._socket = socket
        self._timeout = timeout
        self._pods = pods
        self._seen = FirstSeen()
        self._dated = -1.0  # read_mono of the last read whose Ascend pods were dated (no reference to the read kept)
        self._last_attempt = -1e9  # monotonic
        self._lock = threading.Lock()  # refresh() runs in a thread; due() on the loop
        self.refreshes = 0

    # --- reading -----------------------------------------------------------------------------------

    def last(self) -> LedgerRead | None:
        return last_read(self._socket())

    def due(self, now_mono: float | None = None) -> bool:
        """Whether a new read is worth asking for before judging: the last one is over a second old (5 s after
        a failed one)."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        if ledger_source(self._socket()).busy:
            return True  # a read is under way (a probe's): wait for it, whose answer replaces the last one
        last = self.last()
        spacing = REFRESH_SECONDS if last is None or last.ok else RETRY_FAILED_SECONDS
        with self._lock:
            return now_mono - self._last_attempt >= spacing

    def refresh(self) -> LedgerRead | None:
        """One read (or the one in flight, or one finished within the last second), waited for at most its own
        deadline. Blocks: never call it on the HTTP loop."""
        with self._lock:
            self._last_attempt = time.monotonic()
            self.refreshes += 1
        return self.read_now()

    def read_now(self) -> LedgerRead | None:
        timeout = self._timeout()
        pending = ledger_source(self._socket()).start(timeout)
        return pending.result(time.monotonic() + timeout + STARTUP_ALLOWANCE_SECONDS)

    # --- judging -----------------------------------------------------------------------------------

    def resolve(self, snapshot: Snapshot, namespace: str, name: str, now: float | None = None) -> PodDevices:
        """The pod's devices, judged by the latest read; `now` is the monotonic clock."""
        now = time.monotonic() if now is None else now
        read = self.last()
        problem = read_problem(read, now)
        if problem is not None:
            return _unknown(namespace, name, *problem)
        assert read is not None and read.ledger is not None
        if (namespace, name) not in read.ledger.pods:
            message = (
                f"the kubelet's ledger ({len(read.ledger.pods)} pods, read {max(0.0, now - read.read_mono):.1f}s ago) "
                f"does not list pod {namespace}/{name}"
            )
            return _unknown(namespace, name, POD_NOT_IN_LEDGER, message, read.observed())
        allocations = self._by_pod(read).get((namespace, name), [])
        directory = self._pods()
        return map_devices(snapshot, namespace, name, allocations, self._seen, directory)

    def _by_pod(self, read: LedgerRead) -> dict[tuple[str, str], list[Allocation]]:
        """The read's allocations per pod, made once per ledger and kept on it (a ledger holds up to 20,000 ids: not
        per request), so they go with it; each read also dates the pods with Ascend devices (npu.ledger's rule for
        Volcano's annotation)."""
        ledger: Ledger | None = read.ledger
        pods = ledger.by_pod if ledger is not None else {}
        if read.read_mono != self._dated:
            ascend = [pod for pod, held in pods.items() if any(a.resource.startswith(ASCEND_PREFIX) for a in held)]
            self._seen.update(ascend, read.read_at or time.time())
            self._dated = read.read_mono
        return pods


class PodSource(Protocol):
    """Where /ready?pod= learns a pod's devices: `LocalPods` in the agent's own process, `RemotePods`
    (agent/http/serving.py) in the HTTP server's process, which asks the agent."""

    async def devices(self, namespace: str, name: str) -> PodDevices: ...


class LocalPods:
    """The ledger read from the HTTP loop's own process: a new read when the last one is over a second old, in a
    thread (the read blocks on the reader child); every request waiting meanwhile waits for the same read, at most
    LEDGER_WAIT_SECONDS: a slow or hung kubelet must not make the pre-flight's answer late (a pre-flight that gets
    no answer may fail open). Past it the last read judges, and one too old is LedgerStale."""

    def __init__(self, ledger: PodLedger, snapshot: Callable[[], Snapshot]) -> None:
        self._ledger = ledger
        self._snapshot = snapshot
        self._refresh: asyncio.Future[None] | None = None

    async def devices(self, namespace: str, name: str) -> PodDevices:
        refresh = self._refresh
        if refresh is None or refresh.done():
            refresh = self._refresh = self._start_refresh() if self._ledger.due() else None
        if refresh is not None:
            try:
                await asyncio.wait_for(asyncio.shield(refresh), LEDGER_WAIT_SECONDS)
            except asyncio.TimeoutError:
                pass
        return self._ledger.resolve(self._snapshot(), namespace, name)

    def _start_refresh(self) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def read() -> None:
            refresh_quietly(self._ledger)
            try:
                loop.call_soon_threadsafe(finish)
            except RuntimeError:  # the loop closed meanwhile
                pass

        # A daemon thread, one at a time (the future is shared until it is done): an exit never waits for a
        # hung kubelet.
        threading.Thread(target=read, name="ready-ledger", daemon=True).start()
        return done


def refresh_quietly(ledger: PodLedger) -> None:
    try:
        ledger.refresh()
    except Exception as exc:  # noqa: BLE001 - the last read stands; resolve() judges it
        log.warning("reading the kubelet's ledger for /ready?pod= failed: %r", exc)


def resolve_fresh(ledger: PodLedger, snapshot: Callable[[], Snapshot], namespace: str, name: str) -> PodDevices:
    """LocalPods.devices for a thread of the agent's (blocks at most LEDGER_WAIT_SECONDS): what the agent answers
    the HTTP server's process for a pod= query."""
    if ledger.due():
        reader = threading.Thread(target=refresh_quietly, args=(ledger,), name="ready-ledger", daemon=True)
        reader.start()
        reader.join(LEDGER_WAIT_SECONDS)
    return ledger.resolve(snapshot(), namespace, name)


def map_devices(
    snapshot: Snapshot,
    namespace: str,
    name: str,
    allocations: Sequence[Allocation],
    seen: FirstSeen,
    directory: PodDirectory | None,
) -> PodDevices:
    """The device indices of one pod's allocations (see the module's docstring); PodDevicesUnknown when an id maps
    to no device the results know."""
    devices: set[tuple[str, int]] = set()
    unmapped: list[str] = []
    ascend = [a for a in allocations if a.resource.startswith(ASCEND_PREFIX)]
    ids = [a.device_id for a in allocations if not a.resource.startswith(ASCEND_PREFIX)]
    if ascend:
        if directory is None:  # for good, not for now: the pre-flight asks about the devices it knows instead
            why = "Kubernetes is off here (no pod list), so Volcano's real chips of an Ascend pod cannot be known"
            return _unknown(namespace, name, LEDGER_UNAVAILABLE, why, {})
        real, why = real_chips((namespace, name), ascend, directory.current(), seen, directory)
        if why:
            return _unknown(namespace, name, POD_DEVICES_UNKNOWN, f"its Ascend chips are not known: {why}", {})
        chips = chip_indices(state.finding for state in snapshot.checks)
        for allocation in real:
            ids.append(allocation.device_id)
            chip = chip_of(allocation.device_id, chips)
            if chip is not None:
                devices.add(("npu", chip))
            else:
                unmapped.append(allocation.device_id)
    known_ids, gpus = gpu_indices(state.finding for state in snapshot.checks)
    claims = []
    for allocation in allocations:
        if allocation.resource.startswith(NVIDIA_PREFIX):
            gpu = gpu_of_id(allocation.device_id, known_ids, gpus)
            if gpu is not None:
                devices.add(("gpu", gpu))
            else:
                unmapped.append(allocation.device_id)
        elif "/" not in allocation.resource:  # a DRA claim: its resource is the driver's name
            claims.append(allocation.device_id)
    if unmapped:
        message = (
            f"the ledger gives it {echo(unmapped[0])}"
            + (f" and {len(unmapped) - 1} more" if len(unmapped) > 1 else "")
            + ", which no npu or gpu result of this node names (yet)"
        )
        return _unknown(namespace, name, POD_DEVICES_UNKNOWN, message, {"unmapped": unmapped[:MAX_IDS_SHOWN]})
    if claims:
        why = f"a DRA claim ({echo(claims[0])}), which the agent does not map to a device"
        return PodDevices(namespace, name, None, ids=tuple(ids), every_device_because=why)
    return PodDevices(namespace, name, frozenset(devices), ids=tuple(ids))
