"""Hand-made trace-store rows for the analysis, report and compaction tests.

Each row is a full store row (every column present) whose interesting fields are set by
the test, so the expected answers can be worked out by hand.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

from fibray.store import SCHEMA, TraceStore

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def row(
    definition: str,
    workload: str,
    solution: str,
    status: str = "PASSED",
    speedup: Optional[float] = 1.0,
    *,
    sweep: str = "s1",
    author: str = "alice",
    language: str = "triton",
    reason: Optional[str] = None,
    axes: Optional[dict[str, Any]] = None,
    at: float = 0.0,
    job_id: Optional[str] = None,
    solution_hash: Optional[str] = None,
) -> dict[str, Any]:
    """One store row; latency is 1 ms / speedup for PASSED rows, `at` seconds after T0 is finished_at."""
    record: dict[str, Any] = {name: None for name in SCHEMA.names}
    passed = status == "PASSED"
    record.update(
        definition=definition, sweep=sweep, workload_uuid=workload, solution=solution, author=author,
        language=language, status=status, reason=None if passed else (reason or "unspecified_" + status.lower()),
        job_id=job_id or f"{definition}/{workload}/{solution}",
        solution_hash=solution_hash or f"hash-{solution}",
        axes=json.dumps(axes if axes is not None else {"n": 1}, sort_keys=True),
        speedup=speedup if passed else None,
        latency_ms=(1.0 / speedup) if passed and speedup else None,
        reference_latency_ms=1.0 if passed else None,
        op_type="test", attempt=1,
        started_at=T0 + timedelta(seconds=at), finished_at=T0 + timedelta(seconds=at),
    )
    return record


def make_store(root: Path, rows: list[dict[str, Any]], files_per_partition: int = 1) -> TraceStore:
    """A store under root holding rows, written through TraceStore.append in `files_per_partition` batches."""
    store = TraceStore(root)
    for i in range(files_per_partition):
        batch = rows[i::files_per_partition]
        if batch:
            store.append(batch)
    return store
