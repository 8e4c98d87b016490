"""The timing bound's clock on a CPU slot: the supervisor's wall clock less the time the kernel
kept the executor's main thread waiting for a core that the executor's own processes did not take
(schedstat's run-queue wait against the CPU time of the executor's cgroup: kernel accounting the
candidate cannot rebind); and, for a window in which the executor's main thread slept no more often
than an honest request makes it, the cgroup's CPU time (ExecutorStopwatch).

On a loaded host (a CI machine with many jobs per core) the plain wall around a timing request
grew with the waits between an honest executor's calls, and honest reports broke the bound; the
waits are the host's, not the candidate's, so they are taken out. Time the executor spends on a
core or asleep (a kernel that sleeps to look cheap) stays in, and so does the CPU time of every
process it starts: they are all in its cgroup (fibray.workers.process.cgroup), those the kernel
collected without telling it included. Without a cgroup the window is the plain wall. Never run
in an executor.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fibray.timing.bound import Stopwatch, WallStopwatch, Window
from fibray.workers.process.sandbox import stat_fields

SETTLE_S = 0.1
"""How long ExecutorStopwatch waits for the executor's main thread to block (in its next read of the
channel, right after its reply) before it reads the kernel's counters: until then the switch that
ends the window may not be counted yet. Usually a fraction of a millisecond; under two busy rivals
on a two-core host 20 ms was sometimes too short. A thread that does not block in time leaves the
window on the wall reading."""


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but not running) of the main thread of `pid` (0 where unreadable)."""
    try:
        on_cpu, waited = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
        return int(on_cpu) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


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


def _voluntary_switches(pid: int) -> Optional[int]:
    """Voluntary context switches of the main thread of `pid` (each sleep, each block), None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _settled(pid: int, timeout_s: float = SETTLE_S) -> bool:
    """Wait (spinning on /proc) until the main thread of `pid` sleeps, or is stopped (the supervisor stops
    an executor once its timing reply is in: fibray.workers.quiesce.Quiet.hold); False if it did
    neither in `timeout_s`."""
    end = time.perf_counter() + timeout_s
    while True:
        try:
            if stat_fields(pid)[0] in (b"S", b"T"):  # the process's state is its main thread's
                return True
        except (OSError, ValueError, IndexError):
            return False
        if time.perf_counter() >= end:
            return False


@dataclass(frozen=True)
class _Counters:
    wall: float
    on_cpu: float
    """Seconds the executor's main thread has run."""
    waited: float
    """Seconds the executor's main thread has waited for a core."""
    account: float
    """CPU seconds of every process in the executor's cgroup, exited ones included."""


def _counters(pid: int, account: Callable[[], float]) -> _Counters:
    on_cpu, waited = _schedstat(pid)
    return _Counters(time.perf_counter(), on_cpu, waited, account())


def unloaded_s(a: _Counters, b: _Counters) -> float:
    """The wall from `a` to `b` less the main thread's run-queue wait that the rest of the executor (its
    other threads and processes: the cgroup less the main thread) does not explain.

    A candidate that lowers its main thread's priority and hands its work to threads or processes of
    its own makes its main thread wait for a core as a loaded host does; that wait is its own doing
    and is counted (`offender_hides_behind_threads`, `offender_hides_in_reaped_children`). The cap
    keeps the reading at or below the plain wall."""
    others = max(0.0, (b.account - a.account) - (b.on_cpu - a.on_cpu))
    return (b.wall - a.wall) - max(0.0, (b.waited - a.waited) - others)


class ExecutorStopwatch:
    """The timing bound's window on a CPU slot (fibray.timing.bound.Stopwatch), around one request to
    the executor `pid` whose cgroup's CPU seconds `account` reads: the wall less the host's run-queue
    waits (unloaded_s), the cgroup's CPU time and the main thread's voluntary context switches, read
    from the kernel once that thread sleeps again after its reply.

    A window whose main thread slept no more than an honest request makes it (reading the request,
    blocking for the next) is held to the lesser of the two (Window.reading): that thread was on a
    core or waiting for one all along, so its calls' latency is CPU time, and what the wall adds is
    the host's (a hypervisor's stolen time, the supervisor's own wait for a core or a lock after the
    reply), which broke the bound of honest reports on a CI host. A candidate that sleeps, to wait
    for work it hid or to look cheap, is read on the wall: every sleep is a voluntary switch the
    kernel counts. Never run in an executor."""

    def __init__(self, pid: int, account: Callable[[], float]) -> None:
        self.pid, self.account = pid, account

    def start(self) -> None:
        self._v0 = _voluntary_switches(self.pid) if _settled(self.pid) else None
        self._c0 = _counters(self.pid, self.account)

    def stop(self) -> Window:
        v1 = _voluntary_switches(self.pid) if _settled(self.pid) else None
        c1 = _counters(self.pid, self.account)
        return Window(wall_s=unloaded_s(self._c0, c1), cpu_s=c1.account - self._c0.account,
                      switches=v1 - self._v0 if v1 is not None and self._v0 is not None else None)


def cpu_stopwatch(pid: int, account: Optional[Callable[[], float]]) -> Stopwatch:
    """A CPU slot's window on the executor `pid`: ExecutorStopwatch on its cgroup's CPU seconds
    (`account`), or the plain wall where it has no cgroup (the work of children the kernel collects
    would go uncounted: nothing is left out then)."""
    return ExecutorStopwatch(pid, account) if account is not None else WallStopwatch()


STEP_CALL_SWITCHES = 1
"""Voluntary context switches of the executor's main thread between the supervisor's readings before
and after a stepped timed call (fibray.timing.steps): its block on the next b"b" (each reading waits
until the thread blocks, so that block is always counted). One more is a sleep inside the call."""


class StepClock:
    """The supervisor's reading around each stepped timed call of the executor `pid`, whose cgroup's CPU
    seconds `account` reads: read() once the executor blocked for b"g", and again once it blocked for
    the next b"b"; reading_ms() between them. A call in which the executor's main thread did not sleep
    is read on the lesser of the unloaded wall and the cgroup's CPU time (the host's waits, and the
    supervisor's own, are not the call's); one in which it slept, on the unloaded wall (a kernel that
    sleeps takes its wall). Never run in an executor."""

    def __init__(self, pid: int, account: Callable[[], float]) -> None:
        self.pid, self.account = pid, account

    def read(self) -> tuple[_Counters, Optional[int]]:
        switches = _voluntary_switches(self.pid) if _settled(self.pid) else None
        return _counters(self.pid, self.account), switches

    @staticmethod
    def cpu_ms(a: tuple[_Counters, Optional[int]], b: tuple[_Counters, Optional[int]]) -> float:
        """The CPU time of the executor's cgroup between two readings, ms: every thread and process of
        it, whether its main thread slept or not."""
        return max(0.0, b[0].account - a[0].account) * 1e3

    @staticmethod
    def reading_ms(a: tuple[_Counters, Optional[int]], b: tuple[_Counters, Optional[int]]) -> float:
        (ca, va), (cb, vb) = a, b
        wall = unloaded_s(ca, cb)
        if va is not None and vb is not None and vb - va <= STEP_CALL_SWITCHES:
            return min(wall, cb.account - ca.account) * 1e3
        return wall * 1e3
