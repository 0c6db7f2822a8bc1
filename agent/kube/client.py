"""The Kubernetes client as the kube package uses it: loading credentials, one thin API surface, errors, backoff.

Every call the package makes goes through `KubeApi`, so the API verbs it needs (and deploy/rbac.yaml grants)
are the methods below and nothing else. Answers are read as raw JSON (`_preload_content=False`): the
generated models would cost more CPU than the whole reconcile and hide fields the double and the API send.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client.rest import ApiException

from agent.config import Config, KubernetesConfig

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
# An object's metadata without its body (the API server's PartialObjectMetadata transformation).
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
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
    """The budget ConfigMap's namespace: budget_namespace, else $POD_NAMESPACE, else the ServiceAccount's."""
    if policy.budget_namespace:
        return policy.budget_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        text = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        if text:
            return text
    return "node-health"


class BudgetConflict(Exception):
    """The budget ConfigMap kept changing under us: every compare-and-swap attempt lost."""


def classify(exc: BaseException) -> str:
    """The error kind of nodehealth_kube_errors_total (one of ERROR_KINDS)."""
    if isinstance(exc, ApiException):
        return _classify_status(exc.status or 0)
    if isinstance(exc, BudgetConflict):
        return "conflict"
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


def _raw(body: dict[str, Any]) -> Any:
    """A body as plain JSON: the client serializes a dict as it is (its typed models are for its callers)."""
    return body


def _json(response: Any) -> dict[str, Any]:
    try:
        return json.loads(response.data or b"{}")
    finally:
        response.release_conn()


class KubeApi:
    """The only Kubernetes calls of the package. Each returns the object as JSON (a dict)."""

    def __init__(self, client: Callable[[], kubernetes.client.ApiClient], timeout: float) -> None:
        self._client = client
        self._core: kubernetes.client.CoreV1Api | None = None
        self.timeout = timeout

    def core(self) -> kubernetes.client.CoreV1Api:
        if self._core is None:
            self._core = kubernetes.client.CoreV1Api(self._client())
        return self._core

    def _options(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": self.timeout}

    # nodes: get, list, patch; nodes/status: patch
    def get_node(self, name: str) -> dict[str, Any]:
        return _json(self.core().read_node(name, **self._options()))

    def list_nodes(self, selector: str = "", from_cache: bool = False) -> list[dict[str, Any]]:
        """from_cache: resourceVersion=0, served from the API server's watch cache instead of etcd."""
        version = "0" if from_cache else None
        answer = _json(
            self.core().list_node(label_selector=selector or None, resource_version=version, **self._options())
        )
        return list(answer.get("items") or [])

    def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self.core().patch_node(name, body, _content_type=STRATEGIC_MERGE, **self._options()))

    def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self.core().patch_node_status(name, body, _content_type=STRATEGIC_MERGE, **self._options()))

    # events: create
    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self.core().create_namespaced_event(namespace, _raw(body), **self._options()))

    # configmaps (the budget): get, create, update
    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        """None when it does not exist."""
        try:
            return _json(self.core().read_namespaced_config_map(name, namespace, **self._options()))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_configmap_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Only its metadata (a PartialObjectMetadata: no data); None when it does not exist."""
        try:
            answer = _json(
                self.core().read_namespaced_config_map(
                    name, namespace, _headers={"Accept": METADATA_ONLY}, **self._options()
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(answer.get("metadata") or {})

    def create_configmap(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self.core().create_namespaced_config_map(namespace, _raw(body), **self._options()))

    def replace_configmap(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return _json(self.core().replace_namespaced_config_map(name, namespace, _raw(body), **self._options()))
