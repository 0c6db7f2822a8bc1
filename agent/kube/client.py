"""The Kubernetes client as the kube package uses it: loading credentials, one thin API surface, errors, backoff.

Every call the package makes goes through `KubeApi`, so the API verbs it needs (and deploy/rbac.yaml grants)
are the methods below and nothing else. Answers are read as raw JSON: the generated models would cost more
CPU and memory than the whole reconcile and hide fields the double and the API send.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client.rest import ApiException

from agent.config import Config, KubernetesConfig

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
# An object's metadata without its body (the API server's PartialObjectMetadata transformation).
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
MERGE_PATCH = "application/merge-patch+json"
RESOURCE_GROUP = "resource.k8s.io"
# Unknown fields are refused (400), not dropped: servers >= 1.35 silently drop a DeviceTaintRule's old
# deviceClassName/selectors, and a selector that lost a field matches more devices than it said.
STRICT = [("fieldValidation", "Strict")]
DEVICE_SELECTOR_FIELDS = ("driver", "pool", "device")
ERROR_KINDS = ("unreachable", "timeout", "throttled", "server", "forbidden", "not_found", "conflict", "config", "other")


def load_api_client(config: Config) -> kubernetes.client.ApiClient:
    """kubernetes.kubeconfig if set; else the in-cluster ServiceAccount; else $KUBECONFIG or ~/.kube/config."""
    configuration = kubernetes.client.Configuration()
    explicit = config.kubernetes.kubeconfig
    if not explicit and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    else:
        path = explicit or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


def agent_namespace(policy: KubernetesConfig) -> str:
    """The budget ConfigMap's namespace: budget_namespace, else the pod's own (own_namespace)."""
    return policy.budget_namespace or own_namespace()


def own_namespace() -> str:
    """The namespace this runs in: $POD_NAMESPACE, else the ServiceAccount's, else node-health."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        text = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        if text:
            return text
    return "node-health"


class PartialDeviceSelector(ValueError):
    """A DeviceTaintRule whose deviceSelector does not name driver, pool and device: an empty or partial
    selector matches every device of the cluster (or of a driver, or of a pool), so it is never sent."""


def check_device_taint_rule(body: dict[str, Any]) -> None:
    """Raise PartialDeviceSelector unless the rule selects exactly one device: driver, pool and device, each a
    non-empty string, and nothing else."""
    spec = body.get("spec") if isinstance(body, dict) else None
    selector = spec.get("deviceSelector") if isinstance(spec, dict) else None
    if not isinstance(selector, dict):
        raise PartialDeviceSelector("a DeviceTaintRule without spec.deviceSelector is refused")
    missing = [key for key in DEVICE_SELECTOR_FIELDS if not isinstance(selector.get(key), str) or not selector[key]]
    extra = sorted(set(selector) - set(DEVICE_SELECTOR_FIELDS))
    if missing or extra:
        raise PartialDeviceSelector(
            f"deviceSelector must set exactly driver, pool and device (missing: {missing or 'none'}, "
            f"other fields: {extra or 'none'}): a partial selector matches more than one device"
        )


class BudgetConflict(Exception):
    """The budget ConfigMap kept changing under us: every compare-and-swap attempt lost."""


def classify(exc: BaseException) -> str:
    """The error kind of nodehealth_kube_errors_total (one of ERROR_KINDS)."""
    if isinstance(exc, ApiException):
        return _classify_status(exc.status or 0)
    if isinstance(exc, BudgetConflict):
        return "conflict"
    if isinstance(exc, PartialDeviceSelector):
        return "other"
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return "unreachable"  # a subclass of ConnectTimeoutError in urllib3 2, yet "connection refused"
    if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ConnectTimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        return classify(exc.reason) if exc.reason is not None else "unreachable"
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return "unreachable"
    if isinstance(exc, kubernetes.config.ConfigException):
        return "config"
    return "other"


def _classify_status(status: int) -> str:
    if status == 409:
        return "conflict"
    if status == 429:
        return "throttled"
    if status in (401, 403):
        return "forbidden"
    if status == 404:
        return "not_found"
    if status >= 500:
        return "server"
    return "other"


def is_status(exc: BaseException, *codes: int) -> bool:
    return isinstance(exc, ApiException) and exc.status in codes


def retry_after(exc: BaseException) -> float:
    """Seconds the server asked us to wait (429/503 Retry-After), 0 when it did not say."""
    headers = getattr(exc, "headers", None)
    if not headers:
        return 0.0
    try:
        return float(headers.get("Retry-After") or 0)
    except (TypeError, ValueError):
        return 0.0


def short_error(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        message = ""
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = json.loads(exc.body or "{}").get("message", "")
        return f"HTTP {exc.status} {exc.reason or ''} {message}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]


@dataclass
class Backoff:
    """Exponential backoff with jitter: the n-th consecutive failure waits between half and all of
    min(cap, initial * 2**(n-1)), so a thousand agents that failed together do not retry in step."""

    initial: float
    cap: float
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self, at_least: float = 0.0) -> float:
        self.failures += 1
        ceiling = min(self.cap, self.initial * 2 ** min(self.failures - 1, 30))
        delay = ceiling / 2 + self.rng.uniform(0, ceiling / 2)
        return max(delay, min(at_least, self.cap))

    def reset(self) -> None:
        self.failures = 0


class KubeApi:
    """The only Kubernetes calls of the package. Each returns the object as JSON (a dict).

    Requests go through the client's `ApiClient` (its credentials, token refresh, TLS and connection pool),
    not through the generated `CoreV1Api`: importing that class builds ~250 pydantic models, 22 MiB of the
    agent's memory, to serve eight calls whose answers are read as raw JSON anyway."""

    def __init__(self, client: Callable[[], kubernetes.client.ApiClient], timeout: float) -> None:
        self._client = client
        self._api_client: kubernetes.client.ApiClient | None = None
        self.timeout = timeout

    def api_client(self) -> kubernetes.client.ApiClient:
        if self._api_client is None:
            self._api_client = self._client()
        return self._api_client

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> dict[str, Any]:
        """One request; the answer as JSON, or ApiException for any status outside 2xx."""
        client = self.api_client()
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, serialized, _ = client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        answer = client.call_api(method, url, header_params=headers, body=serialized, _request_timeout=self.timeout)
        try:
            data = answer.read()
        finally:
            answer.response.release_conn()
        if not 200 <= answer.status <= 299:
            text = data.decode("utf-8", "replace") if data else None
            raise ApiException.from_response(http_resp=answer, body=text, data=None)
        return json.loads(data or b"{}")

    # nodes: get, list, patch; nodes/status: patch
    def get_node(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/nodes/{quote(name, safe='')}")

    def list_nodes(self, selector: str = "", from_cache: bool = False) -> list[dict[str, Any]]:
        """from_cache: resourceVersion=0, served from the API server's watch cache instead of etcd."""
        query = [("labelSelector", selector)] if selector else []
        if from_cache:
            query.append(("resourceVersion", "0"))
        return list(self._call("GET", "/api/v1/nodes", query=query).get("items") or [])

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", f"/api/v1/nodes/{quote(name, safe='')}", body=body, content_type=STRATEGIC_MERGE)

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        path = f"/api/v1/nodes/{quote(name, safe='')}/status"
        return self._call("PATCH", path, body=body, content_type=STRATEGIC_MERGE)

    # pods: list (this node's, metadata only, from the API server's cache)
    def list_node_pods_metadata(self, node: str, scheduler: str = "") -> list[dict[str, Any]]:
        """The metadata of the pods bound to `node` (spec.nodeName field selector, resourceVersion=0: served from
        the watch cache, not etcd; no spec or status); with `scheduler`, only the pods it placed
        (spec.schedulerName, a field selector the API server serves for pods)."""
        selector = f"spec.nodeName={node}" + (f",spec.schedulerName={scheduler}" if scheduler else "")
        query = [("fieldSelector", selector), ("resourceVersion", "0")]
        answer = self._call("GET", "/api/v1/pods", query=query, accept=METADATA_LIST)
        return [dict(item.get("metadata") or {}) for item in answer.get("items") or []]

    # events: create
    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/api/v1/namespaces/{quote(namespace, safe='')}/events", body=body)

    # configmaps (the budget): get, create, update
    def _configmap_path(self, namespace: str, name: str = "") -> str:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/configmaps"
        return f"{path}/{quote(name, safe='')}" if name else path

    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        """None when it does not exist."""
        try:
            return self._call("GET", self._configmap_path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_configmap_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Only its metadata (a PartialObjectMetadata: no data); None when it does not exist."""
        try:
            answer = self._call("GET", self._configmap_path(namespace, name), accept=METADATA_ONLY)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(answer.get("metadata") or {})

    def create_configmap(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self._configmap_path(namespace), body=body)

    def replace_configmap(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PUT", self._configmap_path(namespace, name), body=body)

    def list_configmaps(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The public-fault ConfigMaps of the agents (by label), in one namespace."""
        query = [("labelSelector", selector)] if selector else []
        return list(self._call("GET", self._configmap_path(namespace), query=query).get("items") or [])

    # resource.k8s.io: discovery (a non-resource URL every authenticated user may read), resourceslices: list,
    # devicetaintrules: create, get, list, patch, delete. Versions are what discovery found.
    def get_resource_api(self, version: str) -> dict[str, Any] | None:
        """The APIResourceList of resource.k8s.io/<version>; None when the server does not serve it."""
        try:
            return self._call("GET", f"/apis/{RESOURCE_GROUP}/{quote(version, safe='')}")
        except ApiException as exc:
            if exc.status in (404, 503):  # 503: an aggregated group whose backend is away
                return None
            raise

    def _resource_path(self, version: str, resource: str, name: str = "") -> str:
        path = f"/apis/{RESOURCE_GROUP}/{quote(version, safe='')}/{resource}"
        return f"{path}/{quote(name, safe='')}" if name else path

    def list_resource_slices(self, version: str, node: str | None = None, from_cache: bool = False) -> list[Any]:
        """A node's slices (field selector spec.nodeName), or every slice (the device budget's count)."""
        query = [("fieldSelector", f"spec.nodeName={node}")] if node is not None else []
        if from_cache:
            query.append(("resourceVersion", "0"))
        return list(self._call("GET", self._resource_path(version, "resourceslices"), query=query).get("items") or [])

    def list_device_taint_rules(self, version: str, selector: str) -> list[dict[str, Any]]:
        query = [("labelSelector", selector)]
        return list(self._call("GET", self._resource_path(version, "devicetaintrules"), query=query).get("items") or [])

    def get_device_taint_rule(self, version: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self._resource_path(version, "devicetaintrules", name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_device_taint_rule(self, version: str, body: dict[str, Any]) -> dict[str, Any]:
        check_device_taint_rule(body)
        return self._call("POST", self._resource_path(version, "devicetaintrules"), query=STRICT, body=body)

    def patch_device_taint_rule(self, version: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch carrying the rule's resourceVersion and its whole spec (checked like a create)."""
        check_device_taint_rule(body)
        path = self._resource_path(version, "devicetaintrules", name)
        return self._call("PATCH", path, query=STRICT, body=body, content_type=MERGE_PATCH)

    def delete_device_taint_rule(self, version: str, name: str, resource_version: str) -> None:
        """Deletes only the version that was read (a 409 otherwise); a rule already gone is no error."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": resource_version}}
        try:
            self._call("DELETE", self._resource_path(version, "devicetaintrules", name), body=body)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # Any kind by its path: what `node-health uninstall` removes of the install (agent.kube.ops.uninstall).
    def get_object(self, path: str) -> dict[str, Any] | None:
        """None when it does not exist."""
        try:
            return self._call("GET", path)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_objects(self, path: str, selector: str) -> list[dict[str, Any]] | None:
        """The objects under `path` that `selector` selects; None when the server does not serve the kind."""
        try:
            return list(self._call("GET", path, query=[("labelSelector", selector)]).get("items") or [])
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def merge_patch_object(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete_object(self, path: str, uid: str, grace_seconds: int | None = None) -> bool:
        """Deletes that object (its uid a precondition: not one created since under the same name), its dependents
        in the background; grace_seconds 0: a pod at once, without waiting for its kubelet. False when it was
        already gone."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "propagationPolicy": "Background",
            "preconditions": {"uid": uid},
        }
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            self._call("DELETE", path, body=body)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True


def run_command(config: Config, command: str, body: Callable[[KubeApi], int]) -> int:
    """A command run by an operator (`node-health cleanup`, `uninstall`, `fleet`): `body` with the API, its exit
    status; 1, said on stderr, when there are no credentials."""
    try:
        client = load_api_client(config)
    except Exception as exc:  # noqa: BLE001 - no kubeconfig, no service account: say so
        print(f"node-health {command}: cannot load Kubernetes credentials: {exc}", file=sys.stderr)
        return 1
    try:
        return body(KubeApi(lambda: client, config.kubernetes.request_timeout_seconds))
    finally:
        client.close()
