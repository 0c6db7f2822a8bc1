"""A real Kubernetes control plane for the realkube tier: etcd, kube-apiserver and kube-controller-manager built by
scripts/control_plane.py, run on 127.0.0.1 with free ports in a temporary directory.

The apiserver is set up as a real cluster's: Node and RBAC authorizers, service-account tokens signed with a key
made here, the default admission plugins plus NodeRestriction (ValidatingAdmissionPolicy is on by default, and
TaintNodesByCondition gives every new Node `node.kubernetes.io/not-ready:NoSchedule`), the DRA API each release
serves (1.36: DeviceTaintRules only in `resource.k8s.io/v1beta2`, behind DRADeviceTaintRules) and the device-taint
gates on or off. The controller-manager runs the garbage collector, the namespace controller, the service-account
controllers (default accounts, legacy Secret tokens), the device-taint-eviction controller and the admission
policies' status controller (their type check). Privileged pods are allowed, as on a real cluster's apiserver.

One plane per (release, gates) for the whole session (`plane`), stopped at its end. The admin reaches it with a
static token (`kubeconfig`); `node_token` gives a pod-bound service-account token for a named node, as a
DaemonSet pod's projected token is.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import kubernetes.client

from agent.config import parse_config
from agent.kube.client import KubeApi, load_api_client
from support import system
from support.processes import free_port

ADMIN_TOKEN = "node-health-realkube-admin"
RELEASES = ("1.37", "1.36")


def _control_plane_script() -> Any:
    spec = importlib.util.spec_from_file_location("control_plane", system.REPO / "scripts" / "control_plane.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def binaries(release: str) -> Path | None:
    """The cached build of `release` (a minor): None when scripts/control_plane.py has not built it."""
    found = _control_plane_script().find(release)
    return Path(found) if found is not None else None


def require_binaries(release: str) -> Path:
    """Skip (locally) or fail (CI) without the release's binaries."""
    found = binaries(release)
    system.require(found is not None, f"a {release} control plane (python3 scripts/control_plane.py {release})")
    assert found is not None
    return found


def raw_request(
    url: str, method: str, body: Any, token: str, content_type: str = "", context: ssl.SSLContext | None = None
) -> tuple[int, Any]:
    """One call as a client sends it (status, decoded JSON answer, else the text), to a real server or the
    double alike (tests/support/realkube_compare.py)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = content_type or "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def gates(release: str, taint_rules: bool) -> str:
    """The feature gates for device taints on `release`: on (DRADeviceTaints and, from 1.36, DRADeviceTaintRules)
    or off."""
    value = "true" if taint_rules else "false"
    return f"DRADeviceTaints={value},DRADeviceTaintRules={value}"


@dataclass
class Plane:
    release: str
    taint_rules: bool
    root: Path
    bin: Path
    port: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    version: str = ""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def api_client(self) -> kubernetes.client.ApiClient:
        """The admin's client, loaded the way the agent loads one (kubernetes.kubeconfig)."""
        return load_api_client(parse_config({"kubernetes": {"kubeconfig": str(self.kubeconfig)}}))

    def api(self, timeout: float = 10.0) -> KubeApi:
        client = self.api_client()
        return KubeApi(lambda: client, timeout)

    def request(
        self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN, content_type: str = ""
    ) -> tuple[int, Any]:
        """One raw call (status, decoded JSON answer): for the tests that compare codes and shapes."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return raw_request(self.url + path, method, body, token, content_type, context)

    def kubectl(self, *args: str, check: bool = True, token: str = "") -> subprocess.CompletedProcess[str]:
        argv = ["kubectl", "--kubeconfig", str(self.kubeconfig), *args]
        if token:
            argv += ["--token", token]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=check)

    # --- objects a test needs ------------------------------------------------------------------------

    def register_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return register_node(self, name, labels)

    def ensure_namespace(self, name: str) -> None:
        status, answer = self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        assert status in (201, 409), (status, answer)

    def node_token(self, node: str, namespace: str = "node-health", account: str = "node-health") -> str:
        """A token bound to a Pod on `node` (what the agent's projected token is): the Pod is created, never run."""
        self.ensure_namespace(namespace)
        self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": account}})
        pod_name = f"{account}-{node}"[:63]
        pod = {
            "metadata": {"name": pod_name},
            "spec": {
                "nodeName": node,
                "serviceAccountName": account,
                "containers": [{"name": "agent", "image": "node-health.invalid/agent"}],
            },
        }
        status, answer = self.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
        if status == 409:
            status, answer = self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
        assert status in (200, 201), (status, answer)
        request = {
            "spec": {
                "audiences": [],
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod_name,
                    "uid": answer["metadata"]["uid"],
                },
            }
        }
        return self._token(namespace, account, request)

    def unbound_token(self, namespace: str = "node-health", account: str = "node-health") -> str:
        """A TokenRequest token bound to nothing: no node name in its extra."""
        self.ensure_namespace(namespace)
        self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": account}})
        return self._token(namespace, account, {"spec": {"audiences": [], "expirationSeconds": 3600}})

    def _token(self, namespace: str, account: str, request: dict[str, Any]) -> str:
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
        status, answer = self.request("POST", path, request)
        assert status == 201, (status, answer)
        return str(answer["status"]["token"])

    def legacy_token(self, namespace: str = "node-health", account: str = "node-health") -> str:
        """A legacy Secret token (kubernetes.io/service-account-token), filled in by the controller-manager: no
        `extra` at all in its user info."""
        self.ensure_namespace(namespace)
        self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": account}})
        name = f"{account}-legacy"
        secret = {
            "metadata": {"name": name, "annotations": {"kubernetes.io/service-account.name": account}},
            "type": "kubernetes.io/service-account-token",
        }
        self.request("POST", f"/api/v1/namespaces/{namespace}/secrets", secret)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, answer = self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
            token = ((answer or {}).get("data") or {}).get("token") if status == 200 else None
            if token:
                import base64

                return base64.b64decode(token).decode()
            time.sleep(0.2)
        raise AssertionError("the controller-manager never filled in the legacy token")

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._keys()
        etcd_port, peer_port = free_port(), free_port()
        self.port = free_port()
        self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"),
                "--name=default",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=1073741824",
                "--log-level=warn",
            ],
        )
        (self.root / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin,system:masters\n")
        runtime = "resource.k8s.io/v1beta2=true" if self.release == "1.36" else "resource.k8s.io/v1=true"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={self.root / 'certs'}",
                f"--token-auth-file={self.root / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                f"--service-account-key-file={self.root / 'sa.pub'}",
                f"--service-account-signing-key-file={self.root / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--endpoint-reconciler-type=none",
                f"--runtime-config={runtime}",
                f"--feature-gates={gates(self.release, self.taint_rules)}",
                "--v=1",
            ],
        )
        self._write_kubeconfig()
        self._wait_ready()
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--service-account-private-key-file={self.root / 'sa.key'}",
                f"--root-ca-file={self.root / 'certs' / 'apiserver.crt'}",
                "--controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller,"
                "serviceaccount-token-controller,device-taint-eviction-controller,"
                "validatingadmissionpolicy-status-controller",
                f"--feature-gates={gates(self.release, self.taint_rules)}",
                "--v=1",
            ],
        )
        status, answer = self.request("GET", "/version")
        assert status == 200, answer
        self.version = str(answer["gitVersion"])

    def _keys(self) -> None:
        key, pub = self.root / "sa.key", self.root / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root))
        time.sleep(0.2)
        if self.procs[-1].poll() is not None:
            raise RuntimeError(f"{name} exited at once: " + self.log_tail(name))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "real", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "real", "context": {"cluster": "real", "user": "admin"}}],
            "current-context": "real",
        }
        self.kubeconfig.write_text(json.dumps(config))

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    name = ("etcd", "kube-apiserver", "kube-controller-manager")[index]
                    raise RuntimeError(f"{name} exited ({proc.returncode}): " + self.log_tail(name))
            with contextlib.suppress(OSError):
                status, _ = self.request("GET", "/readyz")
                if status == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError("kube-apiserver not ready: " + self.log_tail("kube-apiserver"))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)


class Requester(Protocol):
    """A real plane or the double (support.realkube_compare.Double): one raw call, (status, decoded answer)."""

    def request(
        self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN, content_type: str = ""
    ) -> tuple[int, Any]: ...


def register_node(target: Requester, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node created as a kubelet registers it (on a real plane admission adds the not-ready taint), with the
    kubelet's own conditions and Ready, written as its status."""
    status, node = target.request("POST", "/api/v1/nodes", {"metadata": {"name": name, "labels": labels or {}}})
    assert status == 201, (status, node)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [
        {"type": kind, "status": "False", "reason": f"KubeletHas{reason}", "lastHeartbeatTime": now}
        for kind, reason in (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"))
    ] + [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now}]
    status, node = target.request(
        "PATCH",
        f"/api/v1/nodes/{name}/status",
        {"status": {"conditions": conditions}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, (status, node)
    return dict(node)


_PLANES: dict[tuple[str, bool], Plane] = {}


def plane(release: str, taint_rules: bool = True) -> Plane:
    """The session's running plane for (release, gates), started on first use and stopped at exit."""
    key = (release, taint_rules)
    running = _PLANES.get(key)
    if running is not None and all(p.poll() is None for p in running.procs):
        return running
    where = require_binaries(release)
    root = Path(tempfile.mkdtemp(prefix=f"realkube-{release}-{'on' if taint_rules else 'off'}-"))
    started = Plane(release, taint_rules, root, where)
    try:
        started.start()
    except BaseException:
        started.stop()
        raise
    _PLANES[key] = started
    return started


def stop_all() -> None:
    for running in list(_PLANES.values()):
        running.stop()
    _PLANES.clear()


atexit.register(stop_all)


def wait_for(what: str, predicate: Any, timeout: float = 30.0, every: float = 0.2) -> Any:
    """Poll `predicate` until it answers something true (the controllers run on their own time); generous
    timeouts, as the suite runs with both cores busy."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


__all__ = [
    "RELEASES",
    "Plane",
    "Requester",
    "binaries",
    "plane",
    "register_node",
    "require_binaries",
    "stop_all",
    "wait_for",
]
