"""Python child processes in known states (a FileBaton waiter, an idle event loop, a socket read, a busy loop,
a soft-lock poller), for py-spy classification and storage.locks waiter tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

# Mirrors torch/utils/file_baton.py and the way cpp_extension._jit_compile uses it.
FILE_BATON = textwrap.dedent(
    """
    import os, sys, time

    class FileBaton:
        def __init__(self, lock_file_path, wait_seconds=0.1):
            self.lock_file_path = lock_file_path
            self.wait_seconds = wait_seconds
            self.fd = None

        def try_acquire(self):
            try:
                self.fd = os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL)
                return True
            except FileExistsError:
                return False

        def wait(self):
            while os.path.exists(self.lock_file_path):
                time.sleep(self.wait_seconds)

    def _jit_compile(name, build_directory):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            raise SystemExit("the test expected a stale lock")
        print("ready", flush=True)
        baton.wait()

    def bare_wait(lock):
        baton = FileBaton(lock)
        print("ready", flush=True)
        baton.wait()

    if sys.argv[1] == "jit":
        _jit_compile("fused_adam", sys.argv[2])
    else:
        bare_wait(sys.argv[2])
    """
)

IDLE_LOOP = textwrap.dedent(
    """
    import asyncio

    async def engine_core_client():
        queue = asyncio.Queue()
        print("ready", flush=True)
        await queue.get()  # the engine core never answers

    asyncio.run(engine_core_client())
    """
)

SOCKET_READ = textwrap.dedent(
    """
    import socket
    left, right = socket.socketpair()
    print("ready", flush=True)
    left.recv(10)
    """
)

BUSY = textwrap.dedent(
    """
    print("ready", flush=True)
    def spin():
        n = 0
        while True:
            n += 1
    spin()
    """
)

SOFT_LOCK_POLL = textwrap.dedent(
    """
    import os, sys, time

    def acquire_soft_lock(lock_path):
        print("ready", flush=True)
        while True:
            try:
                os.close(os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return
            except FileExistsError:
                time.sleep(0.05)

    acquire_soft_lock(sys.argv[1])
    """
)


@contextlib.contextmanager
def child(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"child did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
