"""Kubernetes API semantics the API double (kube_double.py) implements, as pure functions: strategic-merge,
JSON merge (RFC 7386) and JSON patch (RFC 6902), label and field selectors, and the validation of what the agent
writes (taints, labels, conditions, ConfigMap keys)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"

# Lists that strategic merge merges by key (patchStrategy=merge in the Go types); every other list is
# atomic and replaced whole — notably spec.taints.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("metadata", "ownerReferences"): "uid",
}

KINDS = {
    "nodes": "Node",
    "configmaps": "ConfigMap",
    "events": "Event",
    "pods": "Pod",
    "resourceslices": "ResourceSlice",
    "devicetaintrules": "DeviceTaintRule",
}
NAMESPACED = {"configmaps", "events", "pods"}

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Validation of other API groups' kinds (kube_dra.py registers resource.k8s.io's): resource → check.
EXTRA_VALIDATORS: dict[str, Callable[[dict[str, Any]], None]] = {}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


# --- patch semantics -------------------------------------------------------------------------------


def strategic_merge(original: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    if not isinstance(patch, dict) or not isinstance(original, dict):
        return _strip_directives(copy.deepcopy(patch))
    if patch.get("$patch") == "replace":
        return _strip_directives({k: v for k, v in patch.items() if k != "$patch"})
    result = copy.deepcopy(original)
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $setElementOrder/<list> is read with its list; $retainKeys is not needed here
        if value is None:
            result.pop(key, None)
            continue
        sub = (*path, key)
        if isinstance(value, list) and sub in MERGE_KEYS:
            order = patch.get(f"$setElementOrder/{key}")
            result[key] = _merge_list(result.get(key) or [], value, MERGE_KEYS[sub], sub, order)
        elif isinstance(value, dict):
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                current = result.get(key)
                result[key] = strategic_merge(current if isinstance(current, dict) else {}, value, sub)
        else:
            result[key] = _strip_directives(copy.deepcopy(value))
    return result


def _merge_list(
    original: list[Any], patch: list[Any], merge_key: str, path: tuple[str, ...], order: Any = None
) -> list[Any]:
    """kube-apiserver's merge of a keyed list: patched items merged into theirs, deleted ones dropped, then the
    patch's items (in `$setElementOrder` order where given, else the patch's) and the server-only items merged as
    two sorted runs: an item the server had goes by its old position, a new one goes before the server's next."""
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    items = {e.get(merge_key): copy.deepcopy(e) for e in original if isinstance(e, dict)}
    position = {key: n for n, key in enumerate(items)}
    patched: list[Any] = []
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise ApiError(422, "Invalid", f"{'.'.join(path)}: list item without merge key {merge_key!r}")
        key = item[merge_key]
        if item.get("$patch") == "delete":
            items.pop(key, None)
            continue
        current = items.get(key)
        items[key] = _strip_directives(copy.deepcopy(item)) if current is None else strategic_merge(current, item, path)
        patched.append(key)
    if isinstance(order, list):
        listed = [e.get(merge_key) for e in order if isinstance(e, dict)]
        if [k for k in listed if k in patched] != patched:
            raise ApiError(500, "", f"The order in patch list doesn't match $setElementOrder list: {order}")
        patched = [k for k in listed if k in items]
    server = [k for k in position if k in items and k not in patched]
    merged: list[Any] = []
    while server and patched:
        first = patched[0] not in position or position[patched[0]] < position[server[0]]
        merged.append((patched if first else server).pop(0))
    return [items[k] for k in merged + server + patched]


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def merge_patch(original: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict):
            doc = doc[part]
        else:
            raise KeyError(part)
    return doc


def json_patch(original: Any, operations: Any) -> Any:
    """RFC 6902."""
    if not isinstance(operations, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
    doc = copy.deepcopy(original)
    for op in operations:
        try:
            kind = op["op"]
            parts = _pointer(op["path"])
            if kind == "test":
                if _resolve(doc, parts) != op["value"]:
                    raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
                continue
            if kind in ("move", "copy"):
                source = _pointer(op["from"])
                value = copy.deepcopy(_resolve(doc, source))
                if kind == "move":
                    doc = _remove(doc, source)
                doc = _add(doc, parts, value)
            elif kind == "add":
                doc = _add(doc, parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                doc = _remove(doc, parts)
            elif kind == "replace":
                _resolve(doc, parts)  # must exist
                doc = _add(_remove(doc, parts), parts, copy.deepcopy(op["value"]))
            else:
                raise ApiError(422, "Invalid", f"unknown JSON patch operation {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"JSON patch {op!r} does not apply: {exc!r}") from None
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            index = int(last)
            if not 0 <= index <= len(parent):
                raise IndexError(index)
            parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KeyError(last)
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return None
    parent = _resolve(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        del parent[int(last)]
    else:
        del parent[last]
    return doc


# --- label selectors -------------------------------------------------------------------------------

_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current)
    return terms


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in _split_selector(selector or ""):
        term = term.strip()
        if not term:
            continue
        match = _SET_TERM.match(term)
        if match:
            key, op, values = match.group(1), match.group(2), {v.strip() for v in match.group(3).split(",")}
            if (op == "in") != (key in labels and labels[key] in values):
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_selector_matches(selector: str, obj: dict[str, Any]) -> bool:
    for term in _split_selector(selector or ""):
        negate = "!=" in term
        key, value = (s.strip() for s in term.replace("==", "=").replace("!=", "=").split("=", 1))
        actual: Any = obj
        for part in key.split("."):
            actual = actual.get(part) if isinstance(actual, dict) else None
        if (str(actual) == value) == negate:
            return False
    return True


# Field selectors each core kind supports (kube-apiserver answers 400 "field label not supported" to others).
FIELD_LABELS = {
    "nodes": ("metadata.name", "spec.unschedulable"),
    "configmaps": ("metadata.name", "metadata.namespace"),
    "pods": (
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.podIPs",
        "status.nominatedNodeName",
    ),
    "events": (
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ),
}
_EQUALITY = re.compile(r"^\s*(!?)\s*([^\s!=]+)\s*(?:(==|!=|=)\s*([^\s]*))?\s*$")


def check_selectors(resource: str, label_selector: str, field_selector: str) -> None:
    """A list's selectors as kube-apiserver parses them: 400 for a label selector it cannot parse (bad keys or
    values, operators it lacks) and for a field label the kind does not support."""
    text = (label_selector or "").strip()
    terms = _split_selector(text) if text else []
    if text.endswith(","):
        terms.append("")
    for term in terms:
        if not term.strip():
            raise ApiError(400, "BadRequest", "unable to parse requirement: found '', expected: identifier")
        found = _SET_TERM.match(term)
        if found:
            key, values = found.group(1), [v.strip() for v in found.group(3).split(",")]
        else:
            match = _EQUALITY.match(term)
            if match is None or (match.group(1) and match.group(3)):
                raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
            key, values = match.group(2), [match.group(4) or ""]
        if not _validate_label_key(key) or not all(label_value_valid(v) for v in values):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    for term in filter(None, (t.strip() for t in (field_selector or "").split(","))):
        label = re.split(r"!=|==|=", term, maxsplit=1)[0].strip()
        if resource in FIELD_LABELS and label not in FIELD_LABELS[resource]:
            raise ApiError(400, "BadRequest", f"field label not supported: {label}")


# --- validation ------------------------------------------------------------------------------------


def _validate_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.match(name)) and (not prefix or bool(_DNS_SUBDOMAIN.match(prefix)))


def qualified_name_valid(key: str) -> bool:
    """A label key / taint key: an optional DNS-subdomain prefix and a name of at most 63 characters."""
    return _validate_label_key(key)


def label_value_valid(value: Any) -> bool:
    return isinstance(value, str) and (not value or bool(_LABEL_NAME.match(value)))


ANNOTATIONS_LIMIT = 256 * 1024  # bytes of all keys and values together (apimachinery's TotalAnnotationSizeLimitB)
_DNS_SUBDOMAIN_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def validate_object(resource: str, obj: dict[str, Any]) -> None:
    metadata = obj.get("metadata") or {}
    name, kind = metadata.get("name") or "", obj.get("kind") or KINDS.get(resource, resource)
    if resource != "events" and (len(name) > 253 or not _DNS_SUBDOMAIN_NAME.match(name)):
        raise ApiError(
            422,
            "Invalid",
            f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a lowercase RFC '
            "1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
        )
    annotations = metadata.get("annotations") or {}
    if sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items()) > ANNOTATIONS_LIMIT:
        raise ApiError(
            422,
            "Invalid",
            f'{kind} "{name}" is invalid: metadata.annotations: Too long: may not be more than '
            f"{ANNOTATIONS_LIMIT} bytes",
        )
    for key, value in (metadata.get("labels") or {}).items():
        if not _validate_label_key(key):
            raise ApiError(422, "Invalid", f"metadata.labels: invalid key {key!r}")
        if not isinstance(value, str) or (value and not _LABEL_NAME.match(value)):
            raise ApiError(422, "Invalid", f"metadata.labels[{key}]: invalid value {value!r}")
    if resource == "nodes":
        seen = set()
        for taint in (obj.get("spec") or {}).get("taints") or []:
            if not _validate_label_key(taint.get("key", "")):
                raise ApiError(422, "Invalid", f"spec.taints: invalid key {taint.get('key')!r}")
            if taint.get("effect") not in TAINT_EFFECTS:
                raise ApiError(422, "Invalid", f"spec.taints: invalid effect {taint.get('effect')!r}")
            value = taint.get("value", "")
            if value and not _LABEL_NAME.match(value):
                raise ApiError(422, "Invalid", f"spec.taints: invalid value {value!r}")
            if (taint["key"], taint["effect"]) in seen:
                raise ApiError(422, "Invalid", f"spec.taints: duplicate {taint['key']}:{taint['effect']}")
            seen.add((taint["key"], taint["effect"]))
        types = set()
        for condition in (obj.get("status") or {}).get("conditions") or []:
            # kube-apiserver does not check a Node condition's status (any string is stored): neither does this.
            if not condition.get("type") or condition["type"] in types:
                raise ApiError(422, "Invalid", f"status.conditions: missing or duplicate type {condition.get('type')}")
            types.add(condition["type"])
    if resource == "events":
        # A cluster-scoped object's Events (no involvedObject.namespace) only in `default` (kube-apiserver's legacy
        # Event validation); a namespaced one's only in its own namespace.
        involved = (obj.get("involvedObject") or {}).get("namespace") or ""
        namespace = metadata.get("namespace") or ""
        if involved != namespace and not (involved == "" and namespace == "default"):
            raise ApiError(
                422,
                "Invalid",
                f'Event "{metadata.get("name")}" is invalid: involvedObject.namespace: Invalid value: "{involved}": '
                "does not match event.namespace",
            )
    if resource == "configmaps":
        for key, value in (obj.get("data") or {}).items():
            if not re.match(r"^[-._a-zA-Z0-9]+$", key) or not isinstance(value, str):
                raise ApiError(422, "Invalid", f"data: invalid key {key!r}")
    extra = EXTRA_VALIDATORS.get(resource)
    if extra is not None:
        extra(obj)
