"""The process-wide slots that decorated functions consult on every call.

A decorated function reads its definition's slot (`HOOKS.slot(name)`, a one-element list
holding the active runtime's dispatch for that name, or None) and, when that is empty, one
flag (`HOOKS.active`). Only `fibray.apply.runtime` and `fibray.tracing` write these slots,
through `set_runtime` and `set_tracer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Collector(Protocol):
    """What a tracer must offer the decorated functions; it must never raise."""

    def collect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None: ...


class _Hooks:
    __slots__ = ("_slots", "active", "fast", "runtime", "tracer")

    def __init__(self) -> None:
        self.runtime: Any | None = None
        """The active ApplyRuntime, or None."""
        self.tracer: Collector | None = None
        """The active tracer, or None."""
        self.active = False
        """runtime or tracer is set (the one flag the idle path reads)."""
        self.fast: dict[str, Callable[..., Any]] | None = None
        """Definition name -> dispatch function, while a runtime is active and no tracer is."""
        self._slots: dict[str, list[Callable[..., Any] | None]] = {}

    def slot(self, name: str) -> list[Callable[..., Any] | None]:
        """The slot of definition `name`: [its dispatch while a runtime serves it and no tracer is active, else None]."""
        if name not in self._slots:
            self._slots[name] = [None]
            self.refresh()
        return self._slots[name]

    def refresh(self) -> None:
        self.active = self.runtime is not None or self.tracer is not None
        self.fast = self.runtime.dispatch_functions if self.runtime is not None and self.tracer is None else None
        for name, slot in self._slots.items():
            slot[0] = self.fast.get(name) if self.fast is not None else None


HOOKS = _Hooks()


def set_runtime(runtime: Any | None) -> Any | None:
    """Install (or clear, with None) the apply runtime; returns the previous one."""
    previous, HOOKS.runtime = HOOKS.runtime, runtime
    HOOKS.refresh()
    return previous


def set_tracer(tracer: Collector | None) -> Collector | None:
    """Install (or clear, with None) the tracer; returns the previous one."""
    previous, HOOKS.tracer = HOOKS.tracer, tracer
    HOOKS.refresh()
    return previous
