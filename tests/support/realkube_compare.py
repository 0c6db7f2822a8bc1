"""The same raw calls against a real control plane and the API double (tests/support/kube_double.py), so a test
can compare their status codes and answers' shapes: the double must not drift from kube-apiserver again."""

from __future__ import annotations

from typing import Any

from support.kube_double import ApiDouble
from support.realkube import ADMIN_TOKEN, Requester, raw_request


class Double:
    """The double behind the same `request` a real Plane has (its tokens are not checked)."""

    def __init__(self, api: ApiDouble) -> None:
        self.api = api

    def request(
        self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN, content_type: str = ""
    ) -> tuple[int, Any]:
        return raw_request(self.api.host + path, method, body, token, content_type)


def shape(answer: Any) -> Any:
    """What a client reads of an answer: the kind, or a Status's status, reason and code."""
    if not isinstance(answer, dict):
        return type(answer).__name__
    if answer.get("kind") == "Status":
        return ("Status", answer.get("status"), answer.get("reason"), answer.get("code"))
    return answer.get("kind")


def both(real: Requester, double: Requester, method: str, path: str, body: Any = None, content_type: str = "") -> Any:
    """One call on each: ((real status, real answer), (double status, double answer))."""
    return (
        real.request(method, path, body, content_type=content_type),
        double.request(method, path, body, content_type=content_type),
    )


__all__ = ["Double", "both", "shape"]
