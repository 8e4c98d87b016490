"""Compaction: one file per partition afterwards, the same rows, safe against a kill and a running sweep."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fibray.store import StoreError, TraceStore
from fibray.store.compact import compact_partition, main, recover
from _analysis_fixtures import make_store, row


def _rows(n: int, definition: str = "d", sweep: str = "s1") -> list[dict]:
    return [row(definition, f"w{i}", f"sol{i % 3}", "PASSED" if i % 4 else "RUNTIME_ERROR", speedup=1.0 + i / 10,
                sweep=sweep, at=float(i)) for i in range(n)]


def _partition_rows(store: TraceStore, definition: str = "d", sweep: str = "s1") -> pa.Table:
    table = store.read(sweep=sweep)
    return table.filter(pc.equal(table["definition"], definition))


@pytest.fixture
def store(tmp_path: Path) -> TraceStore:
    store = make_store(tmp_path, _rows(40), files_per_partition=5)
    make_store(tmp_path, _rows(6, definition="e"), files_per_partition=2)
    return store


def test_compaction_leaves_one_file_with_the_same_rows_in_the_same_order(store: TraceStore) -> None:
    before = _partition_rows(store)
    assert len(store.files(sweep="s1", definition="d")) == 5
    result = compact_partition(store, "d", "s1")
    assert (result.rows, result.files_before, result.files_after) == (40, 5, 1)
    assert store.files(sweep="s1", definition="d") == [result.new_file]
    assert _partition_rows(store).equals(before)


def test_compaction_leaves_other_partitions_alone(store: TraceStore) -> None:
    others = store.files(definition="e")
    compact_partition(store, "d", "s1")
    assert store.files(definition="e") == others


def test_a_partition_of_one_file_is_left_as_it_is(store: TraceStore) -> None:
    compact_partition(store, "d", "s1")
    only = store.files(sweep="s1", definition="d")
    result = compact_partition(store, "d", "s1")
    assert (result.new_file, result.files_after) == (None, 1)
    assert store.files(sweep="s1", definition="d") == only


def test_compaction_refuses_while_the_sweep_is_being_written(store: TraceStore) -> None:
    files = store.files(sweep="s1", definition="d")
    with store.lock("s1"):
        with pytest.raises(StoreError, match="already being run"):
            compact_partition(store, "d", "s1")
    assert store.files(sweep="s1", definition="d") == files


def test_a_compaction_killed_before_removing_old_files_is_finished_by_the_next(store: TraceStore, tmp_path: Path) -> None:
    before = _partition_rows(store)
    folder = store.partition("d", "s1")
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    compact_partition(store, "d", "s1")
    # The state a kill between publish and delete leaves: the merged file and every original,
    # which the manifest says the merged file replaces: no row is read twice even before recovery
    for f in saved.glob("*.parquet"):
        shutil.copy2(f, folder / f.name)
    assert _partition_rows(store).equals(before)
    removed = recover(store, "d", "s1")
    assert len(removed) == 5
    assert _partition_rows(store).equals(before)


def test_compact_command_compacts_every_definition_of_a_sweep(store: TraceStore, capsys: pytest.CaptureFixture) -> None:
    assert main(["--store", str(store.root), "--sweep", "s1"]) == 0
    assert len(store.files(sweep="s1", definition="d")) == 1 and len(store.files(sweep="s1", definition="e")) == 1
    out = capsys.readouterr().out
    assert "d/s1: 40 rows, 5 -> 1 files; wrote " + str(store.root / "definition=d" / "sweep=s1" / "part-") in out
    assert f"in {store.root.resolve()}" in out.splitlines()[-1] and "rows, unchanged" in out


def test_compact_command_names_a_sweep_it_cannot_find(store: TraceStore) -> None:
    proc = subprocess.run([sys.executable, "-m", "fibray.store.compact", "--store", str(store.root), "--sweep", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no files for sweep 'nope'" in proc.stderr
