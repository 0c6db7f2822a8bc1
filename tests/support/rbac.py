"""RBAC rules against the API calls a command really made (recorded by the API double): exactly what it calls is
granted, nothing more, and where a rule names its objects (resourceNames), only those."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from support.kube_double import Request

PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)
GROUP_PATH = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?"
    r"(?:/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?)?$"
)
VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
Call = tuple[str, str, str]  # (apiGroup, resource, verb)
Grant = tuple[str, list[str] | None]  # (namespace of the Role, "" for a ClusterRole; resourceNames: None for any)


def calls(log: list[Request], token: str | None = None) -> dict[Call, set[tuple[str, str]]]:
    """(group, resource, verb) → the (namespace, name) pairs it was used on; only the requests that carried `token`
    when given. Discovery (`/apis/<group>/<version>`, a non-resource URL the system:discovery role lets every
    authenticated user read) needs no grant."""
    used: dict[Call, set[tuple[str, str]]] = {}
    for request in log:
        if token is not None and request.token != token:
            continue
        group = ""
        match = PATH.match(request.path)
        if match is None:
            match = GROUP_PATH.match(request.path)
            assert match is not None, request.path
            assert request.method == "GET" or match["resource"], request.path
            if match["resource"] is None:
                continue
            group = match["group"]
        found = match.groupdict()
        resource = found["resource"] + (f"/{found['sub']}" if found.get("sub") else "")
        if request.method == "GET":
            verb = "watch" if request.query.get("watch") == ["true"] else ("get" if found["name"] else "list")
        else:
            verb = VERBS[request.method]
        used.setdefault((group, resource, verb), set()).add((found.get("ns") or "", found["name"] or ""))
    return used


def granted(*paths: Path) -> dict[Call, list[Grant]]:
    """call → the grants of it: ("", names) for a ClusterRole's, (namespace, names) for a Role's."""
    grants: dict[Call, list[Grant]] = {}
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("ClusterRole", "Role"):
                continue
            namespace = "" if doc["kind"] == "ClusterRole" else doc["metadata"]["namespace"]
            for rule in doc["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            held = grants.setdefault((group, resource, verb), [])
                            assert namespace not in {ns for ns, _ in held}, (
                                f"granted twice: {namespace} {verb} {resource}"
                            )
                            held.append((namespace, rule.get("resourceNames")))
    return grants


def assert_least_privilege(used: dict[Call, set[tuple[str, str]]], *paths: Path) -> None:
    """Every call granted (and on the objects the grant names), and every grant used."""
    grants = granted(*paths)
    assert set(used) == set(grants), (
        f"unused grants: {sorted(set(grants) - set(used))}; missing grants: {sorted(set(used) - set(grants))}"
    )
    assert_granted(used, *paths)


def assert_granted(used: dict[Call, set[tuple[str, str]]], *paths: Path) -> None:
    """Every call granted, on the objects the grant names."""
    grants = granted(*paths)
    assert set(used) <= set(grants), f"missing grants: {sorted(set(used) - set(grants))}"
    for call, targets in used.items():
        for ns, name in targets:
            fitting = [names for where, names in grants[call] if where in ("", ns)]
            assert fitting, f"{call} in namespace {ns!r}: granted only in {[w for w, _ in grants[call]]}"
            # resourceNames authorize only requests that name an object (never a list, a watch or a create).
            assert any(names is None or (name and name in names) for names in fitting), (call, ns, name, fitting)
