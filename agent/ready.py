"""Readiness: which checks a name selects, the verdict over check states, and /ready's query.

One definition of "does this name select this check" (`selects`) serves /ready?checks=, health.required_checks,
`node-health check --only` and kubernetes.disabled_checks. The verdict (`evaluate`) is what HealthState
publishes and what a query with parameters re-judges (`judge`); a query's cost is bounded by its parser.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from agent.reasons import HBM_BELOW_REQUEST, HOST_MEM_BELOW_REQUEST, NO_FRESH_RESULT, NO_SUCH_DEVICE
from agent.snapshot import CheckState, Snapshot, Verdict
from probes.base import (
    CATEGORIES,
    OBSERVED_DEVICE_IDS,
    OBSERVED_HBM_FREE_MIB,
    OBSERVED_HOST_MEM_AVAILABLE_MIB,
    OBSERVED_HUGEPAGES_FREE,
    Check,
    Finding,
    Status,
    category_of,
)
from probes.text import ASCII_ELLIPSIS, clip

READY_PARAMS = frozenset(
    {"checks", "devices", "format", "min_hbm_free_mib", "min_host_mem_mib", "min_hugepages", "pod", "wait"}
)
MAX_SELECTORS = 32  # distinct checks= entries
MAX_DEVICES = 128  # distinct devices= entries: 16 accelerators with 7 MIG devices each fit
MAX_DEVICE_INDEX = 65535

# ASCII digits only (an Arabic-Indic digit passes str.isdigit and int()), bounded in length before any conversion.
_DECIMAL = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,9})?")
_INDEX = re.compile(r"[0-9]{1,5}")
# GPU UUIDs (GPU-<uuid>) and MIG device ids (MIG-<uuid>, or the older MIG-GPU-<uuid>/<gi>/<ci>).
_NVIDIA_ID = re.compile(r"(?:[Gg][Pp][Uu]|[Mm][Ii][Gg])-[0-9A-Za-z/-]{1,96}")
_Q_VALUE = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)")
# namespace: a DNS-1123 label; name: a DNS-1123 subdomain (what the API server accepts for each).
_NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_POD_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


# --- selectors --------------------------------------------------------------------------------------


def selects(selector: str, check: str, category: str | None = None) -> bool:
    """`npu` selects npu.*, `storage.locks` selects itself; a category selects the results in it: by their
    check's name (pcie → host) unless the result carries a per-check override (`category`: a finding's own, such
    as network.collective's interconnect or a kernel.log rule's). So `interconnect` selects interconnect.ports
    and network.collective, `network` still selects network.collective by its name, and `host` leaves out a
    kernel.log rule's interconnect finding."""
    if check == selector or check.startswith(selector + "."):
        return True
    return selector in CATEGORIES and category_of(check, category) == selector


def matches_any(check: str, selectors: Collection[str], category: str | None = None) -> bool:
    return any(selects(selector, check, category) for selector in selectors)


def matches_finding(finding: Finding, selectors: Collection[str]) -> bool:
    """Whether `selectors` select this result, by its check's name or by its category (override included)."""
    return matches_any(finding.check, selectors, finding.category)


def selector_known(selector: str, known_checks: Collection[str]) -> bool:
    """A category, or a name that selects at least one known check."""
    return selector in CATEGORIES or any(selects(selector, check) for check in known_checks)


# --- the verdict ------------------------------------------------------------------------------------


def blocks(finding: Finding, required: Collection[str]) -> bool:
    if finding.status == Status.FAIL:
        return True
    if finding.status == Status.UNKNOWN:
        return finding.reason in NO_FRESH_RESULT or finding.required or matches_finding(finding, required)
    return False


def device_selected(
    finding: Finding, devices: Collection[int] | None, device_keys: Collection[tuple[str, int]] | None
) -> bool:
    if devices is not None and finding.device not in devices:
        return False
    return device_keys is None or (finding.category, finding.device) in device_keys


def evaluate(
    states: Iterable[CheckState],
    required: Collection[str],
    now: float,
    *,
    checks: Collection[str] | None = None,
    devices: Collection[int] | None = None,
    device_keys: Collection[tuple[str, int]] | None = None,
    min_hbm_free_mib: float | None = None,
    min_host_mem_mib: float | None = None,
    min_hugepages: float | None = None,
) -> Verdict:
    """The verdict over the selected states (every one when `checks`, `devices` and `device_keys` are None), with
    the job's memory requests judged too. `devices` selects device results by index whatever their category;
    `device_keys` by (category, index): NPU 0 and GPU 0 apart, as a pod's devices from the ledger are."""
    reasons: list[Finding] = []
    oldest = now
    states = tuple(states)
    for state in states:
        finding = state.finding
        if checks is not None and not matches_finding(finding, checks):
            continue
        if finding.device is not None and not device_selected(finding, devices, device_keys):
            continue
        if state.observed_at:
            oldest = min(oldest, state.observed_at)
        if blocks(finding, required):
            reasons.append(finding)
        if min_hbm_free_mib is not None:
            reasons.extend(hbm_shortfall(finding, min_hbm_free_mib))
    if min_host_mem_mib:
        reasons.extend(host_memory_shortfall(states, "", OBSERVED_HOST_MEM_AVAILABLE_MIB, min_host_mem_mib))
    if min_hugepages:
        reasons.extend(host_memory_shortfall(states, "hugepages", OBSERVED_HUGEPAGES_FREE, min_hugepages))
    return Verdict(not reasons, tuple(reasons), round(max(0.0, now - oldest), 3))


def hbm_shortfall(finding: Finding, wanted: float) -> list[Finding]:
    """/ready?min_hbm_free_mib=: a device result whose free device memory is below what the job asked for."""
    if finding.device is None or finding.status == Status.SKIP:
        return []
    free = finding.observed.get(OBSERVED_HBM_FREE_MIB)
    if not isinstance(free, (int, float)) or free >= wanted:
        return []
    message = f"{finding.subject}: {free:g} MiB free, the job asked for {wanted:g} MiB"
    observed = {OBSERVED_HBM_FREE_MIB: free}
    return [Check(finding.check).report(HBM_BELOW_REQUEST, finding.subject, message, observed, device=finding.device)]


def host_memory_shortfall(states: Iterable[CheckState], subject: str, key: str, wanted: float) -> list[Finding]:
    """/ready?min_host_mem_mib= (subject "") and min_hugepages= (subject "hugepages"), judged against the current
    host.memory result whatever checks= and devices= select: a job asked for this explicitly. A value that is not
    current (never reported, stale, a failed run) fails closed as unknown."""
    what, unit = ("available host memory", " MiB") if key == OBSERVED_HOST_MEM_AVAILABLE_MIB else ("free hugepages", "")
    parameter = "min_host_mem_mib" if key == OBSERVED_HOST_MEM_AVAILABLE_MIB else "min_hugepages"
    state = next((s for s in states if s.finding.key == ("host.memory", subject)), None)
    value = None if state is None else state.finding.observed.get(key)
    if state is None or state.stale or state.finding.status in (Status.UNKNOWN, Status.SKIP):
        value = None
    check = Check("host.memory")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        why = "no host.memory result" if state is None else f"host.memory is {state.finding.reason}"
        message = f"{what} not known ({why}), cannot vouch for {parameter}={wanted:g}"
        return [check.report(HOST_MEM_BELOW_REQUEST, subject, message, status=Status.UNKNOWN)]
    if value >= wanted:
        return []
    message = f"{value:g}{unit} {what}, the job asked for {wanted:g}{unit}"
    return [check.report(HOST_MEM_BELOW_REQUEST, subject, message, {key: value})]


# --- /ready's query ---------------------------------------------------------------------------------


class BadQuery(ValueError):
    pass


@dataclass(frozen=True)
class ReadyQuery:
    checks: tuple[str, ...] | None = None
    device_indices: frozenset[int] | None = None  # None: every device (no devices=, or devices=all)
    device_ids: tuple[str, ...] = ()  # GPU-/MIG- ids, resolved to indices against each snapshot
    devices_given: bool = False  # devices= was in the query (`all` included): what pod= falls back to
    device_keys: frozenset[tuple[str, int]] | None = None  # (category, index): a pod's devices from the ledger
    pod: tuple[str, str] | None = None  # pod=<namespace>/<name>: its devices from the kubelet's ledger
    min_hbm_free_mib: float | None = None
    min_host_mem_mib: float | None = None
    min_hugepages: float | None = None
    wait: float = 0.0
    text: bool = False


def echo(value: str) -> str:
    """A client's value quoted in an error message, bounded."""
    return repr(clip(value, 64, ASCII_ELLIPSIS))


def _number(name: str, text: str, upper: float | None = None) -> float:
    if not _DECIMAL.fullmatch(text):
        raise BadQuery(f"{name}={echo(text)}: not a number (digits, optionally with a decimal point)")
    value = float(text)
    if upper is not None and value > upper:
        raise BadQuery(f"{name}={echo(text)}: at most {upper:g}")
    return value


def distinct_parts(text: str, limit: int) -> tuple[str, ...] | None:
    """The comma-separated parts, stripped, without repeats, in order; None when more than `limit` distinct
    ones or more than 4 * `limit` in all (counted at C speed before any is split off: a name repeated
    thousands of times in one request head must not cost the loop that answers everyone)."""
    if text.count(",") >= 4 * limit:
        return None
    distinct = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    return distinct if len(distinct) <= limit else None


def validate_selectors(selectors: Iterable[str], known_checks: Collection[str]) -> None:
    """BadQuery for an empty name, or one that is no category and selects no known check (checks=, --only)."""
    for selector in selectors:
        if not selector:
            raise BadQuery("empty name in the list")
        if not selector_known(selector, known_checks):
            raise BadQuery(f"unknown check or category {echo(selector)}")


def parse_checks(text: str, known_checks: Collection[str]) -> tuple[str, ...]:
    selectors = distinct_parts(text, MAX_SELECTORS)
    if selectors is None:
        raise BadQuery(f"checks: at most {MAX_SELECTORS} different names, {4 * MAX_SELECTORS} in all")
    try:
        validate_selectors(selectors, known_checks)
    except BadQuery as exc:
        raise BadQuery(f"checks: {exc}") from None
    return selectors


def parse_devices(text: str) -> tuple[frozenset[int] | None, tuple[str, ...]]:
    """`0,1,2`, GPU UUIDs and MIG ids, as the device plugins set *_VISIBLE_DEVICES; `all` selects every one."""
    parts = distinct_parts(text, MAX_DEVICES)
    if parts == ("all",):
        return None, ()
    if parts is None:
        raise BadQuery(f"devices: at most {MAX_DEVICES} different devices, {4 * MAX_DEVICES} in all")
    indices: set[int] = set()
    ids: list[str] = []
    for part in parts:
        if _INDEX.fullmatch(part) and int(part) <= MAX_DEVICE_INDEX:
            indices.add(int(part))
        elif _NVIDIA_ID.fullmatch(part):
            ids.append(part)
        else:
            raise BadQuery(
                f"devices: {echo(part)} is not a device (indices 0-{MAX_DEVICE_INDEX}, GPU-<uuid> or MIG-<uuid>, "
                "comma-separated)"
            )
    return frozenset(indices), tuple(ids)


def parse_pod(text: str) -> tuple[str, str]:
    """`<namespace>/<name>`, each as Kubernetes allows it; BadQuery otherwise (checked before anything is looked up)."""
    namespace, slash, name = text.partition("/")
    if not slash or len(name) > 253 or not _NAMESPACE.fullmatch(namespace) or not _POD_NAME.fullmatch(name):
        raise BadQuery(
            f"pod={echo(text)}: not <namespace>/<name> (a DNS label: lower case, digits, '-', at most 63 characters; "
            "a DNS subdomain, at most 253)"
        )
    return namespace, name


def prefers_text(accept: str) -> bool:
    """Accept negotiation between JSON (the default) and text: text only when it ranks strictly higher;
    an explicit type outranks a wildcard of the same q."""
    if accept in ("", "*/*"):
        return False
    best_text: tuple[float, int] = (0.0, 0)
    best_json: tuple[float, int] = (0.0, 0)
    for item in accept.split(",", 32)[:32]:
        media, *params = item.split(";")
        media = media.strip().lower()
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                q = float(value.strip()) if _Q_VALUE.fullmatch(value.strip()) else 0.0
        if media in ("text/plain", "text/*"):
            best_text = max(best_text, (q, 2 if media == "text/plain" else 1))
        elif media in ("application/json", "application/*", "*/*"):
            best_json = max(best_json, (q, 2 if media == "application/json" else 1))
    return best_text[0] > 0 and best_text > best_json


def wants_text(raw: dict[str, list[str]], accept: str) -> bool:
    formats = raw.get("format")
    if formats:
        return formats[0] == "text"
    return prefers_text(accept)


def parse_ready_query(
    raw: dict[str, list[str]], known_checks: Collection[str], max_wait: float, accept: str = ""
) -> ReadyQuery:
    """Validate /ready's query (name → values, as parse_qs gives). Raises BadQuery with the reason."""
    unknown = sorted(set(raw) - READY_PARAMS)
    if unknown:
        raise BadQuery(f"unknown parameter {echo(unknown[0])} (allowed: {', '.join(sorted(READY_PARAMS))})")
    for key, values in raw.items():
        if len(values) > 1:
            raise BadQuery(f"parameter {key!r} given more than once")
    query = {key: values[0] for key, values in raw.items()}
    if query.get("format", "json") not in ("json", "text"):
        raise BadQuery(f"format={echo(query['format'])}: json or text")
    indices, ids = parse_devices(query["devices"]) if "devices" in query else (None, ())
    numbers = {
        name: _number(name, query[name])
        for name in ("min_hbm_free_mib", "min_host_mem_mib", "min_hugepages")
        if name in query
    }
    return ReadyQuery(
        checks=parse_checks(query["checks"], known_checks) if "checks" in query else None,
        device_indices=indices,
        device_ids=ids,
        devices_given="devices" in query,
        pod=parse_pod(query["pod"]) if "pod" in query else None,
        min_hbm_free_mib=numbers.get("min_hbm_free_mib"),
        min_host_mem_mib=numbers.get("min_host_mem_mib"),
        min_hugepages=numbers.get("min_hugepages"),
        wait=_number("wait", query["wait"], upper=max_wait) if "wait" in query else 0.0,
        text=wants_text(raw, accept),
    )


# --- judging a query against a snapshot -------------------------------------------------------------


def device_index(snapshot: Snapshot) -> dict[str, int]:
    """Device ids (lower case) → the device index of the findings that carry them."""
    index: dict[str, int] = {}
    for state in snapshot.checks:
        finding = state.finding
        ids = finding.observed.get(OBSERVED_DEVICE_IDS)
        if finding.device is None or not isinstance(ids, (list, tuple)):
            continue
        for ident in ids:
            if isinstance(ident, str):
                index.setdefault(ident.lower(), finding.device)
    return index


def judge(snapshot: Snapshot, query: ReadyQuery, now: float | None = None) -> Verdict:
    """The verdict for a query (also `check --only`). A device id no result names is a 400 (BadQuery), unless
    a GPU result is unknown (warming up, probe timeout): then it may be that device, and the answer is not
    ready."""
    devices = query.device_indices
    unresolved: list[str] = []
    if query.device_ids:
        known = device_index(snapshot)
        resolved = {known[ident.lower()] for ident in query.device_ids if ident.lower() in known}
        unresolved = [ident for ident in query.device_ids if ident.lower() not in known]
        devices = (devices or frozenset()) | resolved
    verdict = evaluate(
        snapshot.checks,
        snapshot.required,
        time.time() if now is None else now,
        checks=query.checks,
        devices=devices,
        device_keys=query.device_keys,
        min_hbm_free_mib=query.min_hbm_free_mib,
        min_host_mem_mib=query.min_host_mem_mib,
        min_hugepages=query.min_hugepages,
    )
    absent = absent_devices(snapshot, query, devices)
    if absent:
        verdict = Verdict(False, verdict.reasons + absent, verdict.age_seconds)
    if not unresolved:
        return verdict
    unknown_gpu = tuple(
        state.finding
        for state in snapshot.checks
        if state.finding.status == Status.UNKNOWN and state.finding.category == "gpu"
    )
    if not unknown_gpu:
        raise BadQuery(
            f"devices: {echo(unresolved[0])} is not a device of this node: no result names it "
            "(/status lists each device's ids under observed.device_ids)"
        )
    extra = tuple(finding for finding in unknown_gpu if finding not in verdict.reasons)
    return Verdict(False, verdict.reasons + extra, verdict.age_seconds)


DEVICES_CHECK = Check("ready.devices")


def absent_devices(snapshot: Snapshot, query: ReadyQuery, devices: Collection[int] | None) -> tuple[Finding, ...]:
    """NoSuchDevice findings: device indices the query names that no result of this node carries, and
    min_hbm_free_mib asked where no considered device reports free device memory. Never ready on a guess: a node
    is never vouched for devices it does not have."""
    present = {state.finding.device for state in snapshot.checks if state.finding.device is not None}
    out: list[Finding] = []
    missing = sorted(set(query.device_indices or ()) - present)
    if missing:
        have = ", ".join(map(str, sorted(present))) or "none"
        named = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        message = f"devices={named}: no result of this node names such a device (its devices: {have})"
        out.append(DEVICES_CHECK.report(NO_SUCH_DEVICE, "", message, {"missing": missing[:MAX_DEVICES]}))
    if query.min_hbm_free_mib is not None and not any(
        OBSERVED_HBM_FREE_MIB in state.finding.observed
        for state in snapshot.checks
        if state.finding.device is not None
        and (devices is None or state.finding.device in devices)
        and (query.device_keys is None or (state.finding.category, state.finding.device) in query.device_keys)
    ):
        message = (
            f"min_hbm_free_mib={query.min_hbm_free_mib:g}: no considered device of this node reports free device "
            "memory (no accelerator here, or none of those asked for)"
        )
        out.append(DEVICES_CHECK.report(NO_SUCH_DEVICE, "hbm", message))
    return tuple(out)
