"""The CPU slot's bound clock leaves out the time a loaded host keeps the executor off a core
(or its supervisor from reading the reply),
and keeps the time it sleeps (a kernel that sleeps to look cheap is still caught)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fibray.timing.bound import Window
from fibray.workers.cpu_clock import ExecutorStopwatch, unloaded_clock

_BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}: pass\n"


def _pinned(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, {0}))


def _advance(pid: int, seconds: float) -> tuple[float, float]:
    """(how far the bound's clock of `pid` advanced, the wall) over `seconds`."""
    clock = unloaded_clock(pid)
    c0, w0 = clock(), time.perf_counter()
    time.sleep(seconds)
    return clock() - c0, time.perf_counter() - w0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_waiting_for_a_core_does_not_advance_the_clock() -> None:
    rivals = [_pinned(_BUSY.format(s=3.0)) for _ in range(3)]  # three busy rivals on the same core
    try:
        time.sleep(0.2)
        target = _pinned(_BUSY.format(s=1.5))
        advanced, wall = _advance(target.pid, 1.0)
        target.kill()
    finally:
        for r in rivals:
            r.kill()
    assert advanced < 0.6 * wall, (advanced, wall)  # about a quarter of the wall: its share of the core


def test_sleeping_advances_the_clock() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)
        advanced, wall = _advance(sleeper.pid, 0.5)
    finally:
        sleeper.kill()
    assert advanced > 0.9 * wall


_HIDES = """
import hashlib, os, threading, time
os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # the main thread: lowest priority
stop = threading.Event()
def work():
    while not stop.is_set():
        hashlib.pbkdf2_hmac("sha256", b"k", b"salt", 20000)  # CPU work outside the GIL
workers = [threading.Thread(target=work) for _ in range(3)]
for w in workers:
    w.start()
t = time.monotonic()
while time.monotonic() - t < {s}:  # runnable all along, behind its own threads
    pass
stop.set()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_wait_the_process_causes_with_its_own_threads_advances_the_clock() -> None:
    target = _pinned(_HIDES.format(s=3.0))
    try:
        time.sleep(0.5)
        advanced, wall = _advance(target.pid, 1.0)
    finally:
        target.kill()
        target.wait()
    assert advanced > 0.8 * wall, (advanced, wall)  # its threads' CPU time is put back: about the wall


_SERVER = """
import os, sys, time
while os.read(0, 1):  # one request a byte; blocks in between, as an executor blocks on its channel
    if sys.argv[1] == "busy":
        t = time.thread_time()
        while time.thread_time() - t < 0.03:
            pass
    else:
        time.sleep(0.3)
    os.write(1, b"r")
"""


def _server(mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _SERVER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    p.stdin.write(b"q")
    p.stdout.read(1)  # started and answering
    return p


def _window(watch: ExecutorStopwatch, p: subprocess.Popen, then_s: float = 0.0) -> Window:
    """One request through `watch`; the supervisor's side takes `then_s` more before it reads the watch."""
    watch.start()
    p.stdin.write(b"q")
    p.stdout.read(1)
    time.sleep(then_s)
    return watch.stop()


def _quiet_switches() -> int:
    """An honest request's voluntary switches (the slot calibrates this on a pristine executor)."""
    p = _server("busy")
    try:
        watch = ExecutorStopwatch(p.pid)
        _window(watch, p)
        switches = _window(watch, p).switches
        assert switches is not None
        return switches
    finally:
        p.kill()
        p.wait()


def test_the_supervisors_own_delay_after_a_reply_is_left_out() -> None:
    """After its reply the executor sleeps, waiting for the next request: a supervisor that reads the
    reply late (a stolen vCPU, a core or a lock it waits for: the CI failure of an honest
    offender_fp16_overflow) is not the candidate's latency, which here is 30 ms of CPU a request."""
    quiet = _quiet_switches()
    p = _server("busy")
    try:
        window = _window(ExecutorStopwatch(p.pid), p, then_s=0.3)
    finally:
        p.kill()
        p.wait()
    assert window.wall_s > 0.3 and window.reading(quiet) < 0.15, window


def test_a_sleep_inside_a_request_stays_in_the_window() -> None:
    """A request that sleeps (a kernel waiting for work it hid, or sleeping to look cheap) is read on
    the wall: its sleep is a voluntary switch the kernel counts, whatever the executor says."""
    quiet = _quiet_switches()
    p = _server("sleep")
    try:
        window = _window(ExecutorStopwatch(p.pid), p)
    finally:
        p.kill()
        p.wait()
    assert window.reading(quiet) >= 0.3 and window.cpu_s < 0.1, window
