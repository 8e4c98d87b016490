"""Workload splits: the splits/ sidecar, the loader's split filter, the sweep's split column,
public-only feedback, and replay workloads marked from tracing captures."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _promote_fixtures import (
    DEFINITION, HIDDEN_SIZES, PUBLIC_SIZES, shared_ray, sweep_config, uuid, write_split_dataset,
)

from fibray.dataset import DatasetError, load_dataset
from fibray.schema import Split
from fibray.store import TraceStore, scan
from fibray.sweep import run_sweep, validate_config
from fibray.sweep.config import ConfigError
from fibray.sweep.driver import summary_rows


def test_unlisted_workloads_are_public_and_listed_ones_have_their_split(tmp_path: Path) -> None:
    ds = load_dataset(write_split_dataset(tmp_path / "d"))
    assert {w.uuid: ds.split_of(w.uuid) for w in ds.workloads[DEFINITION]} == {
        **{uuid(n): Split.PUBLIC for n in PUBLIC_SIZES}, **{uuid(n): Split.HIDDEN for n in HIDDEN_SIZES}}


@pytest.mark.parametrize("split, sizes", [("public", PUBLIC_SIZES), ("hidden", HIDDEN_SIZES),
                                          ("all", PUBLIC_SIZES + HIDDEN_SIZES)])
def test_split_filter_keeps_only_that_splits_workloads(tmp_path: Path, split: str, sizes: tuple[int, ...]) -> None:
    ds = load_dataset(write_split_dataset(tmp_path / "d"), split=split)
    assert [w.axes["n"] for w in ds.workloads[DEFINITION]] == list(sizes)


def test_replay_split_with_no_replay_workloads_leaves_the_definition_without_workloads(tmp_path: Path) -> None:
    assert load_dataset(write_split_dataset(tmp_path / "d"), split="replay").workloads == {}


def test_unknown_split_value_is_an_error_naming_the_file_and_the_uuid(tmp_path: Path) -> None:
    root = write_split_dataset(tmp_path / "d")
    (root / "splits" / "extra.json").write_text(json.dumps({uuid(2): "secret"}))
    with pytest.raises(DatasetError, match=r"extra\.json: scale_h64-n2: split must be one of public, hidden, replay"):
        load_dataset(root)


def test_a_workload_two_files_split_differently_is_an_error_naming_both(tmp_path: Path) -> None:
    root = write_split_dataset(tmp_path / "d")
    (root / "splits" / "zz.json").write_text(json.dumps({uuid(HIDDEN_SIZES[0]): "public"}))
    with pytest.raises(DatasetError, match=r"zz\.json: scale_h64-n4: split 'public' conflicts with 'hidden' in .*scale_h64\.json"):
        load_dataset(root)


def test_malformed_split_file_is_an_error_naming_it(tmp_path: Path) -> None:
    root = write_split_dataset(tmp_path / "d")
    (root / "splits" / "bad.json").write_text("[1, 2")
    with pytest.raises(DatasetError, match=r"bad\.json: malformed JSON"):
        load_dataset(root)


def test_bad_split_config_value_is_an_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset\.split"):
        validate_config({"dataset": {"root": str(tmp_path), "split": "secret"}})


def test_dataset_with_a_splits_sidecar_loads_in_flashinfer_bench(tmp_path: Path) -> None:
    from flashinfer_bench.data import TraceSet

    root = write_split_dataset(tmp_path / "d")
    ts = TraceSet.from_path(str(root))
    assert {w.workload.uuid for w in ts.workloads[DEFINITION]} == {uuid(n) for n in PUBLIC_SIZES + HIDDEN_SIZES}


def test_store_files_from_before_the_split_column_read_it_as_null(tmp_path: Path) -> None:
    store = TraceStore(tmp_path / "s")
    folder = store.partition("d", "old")
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"job_id": ["j1"], "status": ["PASSED"]}), folder / "part-old.parquet")
    assert store.read(columns=["job_id", "split"]).to_pylist() == [{"job_id": "j1", "split": None}]
    assert scan(tmp_path / "s").select("job_id", "split").collect().to_dicts() == [{"job_id": "j1", "split": None}]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("splits")
    dataset, store = write_split_dataset(root / "d"), root / "store"
    with shared_ray():
        run_sweep(validate_config(sweep_config(dataset, store, "all", solutions={"names": [f"{DEFINITION}_torch"]})))
        yield dataset, store


@pytest.mark.slow
def test_sweep_records_each_workloads_split_in_the_store(swept) -> None:
    rows = TraceStore(swept[1]).read(sweep="all", columns=["workload_uuid", "split"]).to_pylist()
    assert {r["workload_uuid"]: r["split"] for r in rows} == {
        **{uuid(n): "public" for n in PUBLIC_SIZES}, **{uuid(n): "hidden" for n in HIDDEN_SIZES}}


@pytest.mark.slow
def test_sweep_summary_feeds_back_public_workloads_only(swept) -> None:
    store = TraceStore(swept[1])
    (public,) = summary_rows(store, "all")
    (everything,) = summary_rows(store, "all", splits=None)
    assert (public["total"], everything["total"]) == (len(PUBLIC_SIZES), len(PUBLIC_SIZES) + len(HIDDEN_SIZES))


@pytest.mark.slow
def test_hidden_split_sweep_runs_only_hidden_workloads(swept, tmp_path: Path) -> None:
    dataset, _ = swept
    report = run_sweep(validate_config(sweep_config(dataset, tmp_path / "store", "hidden",
                                                    dataset={"split": "hidden"},
                                                    solutions={"names": [f"{DEFINITION}_torch"]})))
    rows = TraceStore(tmp_path / "store").read(columns=["workload_uuid", "split"]).to_pylist()
    assert report.total_jobs == len(HIDDEN_SIZES)
    assert {r["workload_uuid"] for r in rows} == {uuid(n) for n in HIDDEN_SIZES}


def test_traced_calls_become_replay_workloads_and_assigned_ones_keep_their_split(tmp_path: Path) -> None:
    from _apply_fixtures import scale

    from fibray.apply import apply
    from fibray.tracing import mark_replay, trace

    root = write_split_dataset(tmp_path / "d")
    f = apply(DEFINITION)(scale)
    with trace(root, root, workload_set="traced"):
        for n in (3, 5, 3):
            f(torch.randn(n, 64), torch.randn(64))
    marked = mark_replay(root, "traced")
    again = mark_replay(root, "traced")
    ds = load_dataset(root, split="replay")
    assert marked.marked == {DEFINITION: 2} and again.marked == {} and again.kept == 2
    assert sorted(w.axes["n"] for w in ds.workloads[DEFINITION]) == [3, 5]
    assert [w.axes["n"] for w in load_dataset(root, split="hidden").workloads[DEFINITION]] == list(HIDDEN_SIZES)
