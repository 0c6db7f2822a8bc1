"""Judging the node's clock from the offsets NTP servers report, including servers that disagree.

Each server's offset is judged by the thresholds: below warn_offset_seconds ok, from warn to fail a warning,
at or above fail_offset_seconds a failure. When the servers disagree with each other by fail_offset_seconds
or more, some of them are wrong and their offsets say nothing about the node. The rule then, in the spirit
of NTP's own selection of truechimers:

- if one group of servers, all within fail_offset_seconds of each other, holds a strict majority, its
  members are judged as usual and every other server is a falseticker (NtpServersDisagree, warn);
- without such a majority, the server closest to the node is judged as usual (the node is at least that
  far from whichever server is right) and every other server is NtpServersDisagree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from probes.base import Status


class Kind(enum.Enum):
    OK = "ok"
    SKEW = "skew"  # the node is off from this server by warn_offset_seconds or more
    DISAGREE = "disagree"  # this server disagrees with the others: its offset does not judge the node


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    status: Status
    note: str = ""  # for DISAGREE: how it disagrees


def by_threshold(offset: float, warn: float, fail: float) -> Verdict:
    magnitude = abs(offset)
    if magnitude >= fail:
        return Verdict(Kind.SKEW, Status.FAIL)
    if magnitude >= warn:
        return Verdict(Kind.SKEW, Status.WARN)
    return Verdict(Kind.OK, Status.OK)


def majority_group(offsets: Mapping[str, float], fail: float) -> list[str] | None:
    """The servers of the one largest group within `fail` of each other, when it holds a strict majority
    and no other group of its size exists; None otherwise."""
    ordered = sorted(offsets, key=lambda server: offsets[server])
    groups: list[list[str]] = []
    for start in range(len(ordered)):
        end = start
        while end + 1 < len(ordered) and offsets[ordered[end + 1]] - offsets[ordered[start]] < fail:
            end += 1
        groups.append(ordered[start : end + 1])
    largest = max(len(group) for group in groups)
    candidates = {tuple(group) for group in groups if len(group) == largest}
    if largest * 2 <= len(offsets) or len(candidates) != 1:
        return None
    return list(candidates.pop())


def spread(offsets: Mapping[str, float]) -> float:
    return max(offsets.values()) - min(offsets.values()) if offsets else 0.0


def judge_offsets(offsets: Mapping[str, float], warn: float, fail: float) -> dict[str, Verdict]:
    """Server → verdict, for the servers that answered (offset: seconds the node is behind the server)."""
    if len(offsets) < 2 or spread(offsets) < fail:
        return {server: by_threshold(offset, warn, fail) for server, offset in offsets.items()}
    width = spread(offsets)
    majority = majority_group(offsets, fail)
    if majority is not None:
        note = f"off the majority of the servers ({', '.join(majority)}) by more than {fail:g} s"
        return {
            server: by_threshold(offset, warn, fail)
            if server in majority
            else Verdict(Kind.DISAGREE, Status.WARN, note)
            for server, offset in offsets.items()
        }
    closest = min(offsets, key=lambda server: abs(offsets[server]))
    note = f"the servers disagree by {width:.3f} s and no majority of them agrees"
    return {
        server: by_threshold(offset, warn, fail) if server == closest else Verdict(Kind.DISAGREE, Status.WARN, note)
        for server, offset in offsets.items()
    }
