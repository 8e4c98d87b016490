"""Workers: GPU slots (Ray actors) supervising sandboxed candidate executors, and the pool
that schedules jobs on them. Names load on first use, so an executor (fibray.workers.executor)
starts without Ray."""

from __future__ import annotations

__all__ = ["FAULT_REASONS", "GpuSlot", "PoolOptions", "SandboxPolicy", "Slot", "WorkerPool", "WorkerStartError"]

_HOME = {"FAULT_REASONS": "pool", "PoolOptions": "pool", "Slot": "pool", "WorkerPool": "pool",
         "WorkerStartError": "pool", "SandboxPolicy": "sandbox", "GpuSlot": "slot"}


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        value = getattr(importlib.import_module(f"fibray.workers.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fibray.workers' has no attribute {name!r}")
