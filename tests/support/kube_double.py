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
- validation of what the agent writes: taint effects and duplicates, label syntax, condition status;
- faults: 409, 429 (with Retry-After), 500, 403, slow answers, reset connections, and a whole outage
  (listener closed, live connections cut: the client sees connection refused).

Every write is recorded (`double.writes`) so tests can count the API writes an agent makes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import kubernetes.client

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# Lists that strategic merge merges by key (patchStrategy=merge in the Go types); every other list is
# atomic and replaced whole — notably spec.taints.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("metadata", "ownerReferences"): "uid",
}

KINDS = {"nodes": "Node", "configmaps": "ConfigMap", "events": "Event"}
NAMESPACED = {"configmaps", "events"}

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


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
            continue  # $setElementOrder/..., $retainKeys: ordering hints, not needed here
        if value is None:
            result.pop(key, None)
            continue
        sub = (*path, key)
        if isinstance(value, list) and sub in MERGE_KEYS:
            result[key] = _merge_list(result.get(key) or [], value, MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            if value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                current = result.get(key)
                result[key] = strategic_merge(current if isinstance(current, dict) else {}, value, sub)
        else:
            result[key] = _strip_directives(copy.deepcopy(value))
    return result


def _merge_list(original: list[Any], patch: list[Any], merge_key: str, path: tuple[str, ...]) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    result = copy.deepcopy(original)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise ApiError(422, "Invalid", f"{'.'.join(path)}: list item without merge key {merge_key!r}")
        index = next((i for i, e in enumerate(result) if e.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(copy.deepcopy(item)))
        else:
            result[index] = strategic_merge(result[index], item, path)
    return result


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


# --- validation ------------------------------------------------------------------------------------


def _validate_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.match(name)) and (not prefix or bool(_DNS_SUBDOMAIN.match(prefix)))


def validate_object(resource: str, obj: dict[str, Any]) -> None:
    metadata = obj.get("metadata") or {}
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
            if condition.get("status") not in ("True", "False", "Unknown"):
                raise ApiError(422, "Invalid", f"status.conditions: invalid status {condition.get('status')!r}")
            if not condition.get("type") or condition["type"] in types:
                raise ApiError(422, "Invalid", f"status.conditions: missing or duplicate type {condition.get('type')}")
            types.add(condition["type"])
    if resource == "configmaps":
        for key, value in (obj.get("data") or {}).items():
            if not re.match(r"^[-._a-zA-Z0-9]+$", key) or not isinstance(value, str):
                raise ApiError(422, "Invalid", f"data: invalid key {key!r}")


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


@dataclass
class _Store:
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    revision: int = 100


# --- the server ------------------------------------------------------------------------------------


class ApiDouble:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._store = _Store()
        self._faults: list[Fault] = []
        self.writes: list[Write] = []
        self.requests: list[tuple[str, str]] = []
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

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> ApiDouble:
        double = self

        class Handler(_Handler):
            api = double

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
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

    def create(self, resource: str, namespace: str, body: dict[str, Any], keep_status: bool = False) -> dict[str, Any]:
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
            if namespace:
                metadata["namespace"] = namespace
            body["apiVersion"] = "v1"
            body["kind"] = KINDS[resource]
            validate_object(resource, body)
            return self._save(resource, namespace, name, body)

    def _save(self, resource: str, namespace: str, name: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._store.revision += 1
        obj["metadata"]["resourceVersion"] = str(self._store.revision)
        self._store.objects[(resource, namespace, name)] = obj
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
            result["apiVersion"], result["kind"] = "v1", KINDS[resource]
            validate_object(resource, result)
            if _without_rv(result) == _without_rv(current):
                return copy.deepcopy(current)  # a no-op write does not bump resourceVersion
            return self._save(resource, namespace, name, result)

    def delete(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._store.objects.pop((resource, namespace, name), None)
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            self._store.revision += 1
            return obj

    def patch(
        self, resource: str, namespace: str, name: str, subresource: str, content_type: str, patch: Any
    ) -> dict[str, Any]:
        with self._lock:
            current = self.get(resource, namespace, name)
            if content_type == STRATEGIC:
                if resource not in KINDS:
                    raise ApiError(415, "UnsupportedMediaType", "strategic merge patch needs a built-in type")
                new = strategic_merge(current, patch)
            elif content_type == MERGE:
                new = merge_patch(current, patch)
            elif content_type == JSON_PATCH:
                new = json_patch(current, patch)
            else:
                raise ApiError(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format {content_type!r}"
                )
            return self.update(resource, namespace, name, subresource, new, patched=True)

    @property
    def revision(self) -> int:
        return self._store.revision


def _without_rv(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out.get("metadata", {}).pop("resourceVersion", None)
    return out


_PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>nodes|configmaps|events)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)


class _Handler(BaseHTTPRequestHandler):
    api: ApiDouble
    protocol_version = "HTTP/1.1"

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
            body = json.loads(raw) if raw else None
            status, answer = self._route(method, path, parse_qs(url.query), content_type, body)
        except ApiError as exc:
            if method != "GET":
                self._record(method, path, content_type, raw, exc.code)
            self._error(exc)
            return
        except (ValueError, TypeError, KeyError) as exc:
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
        match = _PATH.match(path)
        if match is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
        resource, namespace, name, sub = match["resource"], match["ns"] or "", match["name"], match["sub"] or ""
        if (resource in NAMESPACED) != bool(match["ns"]) and not (method == "GET" and name is None):
            raise ApiError(404, "NotFound", f"no such path {path}")
        if sub and resource != "nodes":
            raise ApiError(404, "NotFound", f"no subresource {sub} on {resource}")
        api = self.api
        if method != "GET" and api.before_write is not None:
            api.before_write(method, path)
        if method == "GET" and name is None:
            items = api.list(
                resource,
                namespace if match["ns"] else None,
                query.get("labelSelector", [""])[0],
                query.get("fieldSelector", [""])[0],
            )
            kind = KINDS[resource] + "List"
            return 200, {
                "apiVersion": "v1",
                "kind": kind,
                "metadata": {"resourceVersion": str(api.revision)},
                "items": items,
            }
        if method == "GET":
            return 200, api.get(resource, namespace, name)
        if method == "POST" and name is None and not sub:
            return 201, api.create(resource, namespace, body or {})
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
        if method == "PUT":
            return 200, api.update(resource, namespace, name, sub, body or {}, patched=False)
        if method == "PATCH":
            return 200, api.patch(resource, namespace, name, sub, content_type, body)
        if method == "DELETE":
            api.delete(resource, namespace, name)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}
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
        self._send(exc.code, body, headers)

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


_REASONS = {
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@contextlib.contextmanager
def running_double() -> Iterator[ApiDouble]:
    double = ApiDouble().start()
    try:
        yield double
    finally:
        double.stop()
