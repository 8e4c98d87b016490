"""Workers: GPU actors and the pool of GPU slots that the sweep driver schedules on."""

from fibray.workers.actor import GpuWorker, RemoteGpuWorker
from fibray.workers.pool import Slot, WorkerPool

__all__ = ["GpuWorker", "RemoteGpuWorker", "Slot", "WorkerPool"]
