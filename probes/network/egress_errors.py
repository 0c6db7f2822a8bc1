"""The reasons an egress check fails for, the error that carries one out of a phase, and the target's deadline."""

from __future__ import annotations

import time
from typing import Any

from probes.base import Reason, Status

EGRESS_DNS_FAILED = Reason(
    "EgressDnsFailed",
    Status.FAIL,
    "the target's (or its proxy's) name does not resolve from this node",
    "the name does not resolve from this node: check the network.dns findings and the node's resolv.conf; "
    "add the missing internal DNS record (or split-horizon zone)",
)
EGRESS_REFUSED = Reason(
    "EgressRefused",
    Status.FAIL,
    "actively refused or rejected: TCP RST, ICMP unreachable, a blackhole or prohibit route (observed.errno), "
    "the proxy answering CONNECT with e.g. 403, or a reset at the TLS ClientHello (SNI filtering)",
    "add this host:port to the egress whitelist / proxy allow-list, or check the service is listening",
)
EGRESS_PROXY_AUTH_REQUIRED = Reason(
    "EgressProxyAuthRequired",
    Status.FAIL,
    "the proxy answered 407 Proxy Authentication Required: without credentials (observed.proxy_authenticate "
    "names the scheme it asks for), or refusing the ones configured (observed.proxy_credentials says where "
    "they came from: the proxy URL's userinfo or proxy_credentials_file)",
    "proxy authentication required: give the target the proxy's credentials (proxy_credentials_file, a file "
    "holding USER:PASSWORD mounted from a Secret, or http://USER:PASSWORD@PROXY:PORT); when they were sent "
    "and refused, they are wrong, expired or rotated: update the Secret",
)
EGRESS_PROXY_STALLED = Reason(
    "EgressProxyStalled",
    Status.FAIL,
    "the proxy accepted the TCP connection but did not answer CONNECT within the deadline (observed.phase proxy)",
    "the proxy accepted the connection but did not answer the CONNECT: the proxy is stalled or filtering (not "
    "the network on the way to it); check the proxy's health and logs, and its own route to the destination",
)
EGRESS_PROXY_CREDENTIALS_UNREADABLE = Reason(
    "EgressProxyCredentialsUnreadable",
    Status.UNKNOWN,
    "proxy_credentials_file cannot be read, or does not hold USER:PASSWORD on its first line; the target was "
    "not checked (the proxy would only answer 407)",
    "mount the Secret holding the proxy credentials at proxy_credentials_file (one line USER:PASSWORD) and "
    "check the agent can read it",
)
EGRESS_TIMEOUT = Reason(
    "EgressTimeout",
    Status.FAIL,
    "no answer in time at observed.phase (dns, connect, tls, http): packets silently dropped; at connect, "
    "every address the name resolves to was tried and observed.failed says how each failed",
    "the egress firewall or security group silently drops this destination: whitelist it, or check the "
    "routes and the proxy",
)
EGRESS_TLS_FAILED = Reason(
    "EgressTlsFailed",
    Status.FAIL,
    "the TLS handshake failed; observed.tls_error has OpenSSL's reason (self-signed certificate, hostname "
    "mismatch, WRONG_VERSION_NUMBER)",
    "an intercepting proxy with its own CA: set ca_file to its CA; otherwise fix the certificate, the "
    "hostname or the port",
)
EGRESS_HTTP_STATUS = Reason(
    "EgressHttpStatus",
    Status.FAIL,
    "the server answered GET http_path with a status not in expect_status (a mirror answering 503), or with "
    "no valid HTTP",
    "a mirror under maintenance (503), an authentication wall (401/403), or a wrong http_path",
)
EGRESS_CHECK_FAILED = Reason(
    "EgressCheckFailed",
    Status.UNKNOWN,
    "the check itself raised an unexpected error",
    "report it with the message; the other targets are still checked",
)
EGRESS_FAILURES = (
    EGRESS_DNS_FAILED,
    EGRESS_REFUSED,
    EGRESS_PROXY_AUTH_REQUIRED,
    EGRESS_PROXY_STALLED,
    EGRESS_PROXY_CREDENTIALS_UNREADABLE,
    EGRESS_TIMEOUT,
    EGRESS_TLS_FAILED,
    EGRESS_HTTP_STATUS,
    EGRESS_CHECK_FAILED,
)


class EgressError(Exception):
    """One failed phase of an egress check: its reason and a one-line message."""

    def __init__(self, reason: Reason, message: str, **observed: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.observed = observed


class Deadline:
    def __init__(self, seconds: float, configured: float) -> None:
        self.seconds = max(0.0, seconds)
        self.configured = configured
        self.end = time.monotonic() + self.seconds

    def left(self, phase: str, what: str) -> float:
        """Seconds left for `phase` (dns, connect, proxy, tls, http); EgressTimeout at that phase when none."""
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise EgressError(EGRESS_TIMEOUT, f"no time left before {what} ({self.describe()})", phase=phase)
        return remaining

    def describe(self) -> str:
        if self.seconds < self.configured:
            return f"{self.seconds:.1f} s, cut from timeout_seconds {self.configured:g} s to the probe's deadline"
        return f"{self.seconds:g} s"
