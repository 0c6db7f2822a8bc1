"""The API double's kinds of an install (what `kubectl apply -k deploy/` creates) and the API's deletion semantics
that an uninstall relies on, as kube-apiserver and kube-controller-manager do them:

- namespaces, serviceaccounts, services, resourcequotas (core), daemonsets (apps/v1), jobs (batch/v1), cluster
  roles and bindings, roles and bindings (rbac.authorization.k8s.io/v1), validating admission policies and bindings
  (admissionregistration.k8s.io/v1), network policies (networking.k8s.io/v1) and, with `ApiDouble.prometheus_operator`,
  the operator's podmonitors and prometheusrules (monitoring.coreos.com/v1; otherwise 404, as where its CRDs are not
  installed): get, list (label selectors, one namespace or all), create, replace, merge and JSON patch, delete with
  DeleteOptions preconditions;
- graceful deletion of a pod bound to a node: DELETE sets `deletionTimestamp` and the pod stays (Terminating) until
  its kubelet deletes it again with `gracePeriodSeconds: 0`, once its containers are stopped (a test plays the
  kubelet);
- the garbage collector, in the background: an object deleted takes with it every object whose ownerReferences it
  was the last existing owner of (a DaemonSet its pods, gracefully; a Namespace the cluster-scoped objects handed
  to it);
- namespace deletion: the namespace turns Terminating (creates in it are 403), everything in it is deleted (pods
  gracefully), and the namespace itself goes when nothing is left in it.

This module routes the paths; the store, its locking and resourceVersions are the double's (kube_double.py).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from support.kube_semantics import APPLY, KINDS, NAMESPACED, ApiError

if TYPE_CHECKING:
    from support.kube_double import ApiDouble

# group/version → resource → (kind, namespaced)
GROUPS: dict[str, dict[str, tuple[str, bool]]] = {
    "v1": {
        "namespaces": ("Namespace", False),
        "serviceaccounts": ("ServiceAccount", True),
        "services": ("Service", True),
        "resourcequotas": ("ResourceQuota", True),
    },
    "apps/v1": {"daemonsets": ("DaemonSet", True)},
    "batch/v1": {"jobs": ("Job", True)},
    "rbac.authorization.k8s.io/v1": {
        "clusterroles": ("ClusterRole", False),
        "clusterrolebindings": ("ClusterRoleBinding", False),
        "roles": ("Role", True),
        "rolebindings": ("RoleBinding", True),
    },
    "admissionregistration.k8s.io/v1": {
        "validatingadmissionpolicies": ("ValidatingAdmissionPolicy", False),
        "validatingadmissionpolicybindings": ("ValidatingAdmissionPolicyBinding", False),
    },
    "admissionregistration.k8s.io/v1beta1": {
        "mutatingadmissionpolicies": ("MutatingAdmissionPolicy", False),
        "mutatingadmissionpolicybindings": ("MutatingAdmissionPolicyBinding", False),
    },
    "networking.k8s.io/v1": {"networkpolicies": ("NetworkPolicy", True)},
    "monitoring.coreos.com/v1": {"podmonitors": ("PodMonitor", True), "prometheusrules": ("PrometheusRule", True)},
}
OPERATOR_GROUP = "monitoring.coreos.com/v1"
for _resources in GROUPS.values():
    for _resource, (_kind, _namespaced) in _resources.items():
        KINDS[_resource] = _kind
        if _namespaced:
            NAMESPACED.add(_resource)
# A kind's apiVersion by its resource (where the double stores every kind under its resource name).
API_VERSIONS = {resource: gv for gv, resources in GROUPS.items() for resource in resources}

_CORE = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?$|"
    r"^/api/v1/(?P<resource2>namespaces)(?:/(?P<name2>[^/]+))?$"
)
_GROUP = re.compile(
    r"^/apis/(?P<gv>[^/]+/[^/]+)/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?$"
)


def resource_of(kind: str) -> str:
    """The resource that stores `kind` (for creating the documents of a rendered manifest)."""
    for resources in GROUPS.values():
        for resource, (name, _) in resources.items():
            if name == kind:
                return resource
    for resource, name in KINDS.items():
        if name == kind:
            return resource
    raise KeyError(kind)


def route(
    api: ApiDouble, method: str, path: str, query: dict[str, list[str]], content_type: str, body: Any
) -> tuple[int, Any]:
    group_version, namespace, resource, name = _parse(api, path)
    if (resource in NAMESPACED) != bool(namespace) and not (method == "GET" and name is None):
        raise ApiError(404, "NotFound", f"no such path {path}")
    if method != "GET" and api.before_write is not None:
        api.before_write(method, path)
    if method == "GET" and name is None:
        items = api.list(resource, namespace or None, query.get("labelSelector", [""])[0])
        head = {"resourceVersion": str(api.revision)}
        return 200, {"apiVersion": group_version, "kind": KINDS[resource] + "List", "metadata": head, "items": items}
    if method == "GET":
        return 200, api.get(resource, namespace, name or "")
    if method == "POST" and name is None:
        return 201, api.create(resource, namespace, body or {}, api_version=group_version)
    if name is None:
        raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
    if method == "PUT":
        return 200, api.update(resource, namespace, name, "", body or {}, patched=False)
    if method == "PATCH" and content_type == APPLY:
        return api.apply(resource, namespace, name, "", body, query, api_version=group_version)
    if method == "PATCH":
        return 200, api.patch(resource, namespace, name, "", content_type, body)
    if method == "DELETE":
        gone = api.delete(resource, namespace, name, *delete_options(body, query))
        return 200, deleted_answer(resource, group_version, gone)
    raise ApiError(405, "MethodNotAllowed", method)


# Kinds whose DELETE answers the object (its deletionTimestamp set, or as it was), as kube-apiserver's stores for
# them do; every other kind answers a Status naming what went.
_DELETE_RETURNS_OBJECT = {"pods", "namespaces"}


def deleted_answer(resource: str, group_version: str, gone: dict[str, Any]) -> dict[str, Any]:
    """The answer to a DELETE of `gone` (a `resource` of `group_version`)."""
    if resource in _DELETE_RETURNS_OBJECT:
        return gone
    details = {"name": gone["metadata"]["name"], "kind": resource, "uid": gone["metadata"].get("uid", "")}
    if "/" in group_version:
        details = {"name": details["name"], "group": group_version.split("/")[0], **details}
    return {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}, "details": details}


def delete_options(body: Any, query: dict[str, list[str]]) -> tuple[dict[str, Any] | None, int | None]:
    """(preconditions, gracePeriodSeconds) of a DELETE: DeleteOptions in its body, the grace also in its query."""
    options = body if isinstance(body, dict) else {}
    grace = query.get("gracePeriodSeconds", [options.get("gracePeriodSeconds")])[0]
    return options.get("preconditions"), None if grace is None else int(grace)


def _parse(api: ApiDouble, path: str) -> tuple[str, str, str, str | None]:
    """(group/version, namespace, resource, name) of a path this module serves; 404 for any other."""
    match = _GROUP.match(path)
    if match is not None:
        group_version = match["gv"]
        resource, namespace, name = match["resource"], match["ns"] or "", match["name"]
    else:
        match = _CORE.match(path)
        if match is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
        group_version = "v1"
        if match["resource2"]:
            resource, namespace, name = match["resource2"], "", match["name2"]
        else:
            resource, namespace, name = match["resource"], match["ns"] or "", match["name"]
    served = GROUPS.get(group_version, {})
    if resource not in served or (group_version == OPERATOR_GROUP and not api.prometheus_operator):
        raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
    return group_version, namespace, resource, name


# --- deletion: graceful pods, the garbage collector, namespaces ------------------------------------------------


def delete(api: ApiDouble, key: tuple[str, str, str], grace_seconds: int | None) -> dict[str, Any]:
    """Deletes the stored object at `key` (under the store lock) the way the API and its controllers do."""
    resource, namespace, name = key
    current = api.stored(key)
    meta = current["metadata"]
    if resource == "pods" and (current.get("spec") or {}).get("nodeName") and grace_seconds != 0:
        if not meta.get("deletionTimestamp"):
            current["metadata"]["deletionTimestamp"] = _now()
            current["metadata"]["deletionGracePeriodSeconds"] = 30 if grace_seconds is None else grace_seconds
            api.store(key, current)
        return current
    if resource == "namespaces":
        if not meta.get("deletionTimestamp"):
            current["metadata"]["deletionTimestamp"] = _now()
            current.setdefault("status", {})["phase"] = "Terminating"
            api.store(key, current)
        for inner in [k for k in api.stored_keys() if k[1] == name]:
            if api.has(inner):
                delete(api, inner, None)
        _finish_namespace(api, name)
        return current
    removed = api.remove(key)
    _collect(api, removed["metadata"].get("uid", ""))
    if namespace:
        _finish_namespace(api, namespace)
    return removed


def refuse_create_in_terminating(api: ApiDouble, namespace: str) -> None:
    key = ("namespaces", "", namespace)
    if namespace and api.has(key) and api.stored(key)["metadata"].get("deletionTimestamp"):
        raise ApiError(
            403,
            "Forbidden",
            f"unable to create new content in namespace {namespace} because it is being terminated",
        )


def _collect(api: ApiDouble, uid: str) -> None:
    """The garbage collector: the dependents whose owners are all gone now, deleted in the background."""
    if not uid:
        return
    for key in list(api.stored_keys()):
        if not api.has(key):
            continue
        owners = api.stored(key)["metadata"].get("ownerReferences") or []
        if uid not in {o.get("uid") for o in owners}:
            continue
        living = {m["metadata"].get("uid") for m in (api.stored(k) for k in api.stored_keys())}
        if not any(o.get("uid") in living for o in owners if o.get("uid") != uid):
            delete(api, key, None)


def _finish_namespace(api: ApiDouble, namespace: str) -> None:
    key = ("namespaces", "", namespace)
    if not api.has(key) or not api.stored(key)["metadata"].get("deletionTimestamp"):
        return
    if any(k[1] == namespace for k in api.stored_keys()):
        return
    removed = api.remove(key)
    _collect(api, removed["metadata"].get("uid", ""))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
