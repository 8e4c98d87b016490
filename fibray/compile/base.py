"""Builder registry and the Runnable a build produces.

Builders turn a Solution into a callable. A failed build raises BuildError, which the
evaluator records as COMPILE_ERROR; builds are cached by the solution's content hash.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from fibray.schema import Solution
from fibray.schema.reasons import Reason


class BuildError(Exception):
    """The solution could not be built (syntax error, import error, compiler error)."""

    def __init__(self, message: str, reason: str = Reason.BUILD_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Runnable:
    """A built solution: call it with inputs (and outputs, in destination-passing style)."""

    fn: Callable[..., Any]
    destination_passing_style: bool
    solution_hash: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class Builder(Protocol):
    def __call__(self, solution: Solution, workdir: Path) -> Runnable: ...


_BUILDERS: dict[str, Builder] = {}


def register_builder(*languages: str) -> Callable[[Builder], Builder]:
    """Register a builder for one or more languages."""

    def deco(fn: Builder) -> Builder:
        for lang in languages:
            _BUILDERS[lang] = fn
        return fn

    return deco


def builder_for(language: str) -> Builder:
    try:
        return _BUILDERS[language]
    except KeyError:
        raise BuildError(
            f"spec.language: no builder for {language!r} (have {sorted(_BUILDERS)})", Reason.UNSUPPORTED_LANGUAGE
        ) from None


class BuildCache:
    """Per-process cache of builds (and failed builds) by solution hash."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._done: dict[str, Runnable | BuildError] = {}
        self._lock = threading.Lock()

    def get(self, solution: Solution) -> Runnable:
        """The built solution; raises the cached BuildError if its build failed."""
        with self._lock:
            hit = self._done.get(solution.hash)
            if hit is None:
                try:
                    hit = builder_for(solution.spec.language.value)(solution, self.root / solution.hash[:24])
                except BuildError as e:
                    hit = e
                self._done[solution.hash] = hit
        if isinstance(hit, BuildError):
            raise hit
        return hit

    def __contains__(self, solution_hash: str) -> bool:
        return solution_hash in self._done
