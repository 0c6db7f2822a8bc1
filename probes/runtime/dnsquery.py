"""One name looked up the way the C library would: nameserver after nameserver, each given the wait glibc
gives it, round after round, with every try on the clock.

glibc's resolver (res_send.c) asks the nameservers of resolv.conf in order; the i-th waits `timeout << i`
seconds, divided by the number of nameservers for every one after the first (whole seconds, at least 1), and
it goes round them `attempts` times. `options timeout:N` (default 5, at most 30) and `attempts:N` (default 2,
at most 5) set that. A nameserver that answers SERVFAIL, REFUSED or NOTIMP is passed for the next; an answer
or NXDOMAIN ends the lookup. So a silent first nameserver costs every lookup `timeout` seconds before the next
one answers: `Tries` says which nameservers did not answer and how long each was waited for, for the finding to
name them.

dnspython builds and parses the messages (`dns.query.udp`, `dns.query.tcp` after a truncated answer); the
schedule is this module's, because dnspython gives every nameserver the same timeout and reads no `attempts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype

# glibc's defaults and bounds (resolv.h: RES_TIMEOUT, RES_MAXRETRANS, RES_DFLRETRY, RES_MAXRETRY).
GLIBC_TIMEOUT = 5
GLIBC_MAX_TIMEOUT = 30
GLIBC_ATTEMPTS = 2
GLIBC_MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class ResolvOptions:
    """The `options` of a resolv.conf that set the tries (None: the file does not say)."""

    timeout: int | None = None
    attempts: int | None = None


def parse_resolv_options(text: str) -> ResolvOptions:
    """`options timeout:N attempts:N` as glibc reads them: the last one given wins, clamped to glibc's bounds."""
    timeout: int | None = None
    attempts: int | None = None
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split(";", 1)[0].split()
        if not fields or fields[0] != "options":
            continue
        for option in fields[1:]:
            name, _, value = option.partition(":")
            if not value.isdigit():
                continue
            if name == "timeout":
                timeout = min(int(value), GLIBC_MAX_TIMEOUT)
            elif name == "attempts":
                attempts = max(1, min(int(value), GLIBC_MAX_ATTEMPTS))
    return ResolvOptions(timeout, attempts)


@dataclass(frozen=True)
class TrySchedule:
    """How long each nameserver is waited for, and how many rounds."""

    first_wait: float  # seconds for the first nameserver's try
    attempts: int | None  # rounds over the nameservers; None: until the lifetime ends
    glibc: bool  # the C library's waits (later nameservers: first_wait << i / count, whole seconds, >= 1)
    source: str  # where the wait comes from, for messages: "resolv.conf options timeout:1"

    @classmethod
    def from_options(cls, options: ResolvOptions, default_wait: float) -> TrySchedule:
        """glibc's schedule from a resolv.conf's options; where it sets no timeout, `default_wait` stands in for
        glibc's 5 s (the agent's network.dns.timeout_seconds), so a silent nameserver is named within the
        lookup's lifetime."""
        attempts = options.attempts or GLIBC_ATTEMPTS
        if options.timeout is not None:
            return cls(float(options.timeout), attempts, True, f"resolv.conf options timeout:{options.timeout}")
        return cls(default_wait, attempts, True, f"network.dns.timeout_seconds {default_wait:g}")

    def wait(self, index: int, count: int) -> float:
        """Seconds the `index`-th of `count` nameservers is given for one try."""
        if not self.glibc:
            return self.first_wait
        seconds = self.first_wait * (1 << index) / (count if index else 1)
        if float(self.first_wait).is_integer():
            seconds = int(seconds)  # glibc's int arithmetic
        return max(seconds, 1.0 if float(self.first_wait).is_integer() else 0.05)


@dataclass(frozen=True)
class Nameserver:
    address: str
    port: int = 53

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    def shown(self) -> str:
        """As resolv.conf names it: the address alone on port 53."""
        return self.address if self.port == 53 else str(self)


@dataclass
class Tries:
    """What each nameserver did, across the tries of one lookup."""

    silent: dict[str, float] = field(default_factory=dict)  # nameserver → seconds waited for it in vain
    errors: dict[str, str] = field(default_factory=dict)  # nameserver → SERVFAIL, REFUSED, a malformed answer
    answered_by: str = ""
    failed_tries: int = 0  # tries that ended in an error at once (no route, a malformed answer), not silence


class LookupTimeout(Exception):
    """No nameserver answered within the tries, or the lifetime ran out."""


def ask(
    servers: list[Nameserver],
    qname: dns.name.Name,
    rdtype: dns.rdatatype.RdataType,
    schedule: TrySchedule,
    deadline: float,
    tries: Tries,
) -> dns.message.Message | None:
    """One question, the nameservers in turn as `schedule` says: the first answer that is an answer (NOERROR or
    NXDOMAIN); None when every nameserver refused or failed it; LookupTimeout when none answered in time."""
    query = dns.message.make_query(qname, rdtype)
    rounds = 0
    while schedule.attempts is None or rounds < schedule.attempts:
        rounds += 1
        failed = 0
        for index, server in enumerate(servers):
            left = deadline - time.monotonic()
            if left <= 0.01:
                raise LookupTimeout
            wait = min(schedule.wait(index, len(servers)), left)
            errors_before = tries.failed_tries
            answer = _one_try(query, server, wait, tries)
            if answer is None:
                # An error (no route to it, a malformed answer) counts as a failed nameserver: when every one
                # fails so, another round says the same at once, and rounds until the lifetime would spin.
                if tries.failed_tries > errors_before:
                    failed += 1
                continue
            if answer.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
                tries.answered_by = server.shown()
                return answer
            tries.errors[server.shown()] = dns.rcode.to_text(answer.rcode())
            failed += 1
        if failed == len(servers):
            return None  # every nameserver answered, none usefully: another round would say the same
    raise LookupTimeout


def _one_try(query: dns.message.Message, server: Nameserver, wait: float, tries: Tries) -> dns.message.Message | None:
    """One nameserver's answer within `wait` (over TCP when the UDP answer is truncated), or None."""
    started = time.monotonic()
    try:
        answer = dns.query.udp(query, server.address, timeout=wait, port=server.port, ignore_unexpected=True)
        if answer.flags & dns.flags.TC:
            left = max(0.01, wait - (time.monotonic() - started))
            answer = dns.query.tcp(query, server.address, timeout=left, port=server.port)
    except dns.exception.Timeout:
        tries.silent[server.shown()] = tries.silent.get(server.shown(), 0.0) + (time.monotonic() - started)
        return None
    except (OSError, dns.exception.DNSException) as exc:
        tries.errors[server.shown()] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        tries.failed_tries += 1
        return None
    return answer


def candidates(name: str, search: list[dns.name.Name], ndots: int, use_search: bool) -> list[dns.name.Name]:
    """The names a lookup of `name` asks for, in order, as the C library expands a relative name: with
    `ndots` or more dots as written first, then each search domain; with fewer, the search domains first."""
    if name.endswith(".") or not use_search or not search:
        return [dns.name.from_text(name)]
    relative = dns.name.from_text(name, origin=None)
    expanded = [relative.concatenate(domain) for domain in search]
    as_written = relative.concatenate(dns.name.root)
    return [as_written, *expanded] if name.count(".") >= ndots else [*expanded, as_written]
