"""Replay workloads: mark the workloads that fibray.tracing recorded from live calls as `replay`.

Writes the dataset's split sidecar (splits/<definition>.json, fibray.dataset.splits) under a
temporary name and renames it into place; a workload that a split file already assigns keeps
its split (a hidden workload never turns into a replay one by accident).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fibray.dataset import SPLITS_DIR, DatasetError, read_jsonl, read_splits
from fibray.schema import Split, Trace
from fibray.tracing.writer import TracingError, _atomic_write


@dataclass
class ReplayMarked:
    """What `mark_replay` did."""

    marked: dict[str, int] = field(default_factory=dict)
    """Definition -> workloads newly marked replay."""
    kept: int = 0
    """Workloads left alone because a split file already assigns them."""
    files: list[Path] = field(default_factory=list)
    """Split files written."""


def mark_replay(root: str | Path, workload_set: str = "traced", definitions: Sequence[str] | None = None) -> ReplayMarked:
    """Mark every workload under root/workloads/<workload_set>/ (of `definitions`, or all) as replay."""
    root = Path(root)
    folder = root / "workloads" / workload_set
    if not folder.is_dir():
        raise TracingError(f"workload_set: {folder} does not exist (trace into it first)")
    try:
        assigned, _ = read_splits(root, DatasetError)
        found: dict[str, list[str]] = {}
        for path in sorted(folder.glob("**/*.jsonl")):
            for _, trace in read_jsonl(Trace, path):
                if definitions is None or trace.definition in definitions:
                    found.setdefault(trace.definition, []).append(trace.workload.uuid)
    except DatasetError as e:
        raise TracingError(f"cannot mark replay workloads in {root}: {e}") from None
    done = ReplayMarked()
    for name, uuids in sorted(found.items()):
        new = [u for u in uuids if u not in assigned]
        done.kept += len(uuids) - len(new)
        if not new:
            continue
        path = root / SPLITS_DIR / f"{name}.json"
        current = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        current.update({u: Split.REPLAY.value for u in new})
        text = json.dumps(current, indent=2, sort_keys=True) + "\n"
        _atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
        done.marked[name] = len(new)
        done.files.append(path)
    return done
