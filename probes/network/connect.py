"""TCP to a name's addresses as curl does it: RFC 8305 Happy Eyeballs within the target's deadline.

A name that resolves to a dead address first (a dual-stack mirror whose IPv6 address drops packets) must not
cost the whole deadline: the next address is tried as soon as the one before failed or had
CONNECTION_ATTEMPT_DELAY alone, and the first to accept wins. When none does, the error names every address and
how it failed, so a finding says "[fd00::2]:443 no answer; 192.0.2.7:443 refused", not just the first.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from probes.network.egress_errors import EGRESS_DNS_FAILED, EGRESS_REFUSED, EGRESS_TIMEOUT, Deadline, EgressError

# RFC 8305's Connection Attempt Delay: how long one attempt has alone before the next address is tried too
# (curl's --happy-eyeballs-timeout-ms default is 200 ms, the RFC recommends 250 ms).
CONNECTION_ATTEMPT_DELAY = 0.25

# connect(2) errors that mean a route or firewall rejected the destination, with what usually causes them.
REJECTED_ERRNOS = {
    errno.EHOSTUNREACH: "no route to host: an unreachable route or an ICMP host-unreachable/prohibited reject",
    errno.ENETUNREACH: "network unreachable: no route to it",
    errno.EACCES: "a local firewall rule or prohibit route",
    errno.EPERM: "a local firewall rule",
    errno.EINVAL: "a blackhole route",
}
_NOT_TRIED = OSError(0, "not tried")  # the deadline ended before this address's turn


def shown_address(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def interleaved(addresses: Sequence[str]) -> list[str]:
    """RFC 8305 section 4: alternate the address families, starting with the first address's family, so a dead
    family costs one attempt delay, not a connect timeout per address. Duplicates are tried once."""
    unique = list(dict.fromkeys(addresses))
    first = [a for a in unique if (":" in a) == (":" in unique[0])] if unique else []
    second = [a for a in unique if a not in first]
    out: list[str] = []
    for index in range(max(len(first), len(second))):
        out.extend(group[index] for group in (first, second) if index < len(group))
    return out


def failure_text(error: OSError | None) -> str:
    if error is _NOT_TRIED:
        return "not tried (no time left)"
    if error is None or error.errno == errno.ETIMEDOUT:
        return "no answer"
    if error.errno == errno.ECONNREFUSED:
        return "refused"
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return f"rejected ({name})"


def _start(address: str, port: int) -> socket.socket | OSError:
    """A non-blocking connect under way to address:port, or why it could not start (no IPv6, a route)."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        return exc
    sock.setblocking(False)
    try:
        code = sock.connect_ex((address, port))
    except OSError as exc:  # an address the socket layer cannot take (a bad scope id): that address fails
        sock.close()
        return exc
    if code in (0, errno.EINPROGRESS):
        return sock
    sock.close()
    return OSError(code, os.strerror(code))


class _Race:
    """The attempts under way, polled (not select(): the agent's fds may number past FD_SETSIZE)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[socket.socket, str]] = {}
        self.poller = select.poll()

    def add(self, sock: socket.socket, address: str) -> None:
        self.pending[sock.fileno()] = (sock, address)
        self.poller.register(sock.fileno(), select.POLLOUT)

    def wait(self, seconds: float) -> list[tuple[socket.socket, str, int]]:
        """The attempts that ended within `seconds`: (socket, address, 0 or the errno it failed with)."""
        ended = []
        for fd, _ in self.poller.poll(max(0, math.ceil(seconds * 1000))):
            sock, address = self.pending.pop(fd)
            self.poller.unregister(fd)
            ended.append((sock, address, sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)))
        return ended

    def close(self) -> None:
        for sock, _ in self.pending.values():
            sock.close()
        self.pending.clear()


def connect(
    addresses: Sequence[str], port: int, deadline: Deadline, what: str
) -> tuple[socket.socket, str, dict[str, str]]:
    """TCP to the address that accepts first, racing them as curl does: the next address starts when the one
    before failed or had CONNECTION_ATTEMPT_DELAY alone, so a dead first address costs a quarter of a second,
    not the deadline. Returns (socket, address, {address: how it failed} for the ones that lost); raises an
    EgressError naming every address and how it failed when none accepts (observed.failed maps them)."""
    order = interleaved(addresses)
    if not order:
        raise EgressError(EGRESS_DNS_FAILED, f"no address for {what}", phase="dns")
    deadline.left("connect", f"the TCP connect to {what}")
    race = _Race()
    failed: dict[str, OSError | None] = {}
    index, next_start = 0, 0.0
    try:
        while True:
            now = time.monotonic()
            if index < len(order) and (now >= next_start or not race.pending):
                address = order[index]
                index += 1
                started = _start(address, port)
                if isinstance(started, OSError):
                    failed[address], next_start = started, now  # failed at once: the next one starts now
                    continue
                race.add(started, address)
                next_start = now + CONNECTION_ATTEMPT_DELAY
            if not race.pending:
                break
            remaining = deadline.end - time.monotonic()
            if remaining <= 0:
                break
            wait = remaining if index >= len(order) else min(remaining, max(0.0, next_start - time.monotonic()))
            for sock, address, code in race.wait(wait):
                if code == 0:
                    sock.setblocking(True)
                    lost = {a: failure_text(failed.get(a)) for a in order[:index] if a != address}
                    return sock, address, lost
                sock.close()
                failed[address], next_start = OSError(code, os.strerror(code)), time.monotonic()
    finally:
        race.close()
    for address in order[index:]:
        failed[address] = _NOT_TRIED
    no_connection(order, failed, port, deadline, what)


def no_connection(
    order: Sequence[str], failed: dict[str, OSError | None], port: int, deadline: Deadline, what: str
) -> NoReturn:
    """The error for a connect where no address accepted: a timeout when any stayed silent, else the first
    rejection, else a refusal; the message names every address with how it failed."""
    errors = {address: failed.get(address) for address in order}
    tried = "; ".join(f"{shown_address(address)}:{port} {failure_text(error)}" for address, error in errors.items())
    observed: dict[str, Any] = {"failed": {address: failure_text(error) for address, error in errors.items()}}
    listed = f" ({tried})" if len(errors) > 1 else ""
    silent = [a for a, error in errors.items() if error is None or error.errno == errno.ETIMEDOUT]
    if silent:
        message = f"TCP connect to {what} got no answer within {deadline.describe()} ({tried})"
        raise EgressError(EGRESS_TIMEOUT, message, phase="connect", address=silent[0], **observed)
    for address, error in errors.items():
        if error is not None and error.errno in REJECTED_ERRNOS:
            name = errno.errorcode[error.errno]
            message = (
                f"connection to {what} ({shown_address(address)}:{port}) rejected: {name}, "
                f"{REJECTED_ERRNOS[error.errno]}{listed}"
            )
            raise EgressError(EGRESS_REFUSED, message, phase="connect", address=address, errno=name, **observed)
    refused = [a for a, error in errors.items() if error is not None and error.errno == errno.ECONNREFUSED]
    if refused:
        message = f"{what} ({shown_address(refused[0])}:{port}) refused the connection{listed}"
        raise EgressError(EGRESS_REFUSED, message, phase="connect", address=refused[0], **observed)
    address, error = next(iter(errors.items()))
    name = errno.errorcode.get(error.errno or 0, str(error.errno)) if error is not None else ""
    message = f"TCP connect to {what} failed: {tried}"
    raise EgressError(EGRESS_REFUSED, message, phase="connect", address=address, errno=name, **observed)
