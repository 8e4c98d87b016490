"""The process-wide slots that decorated functions consult on every call.

Decorated functions read two attributes (`HOOKS.fast`, `HOOKS.active`) when nothing is
enabled, so an idle fibray costs two branches per call. Only `fibray.apply.runtime` and
`fibray.tracing` write these slots, through `set_runtime` and `set_tracer`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol


class Collector(Protocol):
    """What a tracer must offer the decorated functions; it must never raise."""

    def collect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None: ...


class _Hooks:
    __slots__ = ("runtime", "tracer", "active", "fast")

    def __init__(self) -> None:
        self.runtime: Optional[Any] = None
        """The active ApplyRuntime, or None."""
        self.tracer: Optional[Collector] = None
        """The active tracer, or None."""
        self.active = False
        """runtime or tracer is set (the one flag the idle path reads)."""
        self.fast: Optional[dict[str, Callable[..., Any]]] = None
        """Definition name -> dispatch function, while a runtime is active and no tracer is."""

    def refresh(self) -> None:
        self.active = self.runtime is not None or self.tracer is not None
        self.fast = self.runtime.dispatch_functions if self.runtime is not None and self.tracer is None else None


HOOKS = _Hooks()


def set_runtime(runtime: Optional[Any]) -> Optional[Any]:
    """Install (or clear, with None) the apply runtime; returns the previous one."""
    previous, HOOKS.runtime = HOOKS.runtime, runtime
    HOOKS.refresh()
    return previous


def set_tracer(tracer: Optional[Collector]) -> Optional[Collector]:
    """Install (or clear, with None) the tracer; returns the previous one."""
    previous, HOOKS.tracer = HOOKS.tracer, tracer
    HOOKS.refresh()
    return previous
