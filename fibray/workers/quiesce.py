"""Timing windows alone on the GPU: every other executor of the slot settles its device work and is stopped.

Builds, trials and checks of other lanes run unlocked; entering a timed window the supervisor asks
each other executor (over its side channel, served on a thread of its own) to synchronise its
device, waits a short deadline for the acks, then SIGSTOPs every process of those executors, and
SIGCONTs them after. An executor with a uid of its own is stopped as a whole uid (kill(-1) by a
helper holding that uid, uids.UidSignaller), which reaches processes that fork and exit without end;
a list of pids read from /proc would be stale before it was used. The supervisor enforces the stop,
not the candidates: an executor that does not ack (hung, busy holding the GIL, or hostile) is
stopped all the same, and the window goes ahead.
Residual risk, which lanes=1 removes: GPU work such an executor had already queued when it was
stopped may still run inside the window. Time an executor spends stopped is not counted against
its requests' deadlines (`Quiet.stopped_s`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from fibray import deadlines
from fibray.workers.process import sandbox
from fibray.workers.process.uids import UidSignaller, owned_by


@dataclass
class Window:
    """One timed window: its name, the executor left running (None: all stopped), wall-clock bounds,
    how long the acks took and how many executors were stopped without one."""

    name: str
    kept: Optional[int]
    start: float
    end: float = 0.0
    ack_wait_s: float = 0.0
    stop_s: float = 0.0
    """Seconds from the acks to the window's start: stopping the others and seeing them stopped."""
    unacked: int = 0
    stopped: int = 0


class Quiet:
    """Stops a slot's executors around timed windows and keeps how long each was stopped."""

    def __init__(self, policy: sandbox.SandboxPolicy, ack_deadline_s: float = deadlines.QUIESCE_ACK_S) -> None:
        self.ack_deadline_s = ack_deadline_s
        self.enabled = True
        """False: nothing is stopped (the control of the tests that show what stopping prevents)."""
        self.by_uid = True
        """False: only the processes listed below each executor are stopped, not its whole uid (the
        baseline of benchmarks/window_cost.py)."""
        self.windows: deque[Window] = deque(maxlen=4096)
        self._lock = threading.Lock()
        self._stopped_total: dict[int, float] = {}
        self._stopped_since: dict[int, float] = {}
        self._seq = 0
        # executors with uids of their own are stopped by uid; its lease taken now, a uid range too
        # narrow stops the slot's start, not a window
        self._signaller = (UidSignaller(sandbox.uid_pool(policy).lease())
                           if policy.drop_privileges and os.geteuid() == 0 else None)

    def close(self) -> None:
        if self._signaller is not None:
            self._signaller.close()

    def stopped_s(self, ex: sandbox.Executor) -> float:
        """Seconds `ex` has been stopped so far (the current stop included)."""
        with self._lock:
            since = self._stopped_since.get(ex.pid)
            return self._stopped_total.get(ex.pid, 0.0) + (time.monotonic() - since if since is not None else 0.0)

    def is_stopped(self, ex: sandbox.Executor) -> bool:
        with self._lock:
            return ex.pid in self._stopped_since

    def _acks(self, executors: list[sandbox.Executor]) -> int:
        """Ask each executor to synchronise its device; wait for the acks up to the deadline; the number missing."""
        self._seq = (self._seq + 1) % 256
        token = bytes([self._seq])
        pending: dict[socket.socket, sandbox.Executor] = {}
        for ex in executors:
            side = getattr(ex, "quiesce", None)
            if side is None or not ex.ready:
                continue
            try:
                while select.select([side], [], [], 0)[0] and side.recv(4096):
                    pass  # late acks of earlier windows
                side.send(token)
                pending[side] = ex
            except (OSError, ValueError):
                continue
        end = time.monotonic() + self.ack_deadline_s
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                ready = select.select(list(pending), [], [], left)[0]
            except (OSError, ValueError):  # one was retired (closed) meanwhile: wait no more
                break
            for side in ready:
                try:
                    data = side.recv(4096)
                except (OSError, ValueError):  # retired meanwhile
                    data = b""
                if not data or token in data:
                    pending.pop(side)
        return len(pending)

    def hold(self, ex: sandbox.Executor) -> Callable[[], None]:
        """Stop `ex` now, as a window stops the others (its whole uid where it has one of its own), and
        return once the kernel shows it stopped; the callable returned continues it (once). While the
        supervisor reads what a request of `ex` left (a timing's outputs), nothing `ex` does after its
        reply reaches them, and its CPU clock stands still."""
        stopped, uids = self._stop([ex] if ex.alive() else [])
        done: list[bool] = []

        def resume() -> None:
            if not done:
                done.append(True)
                self._continue(stopped, uids)

        return resume

    def _stop(self, executors: list[sandbox.Executor]) -> tuple[list[tuple[sandbox.Executor, list[int]]], list[int]]:
        """SIGSTOP every process of `executors` and wait until the kernel shows them stopped; what
        _continue needs. Raises OSError where the uid helper cannot (nothing is left stopped then)."""
        stopped: list[tuple[sandbox.Executor, list[int]]] = []
        signaller = self._signaller if self.by_uid else None
        uids = [ex.uid.uid for ex in executors if ex.uid is not None] if signaller is not None else []
        try:
            if uids:  # each whole uid, however fast its processes fork (OSError: no window that is not alone)
                signaller.send(uids, signal.SIGSTOP)
            for ex in executors:
                pids = []
                below = () if ex.uid is not None and uids else sandbox.descendants(ex.pid)  # the uid's: stopped above
                # not a PID namespace's relay (fibray's, root's, running no candidate code): it must stay
                # awake to end its executor if this supervisor dies while the window is open
                first = () if ex.pid_namespace else (ex.pid,)
                for pid in (*first, *below):  # the executor first: it forks no more
                    try:
                        os.kill(pid, signal.SIGSTOP)
                        pids.append(pid)
                    except (ProcessLookupError, PermissionError):
                        pass
                with self._lock:
                    self._stopped_since[ex.pid] = time.monotonic()
                stopped.append((ex, pids))
            settled = time.monotonic() + deadlines.QUIESCE_ACK_S
            _wait_stopped([p for _, pids in stopped for p in pids], settled)
            if uids:  # the signal lands asynchronously; one look suffices: a process forked after the
                _wait_stopped(owned_by(set(uids)), settled)  # signal stops before it runs a line
        except BaseException:
            self._continue(stopped, uids)
            raise
        return stopped, uids

    def _continue(self, stopped: list[tuple[sandbox.Executor, list[int]]], uids: list[int]) -> None:
        """SIGCONT what _stop stopped, and count how long each executor was stopped."""
        if uids:
            try:
                self._signaller.send(uids, signal.SIGCONT)
            except OSError:
                pass  # the executors' listed processes are continued below; the rest are charged to them
        for ex, pids in stopped:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            with self._lock:
                since = self._stopped_since.pop(ex.pid, None)
                if since is not None:
                    self._stopped_total[ex.pid] = self._stopped_total.get(ex.pid, 0.0) + time.monotonic() - since

    @contextmanager
    def window(self, name: str, executors: Iterable[sandbox.Executor], keep: Optional[sandbox.Executor]) -> Iterator[Window]:
        """The body runs with every executor in `executors` but `keep` settled and stopped."""
        others = [e for e in executors if e is not None and e is not keep and e.alive()]
        w = Window(name, keep.pid if keep is not None else None, time.time())
        if not self.enabled:
            others = []
        t0 = time.monotonic()
        w.unacked = self._acks(others)
        w.ack_wait_s = time.monotonic() - t0
        t0 = time.monotonic()
        stopped: list[tuple[sandbox.Executor, list[int]]] = []
        uids: list[int] = []
        try:
            stopped, uids = self._stop(others)
            w.stopped = len(stopped)
            w.start, w.stop_s = time.time(), time.monotonic() - t0
            yield w
        finally:
            w.end = time.time()
            self._continue(stopped, uids)
            self.windows.append(w)



def _moving(pids: list[int]) -> list[int]:
    """Those of pids that are neither stopped (state T in /proc) nor gone."""
    out = []
    for pid in pids:
        try:
            if sandbox.stat_fields(pid)[0] not in (b"T", b"t", b"Z", b"X"):
                out.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _wait_stopped(pids: list[int], deadline: float) -> None:
    """Until the kernel shows every process stopped (state T in /proc; a SIGSTOP is delivered
    asynchronously), or gone, or the deadline passed."""
    for pid in pids:
        while _moving([pid]) and time.monotonic() < deadline:
            time.sleep(0.0005)
