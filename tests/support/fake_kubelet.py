"""A fake kubelet PodResources server: real gRPC (grpcio, another implementation than the agent's grpclib) on a
unix socket, serving the repository's own proto (probes/runtime/podresources/api.proto) with a configurable
ledger. It runs in a process of its own (`python fake_kubelet.py SOCKET STATE`): grpcio's threads in the test
process would break the agent's forked /proc scanners, which the agent itself never has to share with gRPC.
The test side writes the ledger to STATE (JSON), which the server reads at each call, and reads its counters
back from STATE.calls.

    with FakeKubelet() as kubelet:
        kubelet.allocate("team-a", "train-0", "worker", "huawei.com/Ascend910", "Ascend910-3")
        kubelet.offer("huawei.com/Ascend910", "Ascend910-0", "Ascend910-3")
        ctx = ...KubeletAccess(socket=kubelet.socket)...

Modes: "ok" answers; "hang" accepts the call and never answers (until the server closes); "unavailable"
answers UNAVAILABLE, as a kubelet does while it restarts. The kubelet's own rate limit (100 QPS, burst 10 by
default; `rate=`, `burst=` to tighten) is a token bucket in front of both calls, answering RESOURCE_EXHAUSTED
when empty, as the kubelet's interceptor does. `calls` counts the calls by method, `limited` the rejected ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from types import TracebackType
from typing import Any

SERVICE = "v1.PodResourcesLister"
HERE = Path(__file__).resolve()


class FakeKubelet:
    """The test's handle: the ledger to serve, the server process, its counters."""

    def __init__(self, mode: str = "ok", rate: float = 100.0, burst: int = 10) -> None:
        # A unix socket path is at most 107 bytes: a short directory of its own, not pytest's tmp_path.
        self.directory = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
        self.socket = str(self.directory / "kubelet.sock")
        self.state = self.directory / "state.json"
        self.mode, self.rate, self.burst = mode, rate, burst
        self.pods: dict[str, dict[str, list[list[str]]]] = {}  # "ns/name" → container → [resource, id]
        self.allocatable: dict[str, list[str]] = {}
        self._server: subprocess.Popen[bytes] | None = None
        self._save()

    # --- the ledger ------------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, container: str = "main") -> None:
        self.pods.setdefault(f"{namespace}/{name}", {}).setdefault(container, [])
        self._save()

    def allocate(self, namespace: str, name: str, container: str, resource: str, *device_ids: str) -> None:
        self.add_pod(namespace, name, container)
        self.pods[f"{namespace}/{name}"][container].extend([resource, i] for i in device_ids)
        self._save()

    def offer(self, resource: str, *device_ids: str) -> None:
        self.allocatable.setdefault(resource, []).extend(device_ids)
        self._save()

    def clear(self) -> None:
        self.pods.clear()
        self.allocatable.clear()
        self._save()

    def _save(self) -> None:
        document = {"mode": self.mode, "pods": self.pods, "allocatable": self.allocatable}
        document.update(rate=self.rate, burst=self.burst)
        temporary = self.state.with_suffix(".tmp")
        temporary.write_text(json.dumps(document))
        os.replace(temporary, self.state)

    @property
    def counters(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.state.with_suffix(".calls").read_text()))
        except (OSError, ValueError):
            return {"calls": {"List": 0, "GetAllocatableResources": 0}, "limited": 0}

    @property
    def calls(self) -> dict[str, int]:
        return dict(self.counters["calls"])

    @property
    def limited(self) -> int:
        return int(self.counters["limited"])

    # --- the server process -----------------------------------------------------------------------

    def start(self) -> FakeKubelet:
        from support.system import assert_system_test

        assert_system_test("a fake kubelet (a gRPC server on a unix socket)")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), str(HERE.parents[1])])}
        self._server = subprocess.Popen([sys.executable, str(HERE), self.socket, str(self.state)], env=env)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self._server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake kubelet did not start")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        from probes.runtime.podresources.client import forget

        forget(self.socket)  # the agent-side reader child of this socket (in this test process) goes too
        if self._server is not None:
            self._server.kill()
            self._server.wait(10)
            self._server = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# --- the server (its own process) ------------------------------------------------------------------------


class _Server:
    def __init__(self, state: Path) -> None:
        import grpc  # only here: the test process never loads grpcio

        self.grpc = grpc
        self.state = state
        self.calls = {"List": 0, "GetAllocatableResources": 0}
        self.limited = 0
        self.tokens: float | None = None
        self.refilled = time.monotonic()
        self.lock = threading.Lock()

    def _admit(self, method: str, context: Any) -> dict[str, Any]:
        document = json.loads(self.state.read_text())
        with self.lock:
            self.calls[method] += 1
            now = time.monotonic()
            burst = float(document["burst"])
            tokens = burst if self.tokens is None else self.tokens
            self.tokens = min(burst, tokens + (now - self.refilled) * float(document["rate"]))
            self.refilled = now
            refused = self.tokens < 1
            self.limited += refused
            self.tokens -= 0 if refused else 1
            counters = self.state.with_suffix(".calls.tmp")
            counters.write_text(json.dumps({"calls": self.calls, "limited": self.limited}))
            os.replace(counters, self.state.with_suffix(".calls"))
        status = self.grpc.StatusCode
        if refused:
            context.abort(status.RESOURCE_EXHAUSTED, "rejected by rate limit")
        if document["mode"] == "hang":
            time.sleep(3600)
        if document["mode"] == "unavailable":
            context.abort(status.UNAVAILABLE, "kubelet restarting")
        return document

    def list(self, request: Any, context: Any) -> Any:
        document = self._admit("List", context)
        response = api_pb2.ListPodResourcesResponse()
        for key, containers in sorted(document["pods"].items()):
            namespace, name = key.split("/", 1)
            pod = response.pod_resources.add(name=name, namespace=namespace)
            for container_name, devices in containers.items():
                container = pod.containers.add(name=container_name)
                by_resource: dict[str, list[str]] = {}
                for resource, device_id in devices:
                    by_resource.setdefault(resource, []).append(device_id)
                for resource, ids in by_resource.items():
                    container.devices.add(resource_name=resource, device_ids=ids)
        return response

    def allocatable(self, request: Any, context: Any) -> Any:
        document = self._admit("GetAllocatableResources", context)
        response = api_pb2.AllocatableResourcesResponse()
        for resource, ids in sorted(document["allocatable"].items()):
            response.devices.add(resource_name=resource, device_ids=ids)
        return response

    def serve(self, socket: str) -> None:
        grpc = self.grpc
        handlers = {
            "List": grpc.unary_unary_rpc_method_handler(
                self.list,
                request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
                response_serializer=api_pb2.ListPodResourcesResponse.SerializeToString,
            ),
            "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
                self.allocatable,
                request_deserializer=api_pb2.AllocatableResourcesRequest.FromString,
                response_serializer=api_pb2.AllocatableResourcesResponse.SerializeToString,
            ),
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        server.wait_for_termination()


if __name__ == "__main__":
    from probes.runtime.podresources import api_pb2

    _Server(Path(sys.argv[2])).serve(sys.argv[1])
