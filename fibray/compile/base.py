"""Builder registry and the Runnable a build produces.

Builders turn a Solution into a callable. A failed build raises BuildError, which the
evaluator records as COMPILE_ERROR; builds are cached by the solution's content hash.
"""

from __future__ import annotations

import threading
import traceback
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


def bound_log(text: str, limit: int) -> str:
    """Keep the head and the tail of a long log (the tail holds the exception)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head - 40
    return f"{text[:head]}\n... [{len(text) - head - tail} chars cut] ...\n{text[-tail:]}"


RAISED_LOG_LIMIT = 1 << 20
"""Characters of a candidate's traceback an executor sends (the verdict keeps far fewer, eval.log_limit)."""
_TYPE_NAME = type.__dict__["__qualname__"]
_TRACEBACK = BaseException.__dict__["__traceback__"]


def raised_type(e: BaseException) -> str:
    """The qualified name of e's class, read past anything its class (or metaclass) overrides."""
    try:
        return _TYPE_NAME.__get__(type(e))
    except BaseException:  # noqa: BLE001 - never fails for a real class; for anything else, say so
        return "<exception of an unnamed class>"


def format_raised(e: BaseException) -> str:
    """The traceback of an exception that candidate code raised, as text. Never raises, whatever the
    exception's own methods do (a __str__ or __repr__ that raises, a metaclass that hides its name or
    module, a property in place of __traceback__): then the frames, the class and why the message is
    missing. At most RAISED_LOG_LIMIT characters, head and tail."""
    try:
        text = "".join(traceback.format_exception(e))
        if type(text) is str:
            return bound_log(text, RAISED_LOG_LIMIT)
        failed = "its traceback did not format as text"
    except BaseException as why:  # noqa: BLE001 - a candidate's exception can raise anything when formatted
        failed = f"formatting it raised {raised_type(why)}"
    try:
        frames = "".join(traceback.format_tb(_TRACEBACK.__get__(e)))
    except BaseException:  # noqa: BLE001
        frames = "  <its frames could not be formatted>\n"
    return f"Traceback (most recent call last):\n{frames}{raised_type(e)}: <message not shown: {failed}>\n"


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
