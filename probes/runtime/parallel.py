"""Independent checks of one probe run (names, egress targets, NTP servers) in parallel threads, each bounded
by its own deadline and all of them by the probe's. A probe reports a check that did not finish by the
deadline under a reason of its own family (network: DeadlineExceeded)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# One thread per check: a node lists a handful of names and targets, and every check mostly waits on the
# network. The cap only guards against a config with hundreds of entries.
MAX_WORKERS = 64
# Each check must be over this long before the probe's deadline (its own timeouts are cut to that) ...
CHECK_MARGIN = 0.35
# ... and the probe stops waiting for checks this long before it, to build the findings and return them
# before the scheduler calls the run overdue (ProbeTimeout). The gap between the two lets a check that
# ran into its cut deadline still report what timed out, rather than being given up as DeadlineExceeded.
RESULT_MARGIN = 0.1


def check_end(deadline: float) -> float:
    """The monotonic time by which each check of a probe run with this deadline must be over."""
    return deadline - CHECK_MARGIN


def wait_end(deadline: float) -> float:
    """The monotonic time until which a probe run with this deadline waits for its checks."""
    return deadline - RESULT_MARGIN


def seconds_until(end: float) -> float:
    """Seconds from now until the monotonic time `end` (negative once it has passed)."""
    return end - time.monotonic()


def run_parallel(jobs: Sequence[Callable[[], T]], wait_seconds: float) -> list[T | None]:
    """Run each job in a thread; results in order, None for a job still running after `wait_seconds`.

    Every job bounds itself (socket timeouts, resolver lifetimes cut to the probe's deadline); the wait is
    only a backstop, and the pool is not joined, so a straggler never holds the probe past its deadline.
    """
    if not jobs:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(jobs)))
    try:
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures, timeout=max(0.0, wait_seconds))
        return [future.result() if future.done() else None for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
