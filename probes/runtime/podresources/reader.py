"""The ledger reader: a child program that asks the kubelet's PodResources API and prints JSON.

    python -E -s probes/runtime/podresources/reader.py SOCKET TIMEOUT_SECONDS     # one read, then exit
    python -E -s probes/runtime/podresources/reader.py --serve                    # reads on request

One read is two calls on one connection, List then GetAllocatableResources, each with the deadline of what is
left of TIMEOUT_SECONDS. It prints one JSON document (one line) on stdout:

    {"pods": [{"namespace", "name", "containers": [{"name", "devices": [{"resource", "ids"}],
               "claims": [{"driver", "pool", "device", "claim"}]}]}],
     "allocatable": [{"resource", "ids"}]}

or `{"error": {"code": "UNAVAILABLE", "message": "..."}}` (a gRPC status name, or CONNECT / TIMEOUT, or TOO_LARGE:
an answer past one of the bounds of `caps.py`, counted on the message before anything is built from it, a message
whose length prefix is past its bound never received).

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
import struct
import sys
import time
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

sys.path.insert(0, str(Path(__file__).resolve().parent))
api_pb2: Any = importlib.import_module("api_pb2")
api_grpc: Any = importlib.import_module("api_grpc")
caps: Any = importlib.import_module("caps")


class TooLarge(Exception):
    """An answer past one of the bounds of `caps.py`: not read further, nothing of it kept."""


def _bound(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise TooLarge(f"{count} {what} (at most {limit} are read)")


def _text(value: str) -> str:
    if len(value) > caps.MAX_TEXT_CHARS:
        raise TooLarge(f"a name or id of {len(value)} characters (at most {caps.MAX_TEXT_CHARS} are read)")
    return value


def _ids(values: Any) -> list[str]:
    return [_text(value) for value in values]


def list_document(response: Any) -> list[dict[str, Any]]:
    """The List answer as the agent reads it; its sizes are counted on the message (nothing is built) first."""
    pods_listed = response.pod_resources
    _bound(len(pods_listed), caps.MAX_PODS, "pods listed")
    _bound(sum(len(pod.containers) for pod in pods_listed), caps.MAX_CONTAINERS, "containers listed")
    given = 0
    for pod in pods_listed:
        for container in pod.containers:
            # An entry without ids counts as one: a million empty entries must not pass either.
            given += sum(max(1, len(d.device_ids)) for d in container.devices)
            given += sum(max(1, len(claim.claim_resources)) for claim in container.dynamic_resources)
        _bound(given, caps.MAX_ALLOCATED_IDS, "device ids allocated to containers (or more)")
    pods = []
    for pod in pods_listed:
        containers = []
        for container in pod.containers:
            devices = [{"resource": _text(d.resource_name), "ids": _ids(d.device_ids)} for d in container.devices]
            claims = [
                {
                    "driver": _text(r.driver_name),
                    "pool": _text(r.pool_name),
                    "device": _text(r.device_name),
                    "claim": _text(claim.claim_name),
                }
                for claim in container.dynamic_resources
                for r in claim.claim_resources
            ]
            containers.append({"name": _text(container.name), "devices": devices, "claims": claims})
        pods.append({"namespace": _text(pod.namespace), "name": _text(pod.name), "containers": containers})
    return pods


def allocatable_document(response: Any) -> list[dict[str, Any]]:
    offered = response.devices
    _bound(sum(max(1, len(d.device_ids)) for d in offered), caps.MAX_ALLOCATABLE_IDS, "allocatable device ids")
    return [{"resource": _text(d.resource_name), "ids": _ids(d.device_ids)} for d in offered]


async def call(method: Any, request: Any, reply: Any, deadline: float) -> Any:
    """One unary call whose answer is received only when its length prefix is within caps.MAX_MESSAGE_BYTES:
    grpclib has no receive limit of its own and would take in any length the server announces. The prefix is
    read from grpclib's HTTP/2 stream (`_stream`) before the message, as grpclib's own recv_message does; data
    not read is never acknowledged, so the server cannot send much more than one flow-control window of it."""
    async with method.open(timeout=max(0.01, deadline - time.monotonic())) as stream:
        await stream.send_message(request, end=True)
        await stream.recv_initial_metadata()
        raw = stream._stream
        prefix = await raw.recv_data(5)
        if len(prefix) < 5:
            await stream.recv_trailing_metadata()  # an error status raises here
            raise TooLarge("an answer without a message")  # not reached with a kubelet: OK carries one message
        compressed, length = struct.unpack(">?I", prefix)
        if compressed:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed answers are not read")
        _bound(length, caps.MAX_MESSAGE_BYTES, f"bytes in the {method.name.rsplit('/', 1)[-1]} answer")
        message = reply.FromString(await raw.recv_data(length))
        await stream.recv_trailing_metadata()
        return message


async def read(socket_path: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    channel = Channel(path=socket_path)
    try:
        stub = api_grpc.PodResourcesListerStub(channel)
        listed = await call(stub.List, api_pb2.ListPodResourcesRequest(), api_pb2.ListPodResourcesResponse, deadline)
        pods = list_document(listed)
        del listed  # the message goes before the next one is received
        offered = await call(
            stub.GetAllocatableResources,
            api_pb2.AllocatableResourcesRequest(),
            api_pb2.AllocatableResourcesResponse,
            deadline,
        )
        allocatable = allocatable_document(offered)
    finally:
        channel.close()
    return {"pods": pods, "allocatable": allocatable}


def answer(socket_path: str, timeout: float) -> dict[str, Any]:
    try:
        return asyncio.run(asyncio.wait_for(read(socket_path, timeout), timeout))
    except TooLarge as exc:
        return {"error": {"code": "TOO_LARGE", "message": str(exc)[:300]}}
    except GRPCError as exc:
        return {"error": {"code": exc.status.name, "message": str(exc.message or "")[:300]}}
    except (asyncio.TimeoutError, TimeoutError):
        return {"error": {"code": "TIMEOUT", "message": f"no answer within {timeout:g}s"}}
    except OSError as exc:
        return {"error": {"code": "CONNECT", "message": f"{type(exc).__name__}: {exc}"[:300]}}


def encode(reply: dict[str, Any]) -> bytes:
    """One JSON line; one past caps.MAX_ANSWER_BYTES is TOO_LARGE instead (the agent would not read it)."""
    line = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
    if len(line) > caps.MAX_ANSWER_BYTES:
        message = f"an answer of {len(line)} bytes as JSON (at most {caps.MAX_ANSWER_BYTES} are read)"
        line = json.dumps({"error": {"code": "TOO_LARGE", "message": message}}).encode() + b"\n"
    return line


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
        sys.stdout.buffer.write(encode(reply))
        sys.stdout.flush()
        del reply  # the answer goes before the next request is read
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    if len(argv) != 2:
        print("usage: reader.py SOCKET TIMEOUT_SECONDS | --serve", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(encode(answer(argv[0], float(argv[1]))).rstrip(b"\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
