"""Tracing policies: which calls become workloads (dedup) and which inputs are saved (dump).

Both kinds are small classes registered by name, so a tracing setup is plain data
(`{"dedup": "avg_lengths", "dedup_args": {"k": 2}, "dump": "structured"}`).
Dedup decides from var-axis values alone, before any tensor is copied.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Optional, Protocol, TypeVar

import torch

from fibray.schema import Definition


class DedupPolicy(Protocol):
    """Decides, call by call, whether a call's var-axis values are worth a new workload."""

    def admit(self, axes: dict[str, int]) -> bool:
        """True to record this call (the policy remembers it)."""
        ...


class DumpPolicy(Protocol):
    """Chooses the tensor inputs saved as safetensors; the others are drawn at random in a sweep."""

    def select(self, definition: Definition, inputs: dict[str, Any]) -> list[str]:
        """Names of the tensor inputs to save."""
        ...


D = TypeVar("D")
_DEDUP: dict[str, Callable[..., DedupPolicy]] = {}
_DUMP: dict[str, Callable[..., DumpPolicy]] = {}


def register_dedup(name: str) -> Callable[[D], D]:
    """Register a dedup policy class under a name."""

    def deco(cls: D) -> D:
        _DEDUP[name] = cls  # type: ignore[assignment]
        return cls

    return deco


def register_dump(name: str) -> Callable[[D], D]:
    """Register a dump policy class under a name."""

    def deco(cls: D) -> D:
        _DUMP[name] = cls  # type: ignore[assignment]
        return cls

    return deco


def make_dedup(name: str, **kwargs: Any) -> DedupPolicy:
    """A fresh dedup policy by name (each definition gets its own state)."""
    if name not in _DEDUP:
        raise ValueError(f"dedup: unknown policy {name!r} (have {sorted(_DEDUP)})")
    return _DEDUP[name](**kwargs)


def make_dump(spec: str | list[str]) -> DumpPolicy:
    """A dump policy by name, or an explicit list of input names to save."""
    if isinstance(spec, list):
        return DumpNamed(spec)
    if spec not in _DUMP:
        raise ValueError(f"dump: unknown policy {spec!r} (have {sorted(_DUMP)}, or a list of input names)")
    return _DUMP[spec]()


class _FirstK:
    """Admit the first k calls of every dedup key."""

    def __init__(self, k: int = 1) -> None:
        if k < 1:
            raise ValueError(f"k: must be >= 1 (got {k})")
        self.k = k
        self.seen: Counter[Hashable] = Counter()

    def key(self, axes: dict[str, int]) -> Optional[Hashable]:
        raise NotImplementedError

    def admit(self, axes: dict[str, int]) -> bool:
        key = self.key(axes)
        if key is None or self.seen[key] >= self.k:
            return False
        self.seen[key] += 1
        return True


@register_dedup("keep_all")
class KeepAll:
    """Every call is a workload."""

    def admit(self, axes: dict[str, int]) -> bool:
        return True


@register_dedup("per_axes")
class PerAxes(_FirstK):
    """The first k calls of each distinct set of var-axis values."""

    def key(self, axes: dict[str, int]) -> Optional[Hashable]:
        return tuple(sorted(axes.items()))


@register_dedup("avg_lengths")
class AvgLengths(_FirstK):
    """For ragged/paged attention: the first k calls per (average lengths per sequence, other axes).

    Raw token and page counts change with every batch; what shapes an attention kernel's
    work is the average query and KV length per sequence. The batch size is `batch_axis`
    minus `batch_offset` (an indptr has batch + 1 entries); each of `length_axes` present is
    divided by it and rounded. The batch size itself and `drop_axes` are left out of the key
    unless `by_batch` (as flashinfer-bench does).
    """

    def __init__(
        self,
        k: int = 1,
        batch_axis: str = "len_indptr",
        batch_offset: int = 1,
        length_axes: tuple[str, ...] = ("num_kv_indices", "total_q", "total_kv"),
        drop_axes: tuple[str, ...] = ("num_pages",),
        by_batch: bool = False,
    ) -> None:
        super().__init__(k)
        self.batch_axis, self.batch_offset, self.by_batch = batch_axis, batch_offset, by_batch
        self.length_axes, self.drop_axes = tuple(length_axes), tuple(drop_axes)

    def key(self, axes: dict[str, int]) -> Optional[Hashable]:
        if self.batch_axis not in axes:
            return tuple(sorted(axes.items()))
        batch = max(axes[self.batch_axis] - self.batch_offset, 0)
        skip = {*self.length_axes, *self.drop_axes, *(() if self.by_batch else (self.batch_axis,))}
        key = {n: v for n, v in axes.items() if n not in skip}
        for name in self.length_axes:
            if name in axes:
                key[f"avg_{name}"] = round(axes[name] / batch) if batch else 0
        return tuple(sorted(key.items()))


@register_dump("structured")
class DumpStructured:
    """Integer and boolean tensors (indptr, page tables, expert routing): they must never be random."""

    def select(self, definition: Definition, inputs: dict[str, Any]) -> list[str]:
        return [n for n, v in inputs.items()
                if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())]


@register_dump("all")
class DumpAll:
    """Every tensor input (exact replay; large)."""

    def select(self, definition: Definition, inputs: dict[str, Any]) -> list[str]:
        return [n for n, v in inputs.items() if isinstance(v, torch.Tensor)]


@register_dump("none")
class DumpNone:
    """No tensor input (shapes only)."""

    def select(self, definition: Definition, inputs: dict[str, Any]) -> list[str]:
        return []


class DumpNamed:
    """Exactly the named inputs."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)

    def select(self, definition: Definition, inputs: dict[str, Any]) -> list[str]:
        return [n for n in self.names if isinstance(inputs.get(n), torch.Tensor)]
