"""The Ray actor of a GPU slot: its executors are spawned first (fibray.workers.start, no torch),
then the supervisor (fibray.workers.slot.GpuSlot) is built around them while they warm up.
"""

from __future__ import annotations

from fibray.workers.spec import SlotSpec
from fibray.workers.start import SlotStart


class SlotActor:
    """What Ray runs for one GPU slot: executors first, then the supervisor (GpuSlot)."""

    def __init__(self, spec: SlotSpec) -> None:
        start = SlotStart.begin(spec)
        from fibray.workers.slot import GpuSlot  # torch, triton: while the executors warm up

        self.slot = GpuSlot(spec, start=start)

    def info(self) -> dict:
        return self.slot.info()

    def stats(self) -> dict:
        return self.slot.stats()

    def evaluate(self, job, mode: str, started_at: str):
        return self.slot.evaluate(job, mode, started_at)

    def prewarm(self, jobs) -> None:
        self.slot.prewarm(jobs)

    def shutdown(self) -> None:
        self.slot.shutdown()
