"""The GPU lock of a slot: jobs' correctness work shares the GPU, timing has it alone.

Used by the slot's lanes (fibray.workers.slot); it never runs candidate code and holds no
executor of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Optional

from fibray.evaluate.phases import Phases
from fibray.workers.process import sandbox

__all__ = ["GpuLock", "LaneGpu"]


class GpuLock:
    """Who may use the GPU: jobs' correctness work shares it, timing has it alone.

    A slot with several lanes runs several jobs at once; their builds, trials and checks may
    overlap on the GPU, but a timed section (the candidate's or the reference's) waits until
    no other work is on it and keeps new work off until it is done. A waiting timer goes
    before new shared work, so timings are never starved.
    """

    def __init__(self, settle: Optional[Callable[[], None]] = None,
                 alone: Optional[Callable[[str, Optional[sandbox.Executor]], AbstractContextManager]] = None) -> None:
        self._settle = settle
        """Run before shared work gives the GPU up (a device synchronise): kernels this process
        queued finish first, so none still runs when a timer takes the GPU. An executor settles
        its own work before it replies."""
        self._alone = alone
        """Entered inside every exclusive hold: (name, the executor to keep running, the lane's own
        executor) -> every other executor of the slot settled and stopped (GpuSlot._alone)."""
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire(self, exclusive: bool) -> None:
        with self._cond:
            if exclusive:
                self._waiting += 1
                while self._exclusive or self._shared:
                    self._cond.wait()
                self._waiting -= 1
                self._exclusive = True
            else:
                while self._exclusive or self._waiting:
                    self._cond.wait()
                self._shared += 1

    def release(self, exclusive: bool) -> None:
        with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()

    @contextmanager
    def hold(self, phase: Phases, name: str, exclusive: bool = False,
             keep: Optional[sandbox.Executor] = None, own: Optional[sandbox.Executor] = None) -> Iterator[None]:
        """Wait for the GPU (the wait is phase `gpu_wait`), then run phase `name` on it; exclusive:
        with every executor but `keep` stopped (`own`: the executor of the job that holds it)."""
        with phase("gpu_wait"):
            self.acquire(exclusive)
        try:
            with phase(name), ExitStack() as alone:
                if exclusive and self._alone is not None:
                    with phase(f"{name}.quiesce"):  # the others settled and stopped: part of `name`'s time
                        alone.enter_context(self._alone(name, keep, own))
                try:
                    yield
                finally:
                    if self._settle is not None and not exclusive:
                        self._settle()
        finally:
            self.release(exclusive)


class LaneGpu:
    """One lane's view of the slot's GPU lock: its candidate's timing keeps its own executor running
    (and stops the others); the reference's timing, run by the supervisor, stops them all."""

    def __init__(self, gpu: GpuLock, ex: sandbox.Executor) -> None:
        self.gpu, self.ex = gpu, ex

    def hold(self, phase: Phases, name: str, exclusive: bool = False) -> AbstractContextManager:
        return self.gpu.hold(phase, name, exclusive, keep=None if name == "reference_timing" else self.ex, own=self.ex)
