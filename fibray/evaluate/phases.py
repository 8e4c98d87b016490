"""Where an evaluation's time goes: seconds per named phase."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone


def now_iso() -> str:
    """Now, UTC, ISO 8601 with microseconds (the timestamps of records)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


class Phases(dict):
    """Seconds spent per phase, accumulated over `with phases("name"):` blocks.

    A name with a dot ("trials.executor_call") is a part of the phase before the dot and is
    not counted again in totals (see `top_level`).
    """

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t0

    def add(self, parts: dict[str, float], prefix: str = "") -> None:
        for name, seconds in parts.items():
            self[prefix + name] = self.get(prefix + name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The phases so far, and start again."""
        out = dict(self)
        self.clear()
        return out


def top_level(phases: dict[str, float]) -> float:
    """Total seconds of the phases that are not parts of another."""
    return sum(v for k, v in phases.items() if "." not in k)
