"""The Ray actor of a GPU slot: its executors are spawned first (fibray.workers.start, no torch),
then the supervisor (fibray.workers.slot.GpuSlot) is built around them while they warm up.
"""

from __future__ import annotations

from typing import Optional

from fibray.workers.start import SlotStart


class SlotActor:
    """What Ray runs for one GPU slot: executors first, then the supervisor (GpuSlot)."""

    def __init__(self, name: str, policy: Optional[dict] = None, workdir: Optional[str] = None,
                 torch_threads: Optional[int] = None, standby: bool = True, spare_isolated: int = 1,
                 lanes: int = 1) -> None:
        start = SlotStart.begin(name, policy, workdir, standby, lanes)
        from fibray.workers.slot import GpuSlot  # torch, triton: while the executors warm up

        self.slot = GpuSlot(name, policy, workdir, torch_threads, standby, spare_isolated, lanes, start=start)

    def info(self) -> dict:
        return self.slot.info()

    def stats(self) -> dict:
        return self.slot.stats()

    def evaluate(self, job, mode: str, started_at: str):
        return self.slot.evaluate(job, mode, started_at)

    def shutdown(self) -> None:
        self.slot.shutdown()
