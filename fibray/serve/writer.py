"""The writer of a client sweep: the coordinator records clients' verdicts under their sweep name,
holding that sweep's store lock while it writes (one writer per sweep; a `fibray.sweep` run on the
service keeps writing its own records, and a client naming a sweep someone else writes is refused)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import pyarrow.compute as pc

from fibray.schema import Job, JobResult
from fibray.store import TraceStore, to_row


class SweepWriter:
    """Buffers one sweep's rows and publishes them by count or age; the store is its ledger."""

    def __init__(self, root: str, sweep: str, flush_rows: int, flush_interval_s: float) -> None:
        self.root, self.sweep = str(Path(root).resolve()), sweep
        self.store = TraceStore(root)
        self._stack = ExitStack()
        self._stack.enter_context(self.store.lock(sweep))  # StoreError if another driver writes it
        self.ledger: set[str] = self.store.job_ids(sweep)
        self.salt = self.store.sweep_salt(sweep)
        """The sweep's secret input salt, as a sweep driver keeps it: clients' jobs get inputs no candidate can predict."""
        self.flush_rows, self.flush_interval_s = flush_rows, flush_interval_s
        self.buffer: list[dict] = []
        self.pending = 0
        """Jobs submitted for this sweep and not yet answered (the writer stays open while any are)."""
        self.last_flush = self.last_used = time.monotonic()
        self.rows_written = 0

    def recorded(self, job_id: str) -> Optional[JobResult]:
        """The recorded result of a job the ledger holds (a resubmission is answered from the store)."""
        from fibray.interop.export import evaluation_from_row

        if job_id not in self.ledger:
            return None
        for row in self._buffered(job_id) or self._stored(job_id):
            return JobResult(job_id=job_id, evaluation=evaluation_from_row(row), worker=row["worker"] or "",
                             isolation=row["isolation"] or "persistent", attempt=row["attempt"] or 1,
                             started_at=str(row["started_at"]), finished_at=str(row["finished_at"]),
                             escalated=bool(row["escalated"]))
        return None

    def _buffered(self, job_id: str) -> list[dict]:
        return [r for r in self.buffer if r["job_id"] == job_id]

    def _stored(self, job_id: str) -> list[dict]:
        table = self.store.read(sweep=self.sweep)
        return table.filter(pc.equal(table["job_id"], job_id)).slice(0, 1).to_pylist()

    def add(self, job: Job, result: JobResult) -> bool:
        """Record a result once; False if the ledger has it already."""
        self.last_used = time.monotonic()
        if job.job_id in self.ledger:
            return False
        self.ledger.add(job.job_id)
        self.buffer.append(to_row(job, result))
        if len(self.buffer) >= self.flush_rows:
            self.flush()
        return True

    def flush(self) -> None:
        if self.buffer:
            self.store.append(self.buffer)
            self.rows_written += len(self.buffer)
            self.buffer = []
        self.last_flush = time.monotonic()

    def due(self, now: float) -> bool:
        return bool(self.buffer) and now - self.last_flush >= self.flush_interval_s

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._stack.close()
