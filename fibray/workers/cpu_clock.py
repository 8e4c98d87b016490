"""The timing bound's clock on a CPU slot: the supervisor's wall clock less the time the kernel
kept the executor's main thread waiting for a core (schedstat's run-queue wait, read from /proc:
kernel accounting the candidate cannot rebind).

On a loaded host (a CI machine with many jobs per core) the plain wall around a timing request
grew with the waits between an honest executor's calls, and honest reports broke the bound; the
waits are the host's, not the candidate's, so they are taken out. Time the executor spends on a
core or asleep (a kernel that sleeps to look cheap) stays in. Never run in an executor.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Callable, Optional


def run_queue_wait_s(pid: int) -> float:
    """Seconds the main thread of `pid` has spent runnable but not running (0 where unreadable)."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def unloaded_clock(pid: int) -> Callable[[], float]:
    """A monotonic clock that stands still while the host keeps `pid`'s main thread off a core."""
    return lambda: time.perf_counter() - run_queue_wait_s(pid)


def process_cpu_clock(pid: int) -> Optional[Callable[[], float]]:
    """The CPU seconds every thread of `pid` has used, exited threads included (the kernel's
    process CPU-time clock, clock_getcpuclockid): None where the kernel does not give it. Reads
    0.0 once the process is gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        clock_id = ctypes.c_int()
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock_id)) != 0:
            return None
    except (OSError, AttributeError):
        return None

    def read() -> float:
        try:
            return time.clock_gettime(clock_id.value)
        except OSError:
            return 0.0

    return read
