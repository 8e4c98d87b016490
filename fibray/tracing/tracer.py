"""The tracer: records workloads from live calls of `@apply`-decorated functions.

For each call it reads the var-axis values off the argument shapes, asks the
definition's dedup policy whether the call is new, and only then copies the inputs
its dump policy keeps. It never raises into the traced program: a call that does not
match its definition is counted and skipped. Nothing is written until `flush`/`stop`.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from fibray.apply.hooks import HOOKS, set_tracer
from fibray.dataset import Dataset, load_dataset
from fibray.evaluate.inputs import torch_dtype
from fibray.schema import Definition
from fibray.tracing.policy import DedupPolicy, DumpNamed, DumpPolicy, make_dedup, make_dump
from fibray.tracing.writer import TracedCall, TracingError, ensure_definitions, write_calls

log = logging.getLogger(__name__)

Definitions = Union[str, Path, Dataset, Mapping[str, Definition], Iterable[Definition]]


class TracePolicy(BaseModel):
    """How one definition is traced."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    dedup: str = "per_axes"
    """Dedup policy name: per_axes, avg_lengths (attention), keep_all."""
    dedup_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the dedup policy (e.g. {"k": 2})."""
    dump: Union[str, list[str]] = "structured"
    """Inputs saved as safetensors: structured (int/bool tensors), all, none, or a list of input names."""


@dataclass
class TracingStats:
    """Counters of one tracer."""

    calls: int = 0
    """Calls seen for traced definitions."""
    recorded: int = 0
    """Calls kept as workloads (before the file-level dedup by content)."""
    duplicates: int = 0
    """Calls the dedup policy found already covered."""
    mismatched: int = 0
    """Calls whose arguments do not fit their definition (shape, dtype, count)."""
    unknown: dict[str, int] = field(default_factory=dict)
    """Definition name -> calls naming a definition the tracer does not know."""
    errors: int = 0
    """Calls the tracer failed on unexpectedly (logged; the traced program went on)."""
    written: int = 0
    """New workloads written by flushes."""


def default_policy(definition: Definition) -> TracePolicy:
    """avg_lengths for ragged/paged definitions (an indptr axis), per_axes for the rest."""
    if "len_indptr" in definition.var_axes:
        return TracePolicy(dedup="avg_lengths")
    return TracePolicy()


def _as_definitions(definitions: Definitions) -> dict[str, Definition]:
    if isinstance(definitions, (str, Path)):
        return dict(load_dataset(definitions, require_blobs=False).definitions)
    if isinstance(definitions, Dataset):
        return dict(definitions.definitions)
    if isinstance(definitions, Mapping):
        return dict(definitions)
    return {d.name: d for d in definitions}


def call_axes(definition: Definition, inputs: list[Any]) -> dict[str, int]:
    """Var-axis values of a call, checking shapes, dtypes and const axes against the definition."""
    const = definition.const_axes
    seen: dict[str, int] = {}
    for (name, spec), value in zip(definition.inputs.items(), inputs):
        if spec.shape is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"input {name!r}: expected a tensor, got {type(value).__name__}")
        if value.dtype != torch_dtype(spec.dtype):
            raise ValueError(f"input {name!r}: dtype {value.dtype}, definition says {spec.dtype.value}")
        if value.dim() != len(spec.shape):
            raise ValueError(f"input {name!r}: {value.dim()} dims, definition says {spec.shape}")
        for axis, size in zip(spec.shape, value.shape):
            want = const.get(axis, seen.get(axis))
            if want is not None and want != size:
                raise ValueError(f"input {name!r}: axis {axis!r} is {size}, expected {want}")
            seen[axis] = int(size)
    missing = [a for a in definition.var_axes if a not in seen]
    if missing:
        raise ValueError(f"var axes {missing} appear in no input")
    return {a: seen[a] for a in definition.var_axes}


class Tracer:
    """Collects workloads of the given definitions into a FlashInfer Trace dataset folder."""

    def __init__(
        self,
        out: str | Path,
        definitions: Definitions,
        *,
        workload_set: str = "traced",
        policy: Optional[TracePolicy] = None,
        per_definition: Optional[Mapping[str, TracePolicy]] = None,
    ) -> None:
        self.out = Path(out)
        self.workload_set = workload_set
        self.definitions = _as_definitions(definitions)
        per_definition = dict(per_definition or {})
        unknown = sorted(set(per_definition) - set(self.definitions))
        if unknown:
            raise TracingError(f"per_definition: unknown definitions {unknown} (have {sorted(self.definitions)})")
        self._dedup: dict[str, DedupPolicy] = {}
        self._dump: dict[str, DumpPolicy] = {}
        for name, d in self.definitions.items():
            p = per_definition.get(name) or policy or default_policy(d)
            self._dedup[name] = make_dedup(p.dedup, **p.dedup_args)
            self._dump[name] = make_dump(p.dump)
            if isinstance(self._dump[name], DumpNamed):
                bad = [n for n in p.dump if n not in d.inputs]
                if bad:
                    raise TracingError(f"per_definition.{name}.dump: {bad} are not inputs of {name} ({list(d.inputs)})")
        ensure_definitions(self.out, self.definitions)  # fail now, not at the end of a long run
        self.stats = TracingStats()
        self._pending: list[TracedCall] = []
        self._lock = threading.Lock()
        self._atexit = False

    # -- collection (called by decorated functions) ----------------------------------------
    def collect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        """Record one call if its definition is traced and the dedup policy admits it; never raises."""
        try:
            self._collect(name, args, kwargs)
        except Exception as e:  # tracing must never break the program it observes
            self.stats.errors += 1
            log.warning("tracing %s: call not recorded: %s: %s", name, type(e).__name__, e)

    def _collect(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        definition = self.definitions.get(name)
        if definition is None:
            with self._lock:
                self.stats.unknown[name] = self.stats.unknown.get(name, 0) + 1
            return
        names = [*definition.inputs, *definition.outputs]
        values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        inputs = dict(zip(definition.inputs, values[: len(definition.inputs)]))
        with self._lock:
            self.stats.calls += 1
            try:
                if len(inputs) != len(definition.inputs) or set(kwargs) - set(names):
                    raise ValueError(f"expected inputs {list(definition.inputs)}")
                axes = call_axes(definition, list(inputs.values()))
                scalars = {n: _scalar(inputs[n]) for n, s in definition.inputs.items() if s.shape is None}
            except (ValueError, TypeError, RuntimeError) as e:
                self.stats.mismatched += 1
                log.debug("tracing %s: call skipped: %s", name, e)
                return
            if not self._dedup[name].admit(axes):
                self.stats.duplicates += 1
                return
            tensors_in = {n: v for n, v in inputs.items() if definition.inputs[n].shape is not None}
            keep = self._dump[name].select(definition, tensors_in)
            tensors = {n: inputs[n].detach().to("cpu", copy=True) for n in keep}
            self._pending.append(TracedCall(name, axes, tensors, scalars))
            self.stats.recorded += 1

    # -- output ----------------------------------------------------------------------------
    def flush(self) -> int:
        """Write the pending workloads; returns how many were new on disk."""
        with self._lock:
            pending, self._pending = self._pending, []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        written = write_calls(self.out, self.definitions, pending, self.workload_set) if pending else 0
        self.stats.written += written
        log.info("tracing: %d workloads written to %s (workload set %r)", written, self.out, self.workload_set)
        return written

    def start(self) -> "Tracer":
        """Make this the process's tracer; pending workloads are flushed at exit if it is never stopped."""
        set_tracer(self)
        if not self._atexit:
            atexit.register(self._flush_at_exit)
            self._atexit = True
        return self

    def stop(self) -> int:
        """Stop tracing and flush; returns how many workloads were new on disk."""
        if HOOKS.tracer is self:
            set_tracer(None)
        return self.flush()

    def _flush_at_exit(self) -> None:
        if self._pending:
            self.flush()

    def __enter__(self) -> "Tracer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _scalar(value: Any) -> bool | int | float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"scalar input has {value.numel()} elements")
        return value.item()
    if isinstance(value, (bool, int, float)):
        return value
    raise ValueError(f"scalar input of type {type(value).__name__}")


def trace(
    out: str | Path,
    definitions: Definitions,
    *,
    workload_set: str = "traced",
    policy: Optional[TracePolicy] = None,
    per_definition: Optional[Mapping[str, TracePolicy]] = None,
) -> Tracer:
    """Start tracing calls of `@apply` functions into a dataset folder; use as a context manager."""
    return Tracer(out, definitions, workload_set=workload_set, policy=policy, per_definition=per_definition).start()
