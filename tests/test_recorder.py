"""The sweep's recorder under Ctrl-C and store failures: every row published exactly once and counted as such.

The interrupt is a real SIGINT to this process, delivered through the sweep's own handler at the worst moment
for the count: right after a file is published and before the recorder has noted it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fibray.dataset import load_dataset
from fibray.store import StoreError, TraceStore
from fibray.sweep.driver import _Interrupts, _Recorder
from _analysis_fixtures import row

CORE = Path(__file__).resolve().parents[1] / "datasets" / "core"


def _dataset():
    return load_dataset(CORE, workload_set="cpu_small")


class _InterruptedAfterPublishing(TraceStore):
    """A store that gets Ctrl-C the moment its first file is on disk (the handler runs on the next bytecode)."""

    fired = False

    def append(self, rows):
        paths = super().append(rows)
        if not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return paths


def _as_the_driver_does(recorder: _Recorder, interrupts: _Interrupts, rows: list[dict]) -> None:
    """The driver's shape: flush while running, check after, flush again in `finally` on the way out."""
    try:
        with interrupts.kept():
            recorder.buffer = list(rows)
            recorder.flush()
            interrupts.check()
    except KeyboardInterrupt:
        pass
    finally:
        recorder.flush()


def test_ctrl_c_right_after_a_file_is_published_counts_it_once_and_writes_it_once(tmp_path):
    store = _InterruptedAfterPublishing(tmp_path / "store")
    interrupts = _Interrupts()
    recorder = _Recorder(store, 2, 60.0, _dataset(), interrupts.shielded)
    rows = [row("d1", f"w{i}", "s") for i in range(3)] + [row("d2", "w0", "s")]
    _as_the_driver_does(recorder, interrupts, rows)
    assert store.fired and interrupts.seen
    ids = TraceStore(tmp_path / "store").read(columns=["job_id"]).column("job_id").to_pylist()
    assert sorted(ids) == sorted(r["job_id"] for r in rows)  # none twice, none lost
    assert recorder.published == len(ids) and not recorder.buffer
    assert len(recorder.files) == 2  # one file per partition


def test_a_failed_partition_keeps_only_its_own_rows_for_the_next_flush(tmp_path):
    class _SecondPartitionFails(TraceStore):
        def append(self, rows):
            if rows[0]["definition"] == "d2" and not getattr(self, "failed", False):
                self.failed = True
                raise StoreError("store.root: cannot write (disk full)")
            return super().append(rows)

    store = _SecondPartitionFails(tmp_path / "store")
    recorder = _Recorder(store, 2, 60.0, _dataset())
    rows = [row("d1", "w0", "s"), row("d2", "w0", "s"), row("d1", "w1", "s")]
    recorder.buffer = list(rows)
    with pytest.raises(StoreError):
        recorder.flush()
    assert recorder.published == 2 and [r["definition"] for r in recorder.buffer] == ["d2"]
    recorder.flush()  # the driver's `finally`
    ids = TraceStore(tmp_path / "store").read(columns=["job_id"]).column("job_id").to_pylist()
    assert sorted(ids) == sorted(r["job_id"] for r in rows) and recorder.published == 3
