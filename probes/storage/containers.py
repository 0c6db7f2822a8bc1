"""Containers' own filesystems: one process per mount namespace other than the host's, through whose
/proc/<pid>/root the container's lock files are reached, and who the container is (pod, container id).

A lock a job left inside its container (`~/.cache/torch_extensions/.../lock` in the image's filesystem or a
tmpfs the container mounted) is invisible from the host's paths; the kernel still shows it through any of
the container's processes. Mount namespaces are told apart by /proc/<pid>/ns/mnt; the host's is pid 1's.
Everything here reads procfs (and the runtime's state under /run): nothing touches a container's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from probes.runtime.host import Host
from probes.runtime.procfs import CgroupOwner, list_pids, process_info

# Where containerd keeps each Kubernetes container's OCI config (the shim's bundle), whose annotations
# (set by its CRI plugin) name the pod and the container.
_RUNTIME_CONFIGS: tuple[tuple[str, tuple[str, str, str]], ...] = (
    (
        "run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
        ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name"),
    ),
)
_CONTAINER_ID = re.compile(r"^[0-9a-f]{12,64}$")
# A pod's sandbox ("pause") container holds its namespaces and runs nothing that takes locks.
_SANDBOX_COMMS = ("pause",)
_CONFIG_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class MountNamespace:
    """A container's mount namespace and the process the agent reaches it through."""

    namespace: str  # readlink of /proc/<pid>/ns/mnt: `mnt:[4026532177]`
    pid: int
    comm: str
    owner: CgroupOwner
    pod_names: dict[str, str] = field(default_factory=dict)  # pod_namespace, pod_name, container_name

    @property
    def label(self) -> str:
        """Stable while the container lives: `pod <uid> container <id12>`, or the namespace's inode."""
        if self.owner.kind in ("pod", "container"):
            return self.owner.describe()
        return f"mount namespace {self.namespace.removeprefix('mnt:').strip('[]')}"

    def describe(self) -> str:
        """The label, with the pod's namespace/name and container name where the runtime tells them."""
        names = self.pod_names
        if names.get("pod_name"):
            where = f"{names.get('pod_namespace', '?')}/{names['pod_name']}"
            container = f" container {names['container_name']}" if names.get("container_name") else ""
            return f"{self.label} ({where}{container})"
        return self.label

    def command_inside(self, command: str) -> str:
        """How an operator runs `command` in this container: `kubectl exec` for a pod, the runtime's own exec
        for a container outside Kubernetes (`podman exec 4c3b… rm /x`), nsenter into the namespace otherwise."""
        if self.owner.kind == "pod":
            names = self.pod_names
            if not names.get("pod_name"):
                return f"kubectl exec ... -- {command}"
            container = f" -c {names['container_name']}" if names.get("container_name") else ""
            pod = f"-n {names.get('pod_namespace', 'default')} {names['pod_name']}{container}"
            return f"kubectl exec {pod} -- {command}"
        return self.owner.container_command("exec", command) or f"nsenter -t {self.pid} -m -- {command}"

    def observed(self) -> dict[str, object]:
        return {
            "mount_namespace": self.namespace,
            "pid": self.pid,
            "comm": self.comm,
            "pod_uid": self.owner.pod_uid,
            "container_id": self.owner.container_id,
            "runtime": self.owner.runtime,
            **self.pod_names,
        }


@dataclass
class NamespaceCensus:
    """The containers' mount namespaces found in one pass over /proc."""

    namespaces: list[MountNamespace]
    total: int  # namespaces found, before the limit
    unreadable: int  # processes whose /proc/<pid>/ns/mnt could not be read
    error: str = ""  # why containers could not be told from the host at all


def read_namespace(host: Host, pid: int | str) -> str | None:
    """readlink /proc/<pid>/ns/mnt; None when the process is gone or its namespace cannot be read."""
    try:
        return os.readlink(host.proc_path(pid, "ns", "mnt"))
    except OSError:
        return None


def _root_mount_id(host: Host, pid: int) -> int | None:
    """The id of the first mount in a process's mountinfo: equal for processes of one mount namespace."""
    try:
        with open(host.proc_path(pid, "mountinfo"), "rb") as handle:
            return int(handle.readline().split(b" ", 1)[0])
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class HostNamespace:
    """How the host's mount namespace is recognised: pid 1's namespace link, or, where that cannot be read
    (no CAP_SYS_PTRACE over pid 1), its mount table (processes of one mount namespace list the same first
    mount id)."""

    namespace: str | None
    root_mount_id: int | None

    @classmethod
    def of(cls, host: Host) -> HostNamespace:
        namespace = read_namespace(host, 1)
        return cls(namespace, None if namespace is not None else _root_mount_id(host, 1))

    @property
    def known(self) -> bool:
        return self.namespace is not None or self.root_mount_id is not None

    def holds(self, host: Host, pid: int, namespace: str | None) -> bool:
        """Whether `pid` (whose namespace link reads `namespace`) is in the host's mount namespace."""
        if self.namespace is not None:
            return namespace == self.namespace
        return self.root_mount_id is not None and _root_mount_id(host, pid) == self.root_mount_id


def container_namespaces(host: Host, limit: int) -> NamespaceCensus:
    """One process per mount namespace that is neither the host's nor the agent's own, pods first."""
    host_ns = HostNamespace.of(host)
    if not host_ns.known:
        return NamespaceCensus([], 0, 0, f"neither {host.proc_path(1, 'ns', 'mnt')} nor pid 1's mountinfo is readable")
    own_ns = read_namespace(host, "self")
    first_pid: dict[str, int] = {}
    unreadable = 0
    for pid in list_pids(host.proc):
        try:
            namespace = os.readlink(host.proc_path(pid, "ns", "mnt"))
        except FileNotFoundError:
            continue
        except OSError:
            unreadable += 1
            continue
        if namespace not in (host_ns.namespace, own_ns):
            first_pid.setdefault(namespace, pid)
    found = []
    for namespace, pid in first_pid.items():
        if host_ns.namespace is None and host_ns.holds(host, pid, namespace):
            continue
        info = process_info(host.proc, pid, with_command=False)
        if info is not None and info.comm not in _SANDBOX_COMMS:
            found.append(MountNamespace(namespace, pid, info.comm, info.cgroup))
    found.sort(key=lambda ns: (not ns.owner.in_pod, ns.owner.kind != "container", ns.pid))
    chosen = [_with_pod_names(host, ns) for ns in found[:limit]]
    return NamespaceCensus(chosen, len(found), unreadable)


def _with_pod_names(host: Host, ns: MountNamespace) -> MountNamespace:
    names = pod_names(host.root, ns.owner.container_id) if ns.owner.kind in ("pod", "container") else {}
    return MountNamespace(ns.namespace, ns.pid, ns.comm, ns.owner, names)


def pod_names(root: Path, container_id: str | None) -> dict[str, str]:
    """The pod's namespace and name and the container's name, from containerd's OCI config of the container;
    {} when no runtime state names it."""
    if not container_id or not _CONTAINER_ID.match(container_id):
        return {}
    for template, keys in _RUNTIME_CONFIGS:
        path = root / template.format(id=container_id)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(path, "rb") as handle:
                annotations = json.loads(handle.read(_CONFIG_MAX_BYTES)).get("annotations") or {}
            names = dict(zip(("pod_namespace", "pod_name", "container_name"), keys, strict=True))
            found = {name: str(annotations[key]) for name, key in names.items() if annotations.get(key)}
            if found:
                return found
    return {}
