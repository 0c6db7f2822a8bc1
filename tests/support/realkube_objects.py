"""What the realkube tests write to a real control plane: rendered manifests applied server-side (PATCH with
application/apply-patch+yaml, what `kubectl apply --server-side` sends), one object at a time, and the admission
policies' type check read back from their status (written by kube-controller-manager's
validatingadmissionpolicy-status-controller)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from support.kube_install import GROUPS
from support.kustomize import rendered
from support.system import REPO

if TYPE_CHECKING:
    from support.realkube import Plane

MANAGER = "node-health-realkube"
# Kinds a manifest may hold that the double's install routes lack.
_EXTRA = {"ConfigMap": ("v1", "configmaps", True), "Secret": ("v1", "secrets", True)}


def path_of(doc: dict[str, Any]) -> str:
    """The object's URL path on the API server, from its apiVersion, kind, namespace and name."""
    kind, meta = doc["kind"], doc["metadata"]
    found = _EXTRA.get(kind)
    if found is None:
        found = next(
            (gv, resource, namespaced)
            for gv, resources in GROUPS.items()
            for resource, (name, namespaced) in resources.items()
            if name == kind and gv == doc["apiVersion"]
        )
    group_version, resource, namespaced = found
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    where = f"/namespaces/{meta['namespace']}" if namespaced else ""
    return f"{root}{where}/{resource}/{meta['name']}"


def apply(real: Plane, docs: list[dict[str, Any]], manager: str = MANAGER) -> list[tuple[str, int, Any]]:
    """Server-side apply of each document: (path, status, answer), in order."""
    answers = []
    for doc in docs:
        path = path_of(doc)
        status, answer = real.request(
            "PATCH", f"{path}?fieldManager={manager}&force=true", doc, content_type="application/apply-patch+yaml"
        )
        answers.append((path, status, answer))
    return answers


def install(real: Plane, directory: Path = REPO / "deploy") -> list[dict[str, Any]]:
    """`kubectl kustomize` of `directory` applied server-side; every object must be accepted."""
    docs = rendered(directory)
    refused = [(path, status, answer) for path, status, answer in apply(real, docs) if status not in (200, 201)]
    assert not refused, refused
    return docs


def type_check(real: Plane, name: str) -> dict[str, Any] | None:
    """The policy's status.typeChecking once the status controller has checked its current generation, else
    None."""
    status, policy = real.request("GET", f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}")
    assert status == 200, policy
    checked = policy.get("status") or {}
    if checked.get("observedGeneration") != policy["metadata"]["generation"]:
        return None
    return dict(checked.get("typeChecking") or {})


__all__ = ["MANAGER", "apply", "install", "path_of", "type_check"]
