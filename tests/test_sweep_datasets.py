"""Every row names its dataset; one sweep name holds one dataset unless asked; definitions without
solutions or workloads are said, and references can be evaluated as candidates."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import ray

from fibray.dataset import DatasetError, load_dataset
from fibray.store import StoreError, TraceStore, scan
from fibray.sweep import run_sweep
from _sweep_helpers import REPO, smoke_config

CORE = REPO / "datasets" / "core"
ONE = {"dataset__definitions": ["rmsnorm_h4096"], "dataset__max_workloads_per_definition": 1}


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module's sweeps (only tests that sweep start it)."""
    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _changed_copy(tmp_path: Path) -> Path:
    """datasets/core whose first rmsnorm workload has another batch size (and uuid): same names, another dataset."""
    copy = tmp_path / "core-copy"
    shutil.copytree(CORE, copy)
    wl = next((copy / "workloads" / "cpu_small").rglob("rmsnorm_h4096.jsonl"))
    wl.write_text(wl.read_text().replace('"0f40a1fe-', '"0f40a1ff-', 1).replace('"batch_size": 1}', '"batch_size": 2}', 1))
    return copy


def test_dataset_hash_names_the_content_not_the_selection(tmp_path):
    full = load_dataset(CORE, workload_set="cpu_small")
    some = load_dataset(CORE, definitions=["rmsnorm_h4096"], max_workloads_per_definition=1)
    assert full.name == "core" and len(full.hash) == 64 and full.hash == some.hash
    assert load_dataset(_changed_copy(tmp_path)).hash != full.hash


@pytest.mark.slow
def test_rows_name_their_dataset_and_references_run_as_candidates(tmp_path, local_ray):
    report = run_sweep(smoke_config(tmp_path, solutions__roots=[], solutions__include_reference=True, **ONE))
    df = scan(tmp_path).collect()
    assert report.recorded == len(df) == 1
    row = df.row(0, named=True)
    assert (row["solution"], row["author"], row["status"]) == ("rmsnorm_h4096_reference", "reference", "PASSED")
    assert (row["dataset_name"], row["dataset_hash"]) == ("core", load_dataset(CORE).hash)
    assert row["environment_limited"] is False


@pytest.mark.slow
def test_a_sweep_name_reused_with_another_dataset_is_refused(tmp_path, local_ray):
    store = tmp_path / "store"
    run_sweep(smoke_config(store, **ONE, solutions__names=["rmsnorm_h4096_torch"]))
    files = TraceStore(store).files()
    other = _changed_copy(tmp_path)
    with pytest.raises(StoreError, match=r"sweep 'smoke' .* holds results of dataset 'core' .*"
                                         r"sweep.allow_mixed_datasets=true"):
        run_sweep(smoke_config(store, dataset__root=str(other), **ONE, solutions__names=["rmsnorm_h4096_torch"]))
    assert TraceStore(store).files() == files
    mixed = run_sweep(smoke_config(store, dataset__root=str(other), **ONE, solutions__names=["rmsnorm_h4096_torch"],
                                   sweep__allow_mixed_datasets=True))
    assert mixed.recorded == 1
    assert set(scan(store).collect()["dataset_hash"]) == {load_dataset(CORE).hash, load_dataset(other).hash}


@pytest.mark.slow
def test_definitions_without_solutions_are_listed_in_a_warning(tmp_path, caplog, local_ray):
    with caplog.at_level(logging.WARNING, logger="fibray"):
        report = run_sweep(smoke_config(tmp_path, dataset__definitions=["rmsnorm_h4096", "gemm_n128_k2048"],
                                        dataset__max_workloads_per_definition=1,
                                        solutions__names=["rmsnorm_h4096_torch"]))
    assert report.recorded == 1
    assert "no solutions for 1 definition(s), which get no jobs: gemm_n128_k2048" in caplog.text
    assert "solutions.include_reference=true" in caplog.text


def test_a_dataset_with_no_solutions_is_an_error_naming_the_way_out(tmp_path):
    with pytest.raises(DatasetError, match=r"no solution for any selected definition .*solutions.include_reference=true"):
        run_sweep(smoke_config(tmp_path, solutions__roots=[]))
    assert not list(tmp_path.rglob("*.parquet"))


LLM = REPO / "datasets" / "llm"


def test_definitions_without_workloads_in_the_set_are_listed_and_none_at_all_is_an_error(tmp_path, caplog):
    """datasets/llm's GEMM has GPU-size workloads only: a cpu_small sweep of it gets no jobs, and says why."""
    from fibray.sweep.driver import load_sweep_dataset

    some = smoke_config(tmp_path, dataset__root=str(LLM), solutions__roots=[],
                        dataset__definitions=["rmsnorm_h2048", "gemm_n4096_k4096"])
    with caplog.at_level(logging.WARNING, logger="fibray"):
        ds = load_sweep_dataset(some)
    assert ds.workloads["rmsnorm_h2048"] and not ds.workloads.get("gemm_n4096_k4096")
    assert ("no workloads in " in caplog.text and "workloads/cpu_small/ for 1 selected definition(s), which get no jobs: "
            "gemm_n4096_k4096 (dataset.workload_set=null reads every set)" in caplog.text), caplog.text
    with pytest.raises(DatasetError, match=r"^dataset.workload_set: no workloads in .*cpu_small/ for 1 selected "
                                           r"definition\(s\), which get no jobs: gemm_n4096_k4096"):
        run_sweep(smoke_config(tmp_path, dataset__root=str(LLM), solutions__roots=[],
                               dataset__definitions=["gemm_n4096_k4096"]))
    assert not list(tmp_path.rglob("*.parquet"))
