"""The kubelet's PodResources API: the device plugins' ledger of which pod was given which device.

- `api.proto`: the messages the agent reads (the kubelet's podresources v1 field numbers and types);
  `api_pb2.py`, `api_pb2.pyi`, `api_grpc.py` are generated from it (docs/development.md says how).
- `reader.py`: the child that makes the reads (List, GetAllocatableResources) with grpclib, one per request.
- `caps.py`: what one answer may hold (messages, pods, containers, ids, text), for the child and the agent alike.
- `client.py`: starting reads in the background, sharing them between probes, `last_read()`.
- `ledger.py`: the answer as a model (pure): allocations, what is offered, device ids, `pod_devices()`.
- `pods.py`: `KubeletAccess` on the probe context: the socket, the read's deadline, the node's pods.
- `compare.py`: holders judged against the ledger (pure), shared by npu.holders and gpu.holders.

The agent process never imports the gRPC client or protobuf: only the child does.
"""
