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


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_waiting_for_a_core_does_not_advance_the_clock() -> None:
    rivals = [_pinned(_BUSY.format(s=3.0)) for _ in range(3)]  # three busy rivals on the same core
    try:
        time.sleep(0.2)
        target = _pinned(_BUSY.format(s=1.5))
        clock = unloaded_clock(target.pid)
        c0, w0 = clock(), time.perf_counter()
        time.sleep(1.0)
        advanced, wall = clock() - c0, time.perf_counter() - w0
        target.kill()
    finally:
        for r in rivals:
            r.kill()
    assert advanced < 0.6 * wall, (advanced, wall)  # about a quarter of the wall: its share of the core


def test_sleeping_advances_the_clock() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)
        clock = unloaded_clock(sleeper.pid)
        c0, w0 = clock(), time.perf_counter()
        time.sleep(0.5)
        advanced, wall = clock() - c0, time.perf_counter() - w0
    finally:
        sleeper.kill()
    assert advanced > 0.9 * wall
