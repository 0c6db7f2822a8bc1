"""Running a function inside another network namespace, and reading the host namespace's network sysctls.

The agent itself never changes namespace: a forked, single-threaded child (Host.child_call, with a
deadline) enters the namespace by setns(2) and calls the function there, so all of the child moves and
nothing of the agent does. Entering /proc/1/ns/net needs CAP_SYS_ADMIN; with hostNetwork the agent is
already in the host's namespace and nothing is entered.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from probes.runtime.host import Host

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def _setns(fd: int, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _in_netns(netns_path: str | None, fn: Callable[..., T], *args: Any) -> T:
    """Runs in a child (ChildCalls): enter the network namespace, then call fn. The child is single-
    threaded, so setns moves all of it; the agent process itself never changes namespace."""
    if netns_path is not None:
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd, CLONE_NEWNET)
        finally:
            os.close(fd)
    return fn(*args)


def call_in_netns(host: Host, key: str, netns_path: str | None, fn: Callable[..., T], *args: Any, timeout: float) -> T:
    """fn(*args) in a forked child inside the namespace, with a deadline. Raises OSError (TimeoutError when
    the deadline passed)."""
    result = host.child_call(key, _in_netns, netns_path, fn, *args, timeout=timeout)
    if result.ok:
        return result.value
    if result.hung:
        raise TimeoutError(errno.ETIMEDOUT, f"{key}: no answer within {timeout:.1f} s ({result.error})")
    raise OSError(result.errno or errno.EIO, result.error)


def choose_netns(host: Host, configured: str) -> tuple[str | None, str]:
    """(path to enter or None for the agent's own namespace, a label for messages)."""
    if configured:
        return configured, configured
    host_ns = host.proc_path(1, "ns", "net")
    try:
        theirs = os.stat(host_ns)
        ours = os.stat("/proc/self/ns/net")
    except OSError as exc:
        return None, f"agent's own (cannot open {host_ns}: {exc.strerror})"
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return None, "host (hostNetwork)"
    return str(host_ns), f"host ({host_ns})"


def read_files(directory: str, names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        with open(os.path.join(directory, name)) as fh:
            out[name] = fh.read()
    return out


def read_host_net_sysctls(host: Host, names: tuple[str, ...], timeout: float) -> dict[str, str]:
    """net.ipv4.<name> as the host's network namespace sees them: network sysctls belong to the namespace
    of the process that reads them, and the agent's pod has its own. Raises OSError."""
    netns_path, _ = choose_netns(host, "")
    directory = str(host.proc_path("sys", "net", "ipv4"))
    return call_in_netns(host, "net-sysctls", netns_path, read_files, directory, names, timeout=timeout)
