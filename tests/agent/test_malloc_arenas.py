"""The daemon caps glibc's malloc arenas (agent.daemon.limit_malloc_arenas): threads that come and go, as
probe runs do, otherwise each take an arena of their own and RSS creeps up with the memory they keep.

Counted the way glibc reports them (malloc_info's <heap nr=...> elements), in a child process whose threads
allocate at the same time: with the cap and, as the control, without it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.system import REPO

CHILD = textwrap.dedent(
    """
    import ctypes, os, re, sys, threading
    sys.path.insert(0, sys.argv[1])
    from agent.daemon import limit_malloc_arenas
    if sys.argv[2] == "capped":
        assert limit_malloc_arenas()
    barrier = threading.Barrier(16)
    def work():
        barrier.wait()  # all at once, so glibc sees contention and hands out arenas
        kept = [bytes(4096 + i) for i in range(2000)]  # above pymalloc's 512 bytes: glibc malloc
        barrier.wait()
        del kept
    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    path = f"/tmp/node-health-malloc-info-{os.getpid()}"
    handle = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(handle))
    libc.fclose(ctypes.c_void_p(handle))
    text = open(path).read()
    os.unlink(path)
    print(len(re.findall(r"<heap nr=", text)))
    """
)


def arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_probe_threads_share_at_most_two_malloc_arenas() -> None:
    assert arenas("capped") <= 2
    assert arenas("default") > 2, "the control: without the cap the threads take arenas of their own"
