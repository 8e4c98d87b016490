"""The CPU slot's bound clock leaves out the time a loaded host keeps the executor off a core,
and keeps the time it sleeps (a kernel that sleeps to look cheap is still caught)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fibray.workers.cpu_clock import unloaded_clock

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
