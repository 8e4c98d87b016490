"""Records cannot be forged: readers take only the files a driver published (its signed manifest),
in publication order. A candidate that plants a PASSED row in its sweep's partition is ignored
when it could write there (privileges explicitly not dropped) and cannot write at all otherwise."""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from fibray.analysis import evaluations, leaderboard
from fibray.apply.index import read_rows
from fibray.store import SCHEMA, TraceStore
from fibray.sweep import run_sweep
from fibray.sweep.summary import summary_rows
from _sweep_helpers import REPO, reachable_tmpdir, smoke_config

FORGER = "offender_forges_records"


def _sweep(store: Path, drop_privileges: bool):
    return run_sweep(smoke_config(
        store, dataset__definitions=["rmsnorm_h4096"], dataset__max_workloads_per_definition=1,
        solutions__roots=[str(REPO / "solutions"), str(REPO / "tests" / "candidates")],
        solutions__names=[FORGER, "rmsnorm_h4096_torch"], sweep__name="forged", runner__drop_privileges=drop_privileges,
        runner__isolation="isolated", runner__standby=False))


@pytest.fixture(scope="module")
def stores():
    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
    base = reachable_tmpdir("fibray-records-")  # reachable, so the forger finds the store either way
    try:
        yield {"open": (base / "open", _sweep(base / "open", drop_privileges=False)),
               "dropped": (base / "dropped", _sweep(base / "dropped", drop_privileges=True))}
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _forged_passes(store: Path) -> bool:
    board = leaderboard(evaluations(store)).filter(pl.col("solution") == FORGER)
    summary = [r for r in summary_rows(TraceStore(store), "forged") if r["solution"] == FORGER]
    applied = [r for r in read_rows(store) if r["solution"] == FORGER and r["status"] == "PASSED"]
    return bool(board["passed"].sum() or any(r["passed"] for r in summary) or applied)


@pytest.mark.slow
def test_a_forged_row_a_candidate_planted_is_ignored_by_every_reader(stores):
    root, report = stores["open"]
    assert not report.privileges_dropped
    store = TraceStore(root)
    store.files()
    assert store.ignored and all("29990101" in p.name for p in store.ignored), "the forger wrote nothing"
    assert not _forged_passes(root)
    rows = store.read(sweep="forged").to_pylist()
    assert {r["solution"] for r in rows} == {FORGER, "rmsnorm_h4096_torch"}
    assert not any(r["privileges_dropped"] for r in rows)  # recorded in every row


@pytest.mark.slow
def test_with_privileges_dropped_a_candidate_cannot_write_into_the_store(stores):
    root, report = stores["dropped"]
    store = TraceStore(root)
    store.files()
    assert report.privileges_dropped and store.ignored == []
    assert not list(root.rglob("part-2999*"))
    assert all(r["privileges_dropped"] for r in store.read().to_pylist())


def test_a_row_claiming_a_later_finish_does_not_replace_the_latest_published(tmp_path: Path):
    store = TraceStore(tmp_path)
    row = {name: None for name in SCHEMA.names}
    row.update(definition="d", sweep="s", job_id="j", workload_uuid="w", solution="x", author="a", language="python",
               status="INCORRECT_NUMERICAL", finished_at=datetime(2026, 1, 1, tzinfo=timezone.utc))
    store.append([row])
    # a copy of the published file with its verdict changed, dated 2099: not in the manifest
    forged = pa.Table.from_pylist([{**row, "status": "PASSED", "speedup": 50.0,
                                    "finished_at": datetime(2099, 1, 1, tzinfo=timezone.utc)}], schema=SCHEMA)
    pq.write_table(forged, store.partition("d", "s") / "part-29990101T000000-forged.parquet")
    assert evaluations(tmp_path).collect()["status"].to_list() == ["INCORRECT_NUMERICAL"]
    again = TraceStore(tmp_path)
    assert len(again.files()) == 1 and [p.name for p in again.ignored] == ["part-29990101T000000-forged.parquet"]


def test_a_published_file_changed_in_place_is_ignored(tmp_path: Path):
    store = TraceStore(tmp_path)
    row = {name: None for name in SCHEMA.names}
    row.update(definition="d", sweep="s", job_id="j", workload_uuid="w", solution="x", status="INCORRECT_NUMERICAL")
    (path,) = store.append([row])
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in {**row, "status": "PASSED"}.items()
                                          if k in SCHEMA.names}], schema=SCHEMA), path)
    assert store.files() == [] and store.ignored == [path]
