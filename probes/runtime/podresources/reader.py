"""The ledger reader: a child program that asks the kubelet's PodResources API and prints JSON.

    python -E -s probes/runtime/podresources/reader.py SOCKET TIMEOUT_SECONDS     # one read, then exit
    python -E -s probes/runtime/podresources/reader.py --serve                    # reads on request

One read is two calls on one connection, List then GetAllocatableResources, each with the deadline of what is
left of TIMEOUT_SECONDS. It prints one JSON document (one line) on stdout:

    {"pods": [{"namespace", "name", "containers": [{"name", "devices": [{"resource", "ids"}],
               "claims": [{"driver", "pool", "device", "claim"}]}]}],
     "allocatable": [{"resource", "ids"}]}

or `{"error": {"code": "UNAVAILABLE", "message": "..."}}` (a gRPC status name, or CONNECT / TIMEOUT).

With `--serve` it first prints `ready` (its imports are done: what the agent waits for from then on is the
kubelet), then reads one request per line on stdin (`SOCKET<TAB>TIMEOUT_SECONDS`) and answers each with one
line, until stdin closes (the agent is gone) or no request came for IDLE_EXIT_SECONDS.

Why a child: the gRPC client (grpclib, asyncio and protobuf) would cost the agent's own memory about 17 MiB; in a
child it costs the agent nothing, and the agent bounds every read by a deadline of its own, killing a child that
overruns it, so a kubelet that never answers costs the child, not the agent. The agent keeps one child serving
between reads (`client.py`): starting the interpreter and importing the client again for every read costs
~0.1 s of CPU and, on a loaded node, up to a second. It runs as a script, not as a module of the `probes`
package, whose import (pydantic) would double the child's cost: the generated modules beside it import each other
by file name, from this directory.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import select
import sys
import time
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.exceptions import GRPCError

sys.path.insert(0, str(Path(__file__).resolve().parent))
api_pb2: Any = importlib.import_module("api_pb2")
api_grpc: Any = importlib.import_module("api_grpc")


def list_document(response: Any) -> list[dict[str, Any]]:
    pods = []
    for pod in response.pod_resources:
        containers = []
        for container in pod.containers:
            devices = [{"resource": d.resource_name, "ids": list(d.device_ids)} for d in container.devices]
            claims = [
                {"driver": r.driver_name, "pool": r.pool_name, "device": r.device_name, "claim": claim.claim_name}
                for claim in container.dynamic_resources
                for r in claim.claim_resources
            ]
            containers.append({"name": container.name, "devices": devices, "claims": claims})
        pods.append({"namespace": pod.namespace, "name": pod.name, "containers": containers})
    return pods


async def read(socket_path: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    channel = Channel(path=socket_path)
    try:
        stub = api_grpc.PodResourcesListerStub(channel)
        listed = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=max(0.01, deadline - time.monotonic()))
        offered = await stub.GetAllocatableResources(
            api_pb2.AllocatableResourcesRequest(), timeout=max(0.01, deadline - time.monotonic())
        )
    finally:
        channel.close()
    allocatable = [{"resource": d.resource_name, "ids": list(d.device_ids)} for d in offered.devices]
    return {"pods": list_document(listed), "allocatable": allocatable}


def answer(socket_path: str, timeout: float) -> dict[str, Any]:
    try:
        return asyncio.run(read(socket_path, timeout))
    except GRPCError as exc:
        return {"error": {"code": exc.status.name, "message": str(exc.message or "")[:300]}}
    except (asyncio.TimeoutError, TimeoutError):
        return {"error": {"code": "TIMEOUT", "message": f"no answer within {timeout:g}s"}}
    except OSError as exc:
        return {"error": {"code": "CONNECT", "message": f"{type(exc).__name__}: {exc}"[:300]}}


IDLE_EXIT_SECONDS = 600.0


def serve() -> int:
    """Answer requests from stdin until it closes or stays quiet for IDLE_EXIT_SECONDS."""
    stdin = sys.stdin.buffer
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while select.select([stdin], [], [], IDLE_EXIT_SECONDS)[0]:
        line = stdin.readline()
        if not line:
            return 0
        try:
            socket_path, timeout = line.decode().rstrip("\n").split("\t")
            reply = answer(socket_path, float(timeout))
        except ValueError:
            reply = {"error": {"code": "REQUEST", "message": "not SOCKET<TAB>TIMEOUT"}}
        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    if len(argv) != 2:
        print("usage: reader.py SOCKET TIMEOUT_SECONDS | --serve", file=sys.stderr)
        return 2
    json.dump(answer(argv[0], float(argv[1])), sys.stdout, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
