"""Workers: GPU slots (Ray actors) supervising sandboxed candidate executors, and the pool
that schedules jobs on them."""

from fibray.workers.pool import FAULT_REASONS, PoolOptions, Slot, WorkerPool, WorkerStartError
from fibray.workers.sandbox import SandboxPolicy
from fibray.workers.slot import GpuSlot

__all__ = ["FAULT_REASONS", "GpuSlot", "PoolOptions", "SandboxPolicy", "Slot", "WorkerPool", "WorkerStartError"]
