"""Generators of the agent loop: a shell command, a Python callable, and (fibray.evolve.search) the built-in search.

A generator gets the round's task (a JSON-compatible dict) and returns candidate solution dicts. A
generator that hangs, crashes or answers garbage never raises out of `generate`: it returns a
GeneratorOutput with a reason, and the loop spends the round and records it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from fibray.schema.reasons import GeneratorReason

__all__ = ["CallableGenerator", "Generator", "GeneratorOutput", "ShellGenerator", "parse_output"]

STDERR_LIMIT = 8192
"""Most characters of a generator's stderr (or traceback) kept in the round ledger."""
_KILL_GRACE_S = 5.0
"""After killing a timed-out command's process group, how long to wait for it to be reaped."""


@dataclass
class GeneratorOutput:
    """What one round's generation produced."""

    items: list[dict[str, Any]] = field(default_factory=list)
    """Candidate solution dicts (validated by the loop); may be empty."""
    reason: Optional[GeneratorReason] = None
    """Why the round got nothing (timeout, crash, garbage); None when the generator answered."""
    error: Optional[str] = None
    """One line saying what went wrong."""
    stderr: str = ""
    """The generator's stderr or traceback, bounded."""
    seconds: float = 0.0
    """Wall time of the generation."""


class Generator(Protocol):
    """Proposes candidates for one definition's round."""

    name: str
    """Recorded in the store's `generator` column (search, shell:<program>, callable:<module:function>)."""

    def generate(self, task: dict[str, Any]) -> GeneratorOutput: ...


def _tail(text: str, limit: int = STDERR_LIMIT) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]


def parse_output(value: Any) -> tuple[list[dict[str, Any]], Optional[str]]:
    """Solution dicts from a generator's answer: a list, one object, JSON text of either, or JSONL.

    Returns (items, error); error says why the answer is garbage (items is then empty)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return [], "output is not UTF-8 text"
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return [], "output is empty (expected a JSON list of solutions)"
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            try:
                value = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                return [], f"output is neither JSON nor JSONL: line {e.lineno} column {e.colno}: {e.msg}: {text[:80]!r}"
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return [], f"output is a {type(value).__name__}; expected a list of solution objects"
    items = []
    for i, item in enumerate(value):
        if hasattr(item, "to_json_dict"):  # a Solution (from a callable)
            item = item.to_json_dict()
        if not isinstance(item, dict):
            return [], f"output item {i} is a {type(item).__name__}; expected a solution object"
        items.append(item)
    return items, None


class ShellGenerator:
    """A command: the task JSON on stdin, solution JSONs on stdout, a deadline, its stderr kept."""

    def __init__(self, command: list[str] | str, deadline_s: float, max_output_bytes: int = 16 << 20) -> None:
        self.argv = shlex.split(command) if isinstance(command, str) else list(command)
        self.deadline_s, self.max_output_bytes = deadline_s, max_output_bytes
        self.name = "shell:" + " ".join(self.argv)[:200]

    def generate(self, task: dict[str, Any]) -> GeneratorOutput:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)  # its own process group: a timeout kills all of it
        except OSError as e:
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_CRASHED, error=f"cannot start {self.argv[0]!r}: {e}",
                                   seconds=time.monotonic() - t0)
        try:
            out, err = proc.communicate(json.dumps(task).encode(), timeout=self.deadline_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # not yet reaped, so the group id is still its own
            try:
                out, err = proc.communicate(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_TIMEOUT,
                                   error=f"{self.name}: no answer within {self.deadline_s:g}s; killed",
                                   stderr=_tail(err.decode(errors="replace")), seconds=time.monotonic() - t0)
        except BrokenPipeError:  # it exited without reading the task
            out, err = proc.communicate()
        stderr = _tail(err.decode(errors="replace"))
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_CRASHED, stderr=stderr, seconds=seconds,
                                   error=f"{self.name}: exited with status {proc.returncode}")
        if len(out) > self.max_output_bytes:
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_GARBAGE, stderr=stderr, seconds=seconds,
                                   error=f"{self.name}: {len(out)} bytes on stdout, more than {self.max_output_bytes}")
        items, error = parse_output(out)
        if error:
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_GARBAGE, error=f"{self.name}: {error}",
                                   stderr=stderr, seconds=seconds)
        return GeneratorOutput(items=items, stderr=stderr, seconds=seconds)


def load_callable(spec: str) -> Callable[[dict[str, Any]], Any]:
    """`module:function` -> the function (ValueError naming the spec when it cannot be found)."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"evolve.generator.callable: cannot load {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"evolve.generator.callable: {spec!r} is not callable")
    return fn


class CallableGenerator:
    """A Python function `module:function` called in this process with the task dict.

    It runs in a daemon thread with the deadline: a function that overruns costs its round and is
    left behind (a Python thread cannot be killed), so use a shell command for untrusted generators."""

    def __init__(self, spec: str, deadline_s: float) -> None:
        self.fn = load_callable(spec)
        self.deadline_s = deadline_s
        self.name = f"callable:{spec}"

    def generate(self, task: dict[str, Any]) -> GeneratorOutput:
        t0 = time.monotonic()
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = self.fn(task)
            except BaseException as e:  # the generator is foreign code; any failure costs its round only
                box["error"] = e
                box["trace"] = "".join(traceback.format_exception(e))

        thread = threading.Thread(target=call, name=f"fibray-generator-{self.name}", daemon=True)
        thread.start()
        thread.join(self.deadline_s)
        seconds = time.monotonic() - t0
        if thread.is_alive():
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_TIMEOUT, seconds=seconds,
                                   error=f"{self.name}: no answer within {self.deadline_s:g}s (thread left running)")
        if "error" in box:
            e = box["error"]
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_CRASHED, stderr=_tail(box["trace"]), seconds=seconds,
                                   error=f"{self.name}: raised {type(e).__name__}: {str(e)[:200]}")
        items, error = parse_output(box.get("value"))
        if error:
            return GeneratorOutput(reason=GeneratorReason.GENERATOR_GARBAGE, error=f"{self.name}: {error}", seconds=seconds)
        return GeneratorOutput(items=items, seconds=seconds)
