"""The timing bound's clock on a CPU slot: the supervisor's wall clock less the time the kernel
kept the executor's main thread waiting for a core that the executor's own threads did not take
(schedstat's run-queue wait and the kernel's CPU clocks, read from /proc: kernel accounting the
candidate cannot rebind).

On a loaded host (a CI machine with many jobs per core) the plain wall around a timing request
grew with the waits between an honest executor's calls, and honest reports broke the bound; the
waits are the host's, not the candidate's, so they are taken out. Time the executor spends on a
core or asleep (a kernel that sleeps to look cheap) stays in. Never run in an executor.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Callable, Optional

from fibray.workers.process.sandbox import stat_fields


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but not running) of the main thread of `pid` (0 where unreadable)."""
    try:
        on_cpu, waited = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
        return int(on_cpu) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def waited_children_cpu_s(pid: int) -> float:
    """CPU seconds of the children `pid` has waited for (cutime + cstime; clock ticks)."""
    try:
        fields = stat_fields(pid)
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def unloaded_clock(pid: int) -> Callable[[], float]:
    """A monotonic clock that stands still while the host keeps `pid`'s main thread off a core, but
    not while the process's own threads (and the children it collected) do: wall - max(0, main
    thread's run-queue wait - CPU of the process's other threads and waited-for children).

    A candidate that lowers its main thread's priority and hands its work to threads of its own
    makes its main thread wait for a core as a loaded host does; that wait is its own doing and is
    counted (`offender_hides_behind_threads`). The cap keeps the reading at or below the plain wall:
    an honest multi-threaded candidate on an idle host reads the wall, as before. Children that
    are collected automatically (SIGCHLD ignored) leave no CPU time to add: not covered."""
    total = process_cpu_clock(pid)

    def read() -> float:
        on_cpu, waited = _schedstat(pid)
        others = (max(0.0, total() - on_cpu) if total is not None else 0.0) + waited_children_cpu_s(pid)
        return time.perf_counter() - max(0.0, waited - others)

    return read


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
