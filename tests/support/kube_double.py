"""An in-repo Kubernetes API double, served over HTTP on 127.0.0.1, used by the real `kubernetes` client.

The Kubernetes API cannot be installed here, so this implements the semantics the agent relies on, the
way kube-apiserver does them:

- nodes (with the `status` subresource), configmaps and events: get, list (label and field selectors),
  create, replace, delete, and PATCH in the three kinds: strategic-merge (conditions and addresses merged
  by `type`, `$patch: delete|replace` directives, the taint list atomic), JSON merge (RFC 7386) and JSON
  patch (RFC 6902, `test` included);
- every write bumps a cluster-wide `resourceVersion`; a PATCH or PUT that carries a stale
  `metadata.resourceVersion` is refused with 409 Conflict (optimistic concurrency, ConfigMap CAS);
- a write to `nodes/{name}` ignores status, a write to `nodes/{name}/status` changes only status;
- validation as kube-apiserver's: taint effects and duplicates, label syntax, object names (DNS subdomains),
  annotations up to 256 KiB in all, a Node's Events only in `default`, creates only in an existing namespace
  (404), a PUT's name matching its URL (400), server-side apply by one field manager (created when missing;
  fieldManager required), label and field selector syntax (400); a condition's status is not
  checked (the real server stores any string); DELETE answers a Status naming what went (a pod or namespace: the
  object), an empty metadata list `items: null` (tests/realkube/test_realkube_vs_double.py compares both);
- faults: 409, 429 (with Retry-After), 500, 403, slow answers, reset connections, and a whole outage
  (listener closed, live connections cut: the client sees connection refused);
- a Node created over HTTP is born with the `node.kubernetes.io/not-ready:NoSchedule` taint, as admission gives
  it (`add_node` stores one as given);
- `resource.k8s.io` (kube_dra.py): discovery of v1 / v1beta2 or no DRA at all, ResourceSlices with field
  selectors, DeviceTaintRules with strict field validation (`serve_dra(release)`; none by default);
- the kinds of an install (kube_install.py: namespaces, DaemonSets, RBAC, admission policies, ...), graceful pod
  deletion, the garbage collector (ownerReferences) and namespace deletion, which an uninstall relies on.

Every write is recorded (`double.writes`) so tests can count the API writes an agent makes; every request,
its query and the bytes of its answer too (`double.log`), so tests can check which verbs the agent uses and
benchmarks can count what a fleet of agents costs the API server. `resourceVersion=0` on a list (served from
the watch cache by a real API server) is accepted and answered like any list; a GET that asks for
`as=PartialObjectMetadata` in its Accept header gets the object's metadata only, as from the API server.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import kubernetes.client
import yaml

from support import kube_dra, kube_install
from support.kube_semantics import (
    APPLY,
    JSON_PATCH,
    KINDS,
    MERGE,
    NAMESPACED,
    STRATEGIC,
    ApiError,
    check_selectors,
    field_selector_matches,
    json_patch,
    label_selector_matches,
    merge_patch,
    strategic_merge,
    validate_object,
)
from support.system import assert_system_test

__all__ = [
    "ApiDouble",
    "ApiError",
    "Fault",
    "Request",
    "Write",
    "json_patch",
    "label_selector_matches",
    "merge_patch",
    "running_double",
    "strategic_merge",
]

# --- fault injection -------------------------------------------------------------------------------


@dataclass
class Fault:
    method: str | None  # None: any method
    path: re.Pattern[str]
    status: int | None = None  # answer with this error
    delay: float = 0.0  # sleep before answering (slow API)
    reset: bool = False  # cut the connection without answering
    retry_after: int | None = None
    times: int = 1  # how many requests it hits; -1 forever

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and bool(self.path.search(path))


@dataclass(frozen=True)
class Write:
    method: str
    path: str
    content_type: str
    body: Any
    status: int
    at: float


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    status: int
    sent: int  # bytes of the answer's body
    accept: str = ""
    token: str = ""  # the bearer token it carried: whose request it was


@dataclass
class _Store:
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    # The stored objects as JSON, so a list of 2,000 Nodes costs a join, not 2,000 deep copies.
    encoded: dict[tuple[str, str, str], str] = field(default_factory=dict)
    revision: int = 100


# --- the server ------------------------------------------------------------------------------------


class ApiDouble:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._store = _Store()
        self._faults: list[Fault] = []
        self.writes: list[Write] = []
        self.requests: list[tuple[str, str]] = []
        self.log: list[Request] = []
        self.bytes_sent = 0
        # (resource, namespace, name) of the last object stored: lets after_write look at only what changed.
        self.last_saved: tuple[str, str, str] | None = None
        # Called (outside the store lock) before each write is applied: lets a test act as a concurrent
        # foreign writer exactly between an agent's read and its write.
        self.before_write: Callable[[str, str], None] | None = None
        # Called under the store lock after every stored change: lets a test check an invariant at each step.
        self.after_write: Callable[[ApiDouble], None] | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self.port = 0
        self.down = False
        # When set, every request must carry `Authorization: Bearer <token>`, else 401 (as the API server's
        # authenticator answers before anything else).
        self.token: str | None = None
        # resource.k8s.io as a release serves it: version → resources (kube_dra.RELEASES); empty: no DRA.
        self.dra: dict[str, tuple[str, ...]] = {}
        # Whether a device-taint-eviction controller writes each DeviceTaintRule's status (kube_dra).
        self.taint_controller = True
        # Whether the Prometheus Operator's CRDs are installed (monitoring.coreos.com/v1 served).
        self.prometheus_operator = False
        # Namespaces that exist without a stored Namespace object (a cluster's own, the agent's, which most tests
        # do not install, and MindCluster's, for public faults): a create over HTTP in any other namespace not
        # stored is a 404, as from the API.
        self.implied_namespaces = {
            "default",
            "kube-system",
            "kube-public",
            "kube-node-lease",
            "node-health",
            "mindx-dl",
        }

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> ApiDouble:
        double = self

        class Handler(_Handler):
            api = double

        server = _Server(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.down = False
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def outage(self) -> None:
        """The API goes away: new connections are refused, live keep-alive connections are cut."""
        self.down = True
        self.stop()

    def restore(self) -> None:
        self.start()

    def __enter__(self) -> ApiDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(kubernetes.client.Configuration(host=self.host))

    def write_kubeconfig(self, path: Path, user: str = "agent", token: str = "t") -> Path:
        """A kubeconfig whose current context is this double, as `user` with a bearer `token`."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "double", "cluster": {"server": self.host}}],
                    "users": [{"name": user, "user": {"token": token}}],
                    "contexts": [{"name": "double", "context": {"cluster": "double", "user": user}}],
                    "current-context": "double",
                }
            )
        )
        return path

    # --- faults --------------------------------------------------------------------------------

    def inject(
        self,
        path: str = "",
        method: str | None = None,
        status: int | None = None,
        delay: float = 0.0,
        reset: bool = False,
        retry_after: int | None = None,
        times: int = 1,
    ) -> Fault:
        fault = Fault(method, re.compile(path), status, delay, reset, retry_after, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path):
                    if fault.times > 0:
                        fault.times -= 1
                        if fault.times == 0:
                            self._faults.remove(fault)
                    return fault
        return None

    # --- direct access for tests (what other controllers and kubectl would do) ------------------

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, Any]] | None = None,
        conditions: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"taints": list(taints or [])} if taints else {},
            "status": {"conditions": list(conditions or [])},
        }
        return self.create("nodes", "", body, keep_status=True)

    def add_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        uid: str = "",
        annotations: dict[str, str] | None = None,
        scheduler: str = "default-scheduler",
    ) -> dict[str, Any]:
        """A pod bound to `node` (spec.nodeName), with the UID its cgroup would carry when given, placed by
        `scheduler` (spec.schedulerName, which the API server defaults to default-scheduler)."""
        spec = {"nodeName": node, "schedulerName": scheduler}
        body = {"metadata": {"name": name, "annotations": dict(annotations or {})}, "spec": spec}
        self.create("pods", namespace, body)
        if uid:
            self.mutate("pods", namespace, name, lambda pod: pod["metadata"].__setitem__("uid", uid))
        return self.get("pods", namespace, name)

    def node(self, name: str) -> dict[str, Any]:
        return self.get("nodes", "", name)

    def nodes(self) -> list[dict[str, Any]]:
        return self.list("nodes", "")

    def configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.get("configmaps", namespace, name)
        except ApiError:
            return None

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.list("events", namespace)

    def mutate(self, resource: str, namespace: str, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        """A foreign writer's read-modify-write (bumps resourceVersion, so the agent's next write conflicts)."""
        with self._lock:
            obj = copy.deepcopy(self._store.objects[(resource, namespace, name)])
            change(obj)
            validate_object(resource, obj)
            self._save(resource, namespace, name, obj)

    def foreign_write_before_ours(self, node: str, label: tuple[str, str] = ("other", "writer")) -> None:
        """Once, just before the next write to Node `node`, another writer sets `label` on it: that write then
        conflicts (a strategic patch carrying the old resourceVersion gets 409)."""
        fired: list[bool] = []

        def interpose(method: str, path: str) -> None:
            if path == f"/api/v1/nodes/{node}" and not fired:
                fired.append(True)
                self.mutate("nodes", "", node, lambda obj: obj["metadata"]["labels"].update({label[0]: label[1]}))

        self.before_write = interpose

    # --- resource.k8s.io ------------------------------------------------------------------------

    def serve_dra(self, release: str) -> None:
        """Serve resource.k8s.io as Kubernetes `release` does ("1.37", "1.36", "1.36-no-taint-rules", "none")."""
        self.dra = dict(kube_dra.RELEASES[release])
        self.taint_controller = release != "1.36-no-taint-rules"

    def device_taint_rules(self, label_selector: str = "") -> list[dict[str, Any]]:
        return self.list("devicetaintrules", "", label_selector)

    def locked(self) -> threading.RLock:
        """The store lock, for a read-modify-write that must not interleave with another request."""
        return self._lock

    def node_writes(self, node: str) -> list[Write]:
        pattern = re.compile(rf"^/api/v1/nodes/{re.escape(node)}(/status)?$")
        return [w for w in self.writes if pattern.match(w.path) and w.status < 300]

    # --- store operations ----------------------------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._store.objects.get((resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            return copy.deepcopy(obj)

    def list(
        self, resource: str, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> list[dict[str, Any]]:
        with self._lock:
            return [
                copy.deepcopy(obj)
                for (res, ns, _), obj in sorted(self._store.objects.items())
                if res == resource
                and (namespace is None or ns == namespace)
                and label_selector_matches(label_selector, obj["metadata"].get("labels") or {})
                and field_selector_matches(field_selector, obj)
            ]

    def list_json(
        self, resource: str, namespace: str | None, label_selector: str = "", field_selector: str = ""
    ) -> str:
        """The List document as the HTTP answer sends it, built from the stored JSON (no copies)."""
        with self._lock:
            items = [
                self._store.encoded[key]
                for key, obj in sorted(self._store.objects.items())
                if key[0] == resource
                and (namespace is None or key[1] == namespace)
                and label_selector_matches(label_selector, obj["metadata"].get("labels") or {})
                and field_selector_matches(field_selector, obj)
            ]
            head = {"apiVersion": "v1", "kind": KINDS[resource] + "List", "metadata": {"resourceVersion": ""}}
            head["metadata"]["resourceVersion"] = str(self._store.revision)
        return json.dumps(head)[:-1] + ', "items": [' + ", ".join(items) + "]}"

    def create(
        self,
        resource: str,
        namespace: str,
        body: dict[str, Any],
        keep_status: bool = False,
        api_version: str = "v1",
    ) -> dict[str, Any]:
        body = copy.deepcopy(body)
        metadata = body.setdefault("metadata", {})
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = metadata["generateName"] + uuid.uuid4().hex[:5]
        name = metadata.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if resource == "nodes" and not keep_status:
            body.pop("status", None)
        with self._lock:
            if (resource, namespace, name) in self._store.objects:
                raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
            if metadata.get("resourceVersion"):
                raise ApiError(400, "BadRequest", "resourceVersion should not be set on objects to be created")
            metadata["uid"] = str(uuid.uuid4())
            metadata["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            kube_install.refuse_create_in_terminating(self, namespace)
            if namespace:
                metadata["namespace"] = namespace
            body["apiVersion"] = api_version
            body["kind"] = KINDS[resource]
            validate_object(resource, body)
            return self._save(resource, namespace, name, body)

    def _save(self, resource: str, namespace: str, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._store.revision += 1
        obj["metadata"]["resourceVersion"] = str(self._store.revision)
        self._store.objects[(resource, namespace, name)] = obj
        self._store.encoded[(resource, namespace, name)] = json.dumps(obj)
        self.last_saved = (resource, namespace, name)
        if self.after_write is not None:
            self.after_write(self)
        return copy.deepcopy(obj)

    def update(
        self, resource: str, namespace: str, name: str, subresource: str, new: dict[str, Any], patched: bool
    ) -> dict[str, Any]:
        with self._lock:
            current = self._store.objects.get((resource, namespace, name))
            if current is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
            current_rv = current["metadata"]["resourceVersion"]
            if wanted_rv and wanted_rv != current_rv:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                )
            result = copy.deepcopy(new)
            if resource == "nodes":
                if subresource == "status":
                    result = copy.deepcopy(current)
                    result["status"] = copy.deepcopy(new.get("status") or {})
                else:
                    result["status"] = copy.deepcopy(current.get("status") or {})
            for immutable in ("name", "uid", "creationTimestamp", "namespace"):
                if immutable in current["metadata"]:
                    result.setdefault("metadata", {})[immutable] = current["metadata"][immutable]
            result["apiVersion"], result["kind"] = current.get("apiVersion", "v1"), KINDS[resource]
            validate_object(resource, result)
            if _without_rv(result) == _without_rv(current):
                return copy.deepcopy(current)  # a no-op write does not bump resourceVersion
            return self._save(resource, namespace, name, result)

    def delete(
        self,
        resource: str,
        namespace: str,
        name: str,
        preconditions: dict[str, Any] | None = None,
        grace_seconds: int | None = None,
    ) -> dict[str, Any]:
        """DeleteOptions.preconditions (uid, resourceVersion) that do not hold are a 409, as from the API. A pod on a
        node is deleted gracefully, a namespace with its content, dependents by the garbage collector
        (kube_install.py)."""
        with self._lock:
            current = self._store.objects.get((resource, namespace, name))
            if current is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            for key in ("uid", "resourceVersion"):
                wanted = (preconditions or {}).get(key)
                if wanted and wanted != current["metadata"].get(key):
                    raise ApiError(
                        409,
                        "Conflict",
                        f"Precondition failed: {key}: {wanted}, actual: {current['metadata'].get(key)}",
                    )
            return kube_install.delete(self, (resource, namespace, name), grace_seconds)

    def require_namespace(self, namespace: str) -> None:
        """A create in a namespace that does not exist is a 404 naming the namespace."""
        if namespace not in self.implied_namespaces and not self.has(("namespaces", "", namespace)):
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')

    # The store under its lock, for kube_install's deletion semantics.
    def stored_keys(self) -> list[tuple[str, str, str]]:
        return sorted(self._store.objects)

    def has(self, key: tuple[str, str, str]) -> bool:
        return key in self._store.objects

    def stored(self, key: tuple[str, str, str]) -> dict[str, Any]:
        return copy.deepcopy(self._store.objects[key])

    def store(self, key: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        return self._save(*key, obj)

    def remove(self, key: tuple[str, str, str]) -> dict[str, Any]:
        obj = self._store.objects.pop(key)
        self._store.encoded.pop(key, None)
        self._store.revision += 1
        return obj

    def patch(
        self, resource: str, namespace: str, name: str, subresource: str, content_type: str, patch: Any
    ) -> dict[str, Any]:
        with self._lock:
            new = self.patched(resource, self.get(resource, namespace, name), content_type, patch)
            return self.update(resource, namespace, name, subresource, new, patched=True)

    def apply(
        self,
        resource: str,
        namespace: str,
        name: str,
        subresource: str,
        patch: Any,
        query: dict[str, list[str]],
        api_version: str = "v1",
    ) -> tuple[int, dict[str, Any]]:
        """Server-side apply (application/apply-patch+yaml), for one field manager: the object created when it
        is missing (201), else the applied fields merged in as a JSON merge patch would (200). Field ownership
        and conflicts between managers are not modelled."""
        if not query.get("fieldManager", [""])[0]:
            raise ApiError(
                422,
                "Invalid",
                "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value: is required for apply patch",
            )
        if not isinstance(patch, dict):
            raise ApiError(400, "BadRequest", "the body of an apply patch must be an object")
        with self._lock:
            if not self.has((resource, namespace, name)):
                if subresource:
                    raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
                if namespace:
                    self.require_namespace(namespace)
                return 201, self.create(resource, namespace, patch, api_version=api_version)
            return 200, self.patch(resource, namespace, name, subresource, MERGE, patch)

    @staticmethod
    def patched(resource: str, current: dict[str, Any], content_type: str, patch: Any) -> dict[str, Any]:
        """`current` with `patch` applied, in the patch type the Content-Type names."""
        if content_type == STRATEGIC:
            if resource not in KINDS:
                raise ApiError(415, "UnsupportedMediaType", "strategic merge patch needs a built-in type")
            return dict(strategic_merge(current, patch))
        if content_type == MERGE:
            return dict(merge_patch(current, patch))
        if content_type == JSON_PATCH:
            return dict(json_patch(current, patch))
        raise ApiError(
            415, "UnsupportedMediaType", f"the body of the request was in an unknown format {content_type!r}"
        )

    @property
    def revision(self) -> int:
        return self._store.revision


def _without_rv(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out.get("metadata", {}).pop("resourceVersion", None)
    return out


_PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>nodes|configmaps|events|pods)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that drops its connection (a pool that is full, a timeout) is no error of the server."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


@dataclass(frozen=True)
class RawJson:
    text: str


class _Handler(BaseHTTPRequestHandler):
    api: ApiDouble
    protocol_version = "HTTP/1.1"
    _current: tuple[str, str, dict[str, list[str]]] = ("", "", {})

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without NODELAY, Nagle + delayed ACK add 40 ms to each.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.api._lock:
            self.api._connections.add(self.connection)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.api._lock:
            self.api._connections.discard(self.connection)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.api.down:
            self.close_connection = True
            return
        self.api.requests.append((method, path))
        self._current = (method, path, parse_qs(url.query))
        self._warnings: list[str] = []
        if self.api.token is not None and self.headers.get("Authorization") != f"Bearer {self.api.token}":
            self._error(ApiError(401, "Unauthorized", "Unauthorized"))
            return
        fault = self.api._take_fault(method, path)
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.reset:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault.status:
                headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                self._error(
                    ApiError(fault.status, _REASONS.get(fault.status, "InternalError"), "injected fault"), headers
                )
                return
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            body = (yaml.safe_load(raw) if content_type == APPLY else json.loads(raw)) if raw else None
            status, answer = self._route(method, path, parse_qs(url.query), content_type, body)
        except ApiError as exc:
            if method != "GET":
                self._record(method, path, content_type, raw, exc.code)
            self._error(exc)
            return
        except (ValueError, TypeError, KeyError, yaml.YAMLError) as exc:
            self._error(ApiError(400, "BadRequest", f"malformed request: {exc!r}"))
            return
        if method != "GET":
            self._record(method, path, content_type, raw, status)
        self._send(status, answer)

    def _record(self, method: str, path: str, content_type: str, raw: bytes, status: int) -> None:
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        with self.api._lock:
            self.api.writes.append(Write(method, path, content_type, body, status, time.time()))

    def _route(
        self, method: str, path: str, query: dict[str, list[str]], content_type: str, body: Any
    ) -> tuple[int, Any]:
        if path == "/apis" or path.startswith(f"/apis/{kube_dra.GROUP}"):
            return kube_dra.route(self.api, method, path, query, content_type, body, self._warnings)
        match = _PATH.match(path)
        if match is None:
            return kube_install.route(self.api, method, path, query, content_type, body)
        resource, namespace, name, sub = match["resource"], match["ns"] or "", match["name"], match["sub"] or ""
        if (resource in NAMESPACED) != bool(match["ns"]) and not (method == "GET" and name is None):
            raise ApiError(404, "NotFound", f"no such path {path}")
        if sub and resource != "nodes":
            raise ApiError(404, "NotFound", f"no subresource {sub} on {resource}")
        api = self.api
        if method != "GET" and api.before_write is not None:
            api.before_write(method, path)
        if method == "GET" and name is None:
            check_selectors(resource, query.get("labelSelector", [""])[0], query.get("fieldSelector", [""])[0])
        if method == "POST" and namespace and not sub:
            api.require_namespace(namespace)
        if method == "PUT" and name is not None:
            sent = ((body or {}).get("metadata") or {}).get("name")
            if sent and sent != name:
                raise ApiError(
                    400, "BadRequest", f"the name of the object ({sent}) does not match the name on the URL ({name})"
                )
        if method == "GET" and name is None and "as=PartialObjectMetadataList" in (self.headers.get("Accept") or ""):
            items = api.list(
                resource,
                namespace if match["ns"] else None,
                query.get("labelSelector", [""])[0],
                query.get("fieldSelector", [""])[0],
            )
            return 200, {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadataList",
                "metadata": {"resourceVersion": str(api.revision)},
                # kube-apiserver answers an empty metadata list with `items: null`, not [].
                "items": [
                    {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": i["metadata"]}
                    for i in items
                ]
                or None,
            }
        if method == "GET" and name is None:
            return 200, RawJson(
                api.list_json(
                    resource,
                    namespace if match["ns"] else None,
                    query.get("labelSelector", [""])[0],
                    query.get("fieldSelector", [""])[0],
                )
            )
        if method == "GET":
            obj = api.get(resource, namespace, name)
            if "as=PartialObjectMetadata" in (self.headers.get("Accept") or ""):
                return 200, {
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadata",
                    "metadata": obj["metadata"],
                }
            return 200, obj
        if method == "POST" and name is None and not sub and resource == "nodes":
            # Admission (TaintNodesByCondition) taints every new Node not-ready until its kubelet reports Ready.
            body = copy.deepcopy(body or {})
            taints = body.setdefault("spec", {}).setdefault("taints", [])
            if not any(t.get("key") == NOT_READY_TAINT["key"] for t in taints):
                taints.append(dict(NOT_READY_TAINT))
        if method == "POST" and name is None and not sub:
            return 201, api.create(resource, namespace, body or {})
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
        if method == "PUT":
            return 200, api.update(resource, namespace, name, sub, body or {}, patched=False)
        if method == "PATCH" and content_type == APPLY:
            return api.apply(resource, namespace, name, sub, body, query)
        if method == "PATCH":
            return 200, api.patch(resource, namespace, name, sub, content_type, body)
        if method == "DELETE":
            gone = api.delete(resource, namespace, name, *kube_install.delete_options(body, query))
            return 200, kube_install.deleted_answer(resource, "v1", gone)
        raise ApiError(405, "MethodNotAllowed", method)

    def _error(self, exc: ApiError, headers: dict[str, str] | None = None) -> None:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": exc.message,
            "reason": exc.reason,
            "code": exc.code,
        }
        if not exc.reason:
            del body["reason"]  # as kube-apiserver's answer to a patch it cannot apply (500, no reason)
        self._send(exc.code, body, headers)

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = body.text.encode() if isinstance(body, RawJson) else json.dumps(body).encode()
        method, path, query = self._current
        with self.api._lock:
            accept = self.headers.get("Accept") or ""
            bearer = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            self.api.log.append(Request(method, path, query, status, len(data), accept, bearer))
            self.api.bytes_sent += len(data)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            for warning in getattr(self, "_warnings", ()):
                self.send_header("Warning", warning)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
_REASONS = {
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@contextlib.contextmanager
def running_double() -> Iterator[ApiDouble]:
    assert_system_test("the Kubernetes API double (a server on 127.0.0.1)")
    double = ApiDouble().start()
    try:
        yield double
    finally:
        double.stop()
