"""Public and hidden workloads of the agent loop: public ones feed back, hidden ones only score.

The dataset's splits/ sidecar wins where it lists a definition's workloads (replay counts as hidden);
otherwise a deterministic split by a seeded hash of each workload's uuid. Nothing hidden may ever
reach a generator: the task builder only sees `public`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from fibray.dataset import Dataset
from fibray.schema import Split, Workload

__all__ = ["WorkloadSplit", "split_workloads"]


@dataclass(frozen=True)
class WorkloadSplit:
    """One definition's workloads, split."""

    public: list[Workload]
    hidden: list[Workload]
    source: str
    """'splits/' (the dataset's sidecar) or 'hash(seed=S, hidden_fraction=F)'."""

    def split_of(self, workload: Workload) -> Split:
        return Split.HIDDEN if any(w.uuid == workload.uuid for w in self.hidden) else Split.PUBLIC


def _rank(seed: int, uuid: str) -> str:
    return hashlib.sha256(f"fibray-evolve-split:{seed}:{uuid}".encode()).hexdigest()


def split_workloads(ds: Dataset, definition: str, *, hidden_fraction: float, seed: int) -> WorkloadSplit:
    """The split of one definition's workloads (dataset order is kept within each side)."""
    workloads = ds.workloads.get(definition, [])
    if any(w.uuid in ds.splits for w in workloads):
        public = [w for w in workloads if ds.split_of(w.uuid) == Split.PUBLIC]
        hidden = [w for w in workloads if ds.split_of(w.uuid) != Split.PUBLIC]
        return WorkloadSplit(public, hidden, "splits/")
    n_hidden = math.ceil(hidden_fraction * len(workloads)) if len(workloads) >= 2 and hidden_fraction > 0 else 0
    n_hidden = min(n_hidden, len(workloads) - 1)
    chosen = {w.uuid for w in sorted(workloads, key=lambda w: _rank(seed, w.uuid))[:n_hidden]}
    return WorkloadSplit([w for w in workloads if w.uuid not in chosen], [w for w in workloads if w.uuid in chosen],
                         f"hash(seed={seed}, hidden_fraction={hidden_fraction})")
