"""The API double's `resource.k8s.io`: discovery, ResourceSlices and DeviceTaintRules, as kube-apiserver serves them.

What the agent's device isolation relies on, the way the real server does it:

- discovery: `/apis` lists the group only where it is served; `/apis/resource.k8s.io/<version>` is an
  APIResourceList naming the resources of that version, 404 for a version not served. `ApiDouble.serve_dra(release)`
  picks what a release serves: "1.37" (DeviceTaintRules GA in v1, and still in v1beta2), "1.36" (ResourceSlices in
  v1, DeviceTaintRules only in v1beta2, the DRADeviceTaintRules gate on), "1.36-no-taint-rules" (the gate off),
  "none" (a cluster without DRA: the group is absent, every path under it 404);
- ResourceSlices and DeviceTaintRules are cluster-scoped; lists take label selectors and the field selectors the
  real server supports for them (ResourceSlice: metadata.name, spec.nodeName, spec.driver, spec.pool.name;
  DeviceTaintRule: metadata.name), any other field label is 400;
- field validation: with `fieldValidation=Strict` an unknown field (a rule's old `deviceClassName` or `selectors`)
  is 400 BadRequest "strict decoding error: unknown field ..."; otherwise it is dropped silently (with a `Warning`
  header under the default, Warn), so a rule may be stored with a smaller selector than it was sent with;
- validation (422) of what is stored: a taint's key, value and effect (None, NoSchedule, NoExecute; PreferNoSchedule
  is not a device taint effect), names, a slice's driver, pool and node; an empty deviceSelector is valid, as in the
  real API (it matches every device);
- the server sets a rule's `spec.taint.timeAdded` on create, and again when an update changes the effect, and
  `metadata.generation` (1, then +1 per spec change); writes to the main resource leave `status` as it was;
- resourceVersion on every write, 409 for a stale one, 409 AlreadyExists, 404, and DELETE preconditions
  (uid, resourceVersion) answered with 409 when they do not hold, through the double's own store.
"""

from __future__ import annotations

import copy
import re
import time
from typing import TYPE_CHECKING, Any

from support import kube_install
from support.kube_semantics import EXTRA_VALIDATORS, ApiError, label_value_valid, qualified_name_valid

if TYPE_CHECKING:
    from support.kube_double import ApiDouble

GROUP = "resource.k8s.io"
RELEASES: dict[str, dict[str, tuple[str, ...]]] = {
    "1.37": {"v1": ("resourceslices", "devicetaintrules"), "v1beta2": ("resourceslices", "devicetaintrules")},
    "1.36": {"v1": ("resourceslices",), "v1beta2": ("resourceslices", "devicetaintrules")},
    # As the real 1.36: the rules are served whatever the gate says; with it off nothing acts on them.
    "1.36-no-taint-rules": {"v1": ("resourceslices",), "v1beta2": ("resourceslices", "devicetaintrules")},
    "none": {},
}
KINDS = {"resourceslices": "ResourceSlice", "devicetaintrules": "DeviceTaintRule"}
FIELD_LABELS = {
    "resourceslices": ("metadata.name", "spec.nodeName", "spec.driver", "spec.pool.name"),
    "devicetaintrules": ("metadata.name",),
}
ATTRIBUTE_STRING_LIMIT = 64  # bytes of a device attribute's string value
DEVICE_TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
EVICTION_CONDITION = "EvictionInProgress"

_PATH = re.compile(
    r"^/apis(?:/(?P<group>[^/]+)(?:/(?P<version>[^/]+)(?:/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)"
    r"(?:/(?P<sub>status))?)?)?)?)?$"
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

# The fields each kind has (None: any value; "*": a map with any keys, whose values follow the given schema).
_ANY = None
_METADATA = dict.fromkeys(
    (
        "name",
        "generateName",
        "namespace",
        "labels",
        "annotations",
        "resourceVersion",
        "uid",
        "creationTimestamp",
        "generation",
        "finalizers",
        "ownerReferences",
        "managedFields",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
    )
)
_ATTRIBUTE = {"int": _ANY, "bool": _ANY, "string": _ANY, "version": _ANY, "strings": _ANY, "ints": _ANY}
_DEVICE = {
    "name": _ANY,
    "attributes": {"*": _ATTRIBUTE},
    "capacity": {"*": {"value": _ANY, "requestPolicy": _ANY}},
    "consumesCounters": _ANY,
    "nodeName": _ANY,
    "nodeSelector": _ANY,
    "allNodes": _ANY,
    "taints": _ANY,
    "bindsToNode": _ANY,
    "bindingConditions": _ANY,
    "bindingFailureConditions": _ANY,
    "allowMultipleAllocations": _ANY,
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "devicetaintrules": {
        "apiVersion": _ANY,
        "kind": _ANY,
        "metadata": _METADATA,
        "spec": {
            "deviceSelector": {"driver": _ANY, "pool": _ANY, "device": _ANY},
            "taint": {"key": _ANY, "value": _ANY, "effect": _ANY, "timeAdded": _ANY},
        },
        "status": {"conditions": _ANY},
    },
    "resourceslices": {
        "apiVersion": _ANY,
        "kind": _ANY,
        "metadata": _METADATA,
        "spec": {
            "driver": _ANY,
            "pool": {"name": _ANY, "generation": _ANY, "resourceSliceCount": _ANY},
            "nodeName": _ANY,
            "nodeSelector": _ANY,
            "allNodes": _ANY,
            "perDeviceNodeSelection": _ANY,
            "devices": [_DEVICE],
            "sharedCounters": _ANY,
        },
    },
}


def unknown_fields(value: Any, schema: Any, path: str = "") -> list[str]:
    """The dotted paths of the fields of `value` its schema does not have."""
    if schema is None:
        return []
    if isinstance(schema, list):
        items = value if isinstance(value, list) else []
        return [p for i, item in enumerate(items) for p in unknown_fields(item, schema[0], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    out = []
    for key, sub in value.items():
        where = f"{path}.{key}" if path else key
        if "*" in schema:
            out += unknown_fields(sub, schema["*"], where)
        elif key not in schema:
            out.append(where)
        else:
            out += unknown_fields(sub, schema[key], where)
    return out


def prune(value: Any, schema: Any) -> Any:
    """`value` without the fields its schema does not have (what a non-strict decode keeps)."""
    if schema is None:
        return value
    if isinstance(schema, list):
        return [prune(item, schema[0]) for item in value] if isinstance(value, list) else value
    if not isinstance(value, dict):
        return value
    if "*" in schema:
        return {key: prune(sub, schema["*"]) for key, sub in value.items()}
    return {key: prune(sub, schema[key]) for key, sub in value.items() if key in schema}


def add_resource_slice(
    api: ApiDouble, name: str, node: str, driver: str, devices: list[dict[str, Any]], pool: str | None = None
) -> dict[str, Any]:
    """A DRA driver's ResourceSlice of one node, as its kubelet plugin publishes it (pool = the node's name
    unless given)."""
    body = {
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool if pool is not None else node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
    return api.create("resourceslices", "", body, api_version=f"{GROUP}/v1")


# --- validation ---------------------------------------------------------------------------------------------


def _validate_rule(obj: dict[str, Any]) -> None:
    name = (obj.get("metadata") or {}).get("name", "")
    if not _DNS_SUBDOMAIN.match(name or ""):
        raise ApiError(422, "Invalid", f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
    spec = obj.get("spec") or {}
    selector = spec.get("deviceSelector")
    if selector is not None:
        for key in ("driver", "pool", "device"):
            if key in selector and not isinstance(selector[key], str):
                raise ApiError(422, "Invalid", f"spec.deviceSelector.{key}: must be a string")
        if selector.get("driver") and not _DNS_SUBDOMAIN.match(selector["driver"]):
            raise ApiError(422, "Invalid", f"spec.deviceSelector.driver: Invalid value: {selector['driver']!r}")
    taint = spec.get("taint") or {}
    if not qualified_name_valid(taint.get("key", "")):
        raise ApiError(422, "Invalid", f"spec.taint.key: Invalid value: {taint.get('key')!r}")
    if not label_value_valid(taint.get("value", "")):
        raise ApiError(422, "Invalid", f"spec.taint.value: Invalid value: {taint.get('value')!r}")
    if taint.get("effect") not in DEVICE_TAINT_EFFECTS:
        raise ApiError(
            422,
            "Invalid",
            f'spec.taint.effect: Unsupported value: {taint.get("effect")!r}: supported values: "None", '
            '"NoExecute", "NoSchedule"',
        )


def _validate_slice(obj: dict[str, Any]) -> None:
    spec = obj.get("spec") or {}
    if not _DNS_SUBDOMAIN.match(spec.get("driver") or ""):
        raise ApiError(422, "Invalid", "spec.driver: Required value")
    if not (spec.get("pool") or {}).get("name"):
        raise ApiError(422, "Invalid", "spec.pool.name: Required value")
    selections = [key for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(key)]
    if len(selections) != 1:
        raise ApiError(422, "Invalid", "spec: exactly one of nodeName, nodeSelector, allNodes must be set")
    names = [device.get("name", "") for device in spec.get("devices") or []]
    for name in names:
        if not _DNS_LABEL.match(name):
            raise ApiError(422, "Invalid", f"spec.devices.name: Invalid value: {name!r}")
    if len(names) != len(set(names)):
        raise ApiError(422, "Invalid", "spec.devices: duplicate device name")
    for index, device in enumerate(spec.get("devices") or []):
        for key, attribute in (device.get("attributes") or {}).items():
            text = attribute.get("string") if isinstance(attribute, dict) else None
            if isinstance(text, str) and len(text.encode()) > ATTRIBUTE_STRING_LIMIT:
                raise ApiError(
                    422,
                    "Invalid",
                    f"spec.devices[{index}].attributes[{key}].string: Too long: may not be more than "
                    f"{ATTRIBUTE_STRING_LIMIT} bytes",
                )


EXTRA_VALIDATORS.update({"devicetaintrules": _validate_rule, "resourceslices": _validate_slice})


# --- routing ------------------------------------------------------------------------------------------------


def _served(api: ApiDouble, version: str, resource: str) -> bool:
    return resource in api.dra.get(version, ())


def _discovery(api: ApiDouble, group: str | None, version: str | None) -> dict[str, Any]:
    if group is None:
        groups = []
        if api.dra:
            versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in api.dra]
            groups.append({"name": GROUP, "versions": versions, "preferredVersion": versions[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    if group != GROUP or not api.dra or (version is not None and version not in api.dra):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    if version is None:
        versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in api.dra]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": versions}
    resources = [
        {
            "name": resource,
            "singularName": KINDS[resource].lower(),
            "namespaced": False,
            "kind": KINDS[resource],
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        }
        for resource in api.dra[version]
    ]
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{version}", "resources": resources}


def _answer(obj: dict[str, Any], version: str) -> dict[str, Any]:
    obj["apiVersion"] = f"{GROUP}/{version}"
    return obj


def _decode(resource: str, body: Any, query: dict[str, list[str]], warnings: list[str]) -> Any:
    """The body as the server decodes it: unknown fields refused under Strict, dropped otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
    unknown = unknown_fields(body, SCHEMAS[resource])
    mode = query.get("fieldValidation", ["Warn"])[0]
    if unknown and mode == "Strict":
        listed = ", ".join(f'unknown field "{field}"' for field in unknown)
        raise ApiError(400, "BadRequest", f"strict decoding error: {listed}")
    if unknown and mode == "Warn":
        warnings.extend(f'299 - "unknown field \\"{field}\\""' for field in unknown)
    return prune(body, SCHEMAS[resource])


def _field_selector(resource: str, query: dict[str, list[str]]) -> str:
    selector = query.get("fieldSelector", [""])[0]
    for term in filter(None, (t.strip() for t in selector.split(","))):
        label = re.split(r"!=|==|=", term, maxsplit=1)[0].strip()
        if label not in FIELD_LABELS[resource]:
            raise ApiError(400, "BadRequest", f'field label not supported: {label}: "{term}"')
    return selector


def _stamp_rule(new: dict[str, Any], old: dict[str, Any] | None) -> None:
    """What the server sets on a DeviceTaintRule: timeAdded, generation."""
    taint = new.setdefault("spec", {}).setdefault("taint", {})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    old_taint = ((old or {}).get("spec") or {}).get("taint") or {}
    if old is None:
        taint.setdefault("timeAdded", now)
    elif taint.get("effect") != old_taint.get("effect") and taint.get("timeAdded") in (
        None,
        old_taint.get("timeAdded"),
    ):
        taint["timeAdded"] = now
    elif "timeAdded" not in taint and "timeAdded" in old_taint:
        taint["timeAdded"] = old_taint["timeAdded"]


def _with_server_fields(resource: str, new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    metadata = new.setdefault("metadata", {})
    if old is None:
        metadata["generation"] = 1
    else:
        same_spec = new.get("spec") == old.get("spec")
        metadata["generation"] = (old["metadata"].get("generation") or 1) + (0 if same_spec else 1)
        new["status"] = copy.deepcopy(old.get("status") or {})
        if not new["status"]:
            new.pop("status")
    if resource == "devicetaintrules":
        _stamp_rule(new, old)
    return new


def route(
    api: ApiDouble,
    method: str,
    path: str,
    query: dict[str, list[str]],
    content_type: str,
    body: Any,
    warnings: list[str],
) -> tuple[int, Any]:
    match = _PATH.match(path)
    if match is None:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    group, version, resource, name = match["group"], match["version"], match["resource"], match["name"]
    if resource is None:
        if method != "GET":
            raise ApiError(405, "MethodNotAllowed", method)
        return 200, _discovery(api, group, version)
    if group != GROUP or version is None or resource not in KINDS or not _served(api, version, resource):
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    if match["sub"]:
        raise ApiError(405, "MethodNotAllowed", f"{method} on {resource}/status is the controllers' business")
    if method != "GET" and api.before_write is not None:
        api.before_write(method, path)
    if method == "GET" and name is None:
        items = api.list(resource, "", query.get("labelSelector", [""])[0], _field_selector(resource, query))
        head = {"resourceVersion": str(api.revision)}
        kind = KINDS[resource] + "List"
        return 200, {
            "apiVersion": f"{GROUP}/{version}",
            "kind": kind,
            "metadata": head,
            "items": [_answer(item, version) for item in items],
        }
    if method == "GET":
        return 200, _answer(api.get(resource, "", name), version)
    if method == "POST" and name is None:
        decoded = _decode(resource, body, query, warnings)
        decoded.pop("status", None)
        created = api.create(
            resource, "", _with_server_fields(resource, decoded, None), api_version=f"{GROUP}/{version}"
        )
        _controller_status(api, resource, None, created)
        return 201, _answer(created, version)
    if name is None:
        raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
    if method == "DELETE":
        preconditions = (body or {}).get("preconditions") if isinstance(body, dict) else None
        gone = api.delete(resource, "", name, preconditions=preconditions)
        return 200, kube_install.deleted_answer(resource, f"{GROUP}/{version}", gone)
    return _write(api, method, resource, version, name, query, content_type, body, warnings)


def _write(
    api: ApiDouble,
    method: str,
    resource: str,
    version: str,
    name: str,
    query: dict[str, list[str]],
    content_type: str,
    body: Any,
    warnings: list[str],
) -> tuple[int, Any]:
    decoded = _decode(resource, body, query, warnings)
    decoded.pop("status", None)
    with api.locked():
        current = api.get(resource, "", name)
        if method == "PUT":
            new = decoded
        elif method == "PATCH":
            new = api.patched(resource, current, content_type, decoded)
        else:
            raise ApiError(405, "MethodNotAllowed", method)
        wanted_rv = (decoded.get("metadata") or {}).get("resourceVersion")
        new.setdefault("metadata", {})["resourceVersion"] = wanted_rv or current["metadata"]["resourceVersion"]
        updated = api.update(resource, "", name, "", _with_server_fields(resource, new, current), patched=True)
    _controller_status(api, resource, current, updated)
    return 200, _answer(updated, version)


def _controller_status(api: ApiDouble, resource: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """kube-controller-manager's device-taint-eviction controller (gates on): right after a rule's create or spec
    change it writes the rule's status, so the resourceVersion the writer got back is stale at once."""
    if resource != "devicetaintrules" or not api.taint_controller:
        return
    if old is not None and old.get("spec") == new.get("spec"):
        return
    name = new["metadata"]["name"]
    with api.locked():
        stored = copy.deepcopy(api.get(resource, "", name))
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {
            "type": EVICTION_CONDITION,
            "status": "False",
            # As kube-controller-manager 1.36/1.37 write it for a taint that evicts nothing.
            "reason": "OtherEffect" if stored["spec"]["taint"].get("effect") != "NoExecute" else "Completed",
            "message": "Eviction only happens for the NoExecute effect.",
            "lastTransitionTime": now,
            "observedGeneration": stored["metadata"].get("generation", 1),
        }
        stored["status"] = {"conditions": [condition]}
        api.update(resource, "", name, "status", stored, patched=True)
