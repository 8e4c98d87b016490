"""The process-wide slots that decorated functions consult on every call.

Decorated functions read one attribute (`HOOKS.active`) when nothing is enabled, so
an idle fibray costs one branch per call. Only `fibray.apply.runtime` and
`fibray.tracing` write these slots, through `set_runtime` and `set_tracer`.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol


class Collector(Protocol):
    """What a tracer must offer the decorated functions; it must never raise."""

    def collect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None: ...


class _Hooks:
    __slots__ = ("runtime", "tracer", "active")

    def __init__(self) -> None:
        self.runtime: Optional[Any] = None
        """The active ApplyRuntime, or None."""
        self.tracer: Optional[Collector] = None
        """The active tracer, or None."""
        self.active = False
        """runtime or tracer is set (the one flag the idle path reads)."""


HOOKS = _Hooks()


def set_runtime(runtime: Optional[Any]) -> Optional[Any]:
    """Install (or clear, with None) the apply runtime; returns the previous one."""
    previous, HOOKS.runtime = HOOKS.runtime, runtime
    HOOKS.active = HOOKS.runtime is not None or HOOKS.tracer is not None
    return previous


def set_tracer(tracer: Optional[Collector]) -> Optional[Collector]:
    """Install (or clear, with None) the tracer; returns the previous one."""
    previous, HOOKS.tracer = HOOKS.tracer, tracer
    HOOKS.active = HOOKS.runtime is not None or HOOKS.tracer is not None
    return previous
