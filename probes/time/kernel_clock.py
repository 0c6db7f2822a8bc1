"""The kernel's clock discipline state by adjtimex(2) with modes=0: read-only, unprivileged, and not
namespaced (a pod sees the host kernel's state). STA_UNSYNC or a TIME_ERROR return means nothing is
disciplining the clock; maxerror then grows to its 16 s cap.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

TIME_OK, TIME_INS, TIME_DEL, TIME_OOP, TIME_WAIT, TIME_ERROR = range(6)
STA_PLL = 0x0001
STA_UNSYNC = 0x0040
STA_CLOCKERR = 0x1000
STA_NANO = 0x2000
CLOCK_STATES = {
    TIME_OK: "TIME_OK",
    TIME_INS: "TIME_INS",
    TIME_DEL: "TIME_DEL",
    TIME_OOP: "TIME_OOP",
    TIME_WAIT: "TIME_WAIT",
    TIME_ERROR: "TIME_ERROR",
}


class Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class Timex(ctypes.Structure):
    """struct timex of <sys/timex.h> (glibc). The kernel ABI is the same on x86_64 and aarch64 (LP64):
    208 bytes, natural alignment supplies the padding after the int members."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


@dataclass(frozen=True)
class KernelClock:
    state: int  # adjtimex's return value: TIME_OK ... TIME_ERROR
    status: int  # STA_* bits
    maxerror_us: int
    esterror_us: int
    offset: int  # µs, or ns with STA_NANO
    freq: int  # ppm << 16
    tai: int

    @property
    def unsynced(self) -> bool:
        return bool(self.status & STA_UNSYNC) or self.state == TIME_ERROR

    @property
    def unsynced_why(self) -> str:
        return "STA_UNSYNC" if self.status & STA_UNSYNC else "TIME_ERROR"

    @property
    def offset_seconds(self) -> float:
        return self.offset / (1e9 if self.status & STA_NANO else 1e6)

    def observed(self) -> dict[str, Any]:
        return {
            "state": CLOCK_STATES.get(self.state, str(self.state)),
            "status": f"0x{self.status:04x}",
            "unsync": bool(self.status & STA_UNSYNC),
            "clockerr": bool(self.status & STA_CLOCKERR),
            "maxerror_seconds": self.maxerror_us / 1e6,
            "esterror_seconds": self.esterror_us / 1e6,
            "pll_offset_seconds": self.offset_seconds,
            "freq_ppm": round(self.freq / 65536, 3),
            "tai_offset": self.tai,
        }


_libc: ctypes.CDLL | None = None


def read_kernel_clock() -> KernelClock:
    """adjtimex(2) with modes=0: reads the kernel's clock discipline state without changing anything."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    tx = Timex()
    tx.modes = 0
    state = _libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return KernelClock(state, tx.status, tx.maxerror, tx.esterror, tx.offset, tx.freq, tx.tai)
