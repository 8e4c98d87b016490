"""The slot side of the process boundary: a GPU slot (a Ray actor) supervising sandboxed
candidate executors (fibray.workers.process). Driver-side scheduling lives in fibray.sweep.pool.
Names load on first use, so an executor starts without Ray or torch's slot side."""

from __future__ import annotations

__all__ = ["GpuSlot", "SandboxPolicy", "SlotActor", "SlotSpec", "SlotStart"]

_HOME = {"SandboxPolicy": "process.sandbox", "GpuSlot": "slot", "SlotActor": "actor", "SlotSpec": "spec",
         "SlotStart": "start"}


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        value = getattr(importlib.import_module(f"fibray.workers.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fibray.workers' has no attribute {name!r}")
