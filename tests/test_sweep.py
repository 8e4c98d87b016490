"""The core loop end to end on Ray: bundled solutions get their designed verdicts, the store
holds one row per evaluation, a rerun adds nothing, and a third-party dataset works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest
import ray

from fibray.store import StoreError, TraceStore, scan
from fibray.sweep import run_sweep
from _sweep_helpers import designed_verdict, smoke_config

REQUIRED_COLUMNS = """job_id sweep definition op_type workload_uuid axes solution solution_hash author language status
reason log max_abs_error max_rel_error latency_ms latency_p95_ms latency_mean_ms latency_cv n_samples
reference_latency_ms speedup hardware worker isolation attempt started_at finished_at torch_version
triton_version python_version fibray_version""".split()


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module's sweeps (only tests that sweep start it)."""
    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, local_ray):
    store = tmp_path_factory.mktemp("store")
    report = run_sweep(smoke_config(store))
    return store, report


@pytest.mark.slow
def test_every_bundled_solution_gets_its_designed_verdict(smoke):
    store, report = smoke
    df = scan(store).collect()
    assert report.recorded == len(df) == report.total_jobs == 63
    for row in df.iter_rows(named=True):
        status, reason = designed_verdict(row["solution"], row["definition"])
        assert (row["status"], row["reason"]) == (status, reason), row["solution"]
        if status == "PASSED":
            assert row["latency_ms"] > 0 and row["reference_latency_ms"] > 0 and row["n_samples"] == 10
            assert row["speedup"] == pytest.approx(row["reference_latency_ms"] / row["latency_ms"])
        if status in ("COMPILE_ERROR", "RUNTIME_ERROR"):
            assert row["log"] and len(row["log"]) <= 4096


@pytest.mark.slow
def test_store_rows_have_the_documented_columns_and_hive_partitions(smoke):
    store, _ = smoke
    df = pl.scan_parquet(f"{store}/**/*.parquet", hive_partitioning=True).collect()
    assert set(REQUIRED_COLUMNS) <= set(df.columns)
    assert df["job_id"].n_unique() == len(df)
    assert set(df["sweep"]) == {"smoke"}
    assert set(df["definition"]) == {"rmsnorm_h4096", "fused_add_rmsnorm_h4096", "gemm_n128_k2048"}
    assert all(isinstance(json.loads(a), dict) for a in df["axes"])
    assert not list(store.rglob(".*.tmp")), "a temporary file was left behind"
    assert all(p.parent.name == "sweep=smoke" and p.parent.parent.name.startswith("definition=")
               for p in TraceStore(store).files())


@pytest.mark.slow
def test_second_identical_run_adds_zero_rows(smoke):
    store, _ = smoke
    files = TraceStore(store).files()
    again = run_sweep(smoke_config(store))
    assert (again.skipped, again.recorded) == (63, 0)
    assert TraceStore(store).files() == files


@pytest.mark.slow
def test_changed_settings_are_new_jobs_in_the_same_sweep(tmp_path, local_ray):
    cfg = smoke_config(tmp_path, dataset__definitions=["rmsnorm_h4096"], solutions__names=["rmsnorm_h4096_torch"])
    first = run_sweep(cfg)
    second = run_sweep(smoke_config(tmp_path, dataset__definitions=["rmsnorm_h4096"],
                                    solutions__names=["rmsnorm_h4096_torch"], eval__trials=1))
    assert (first.recorded, second.recorded, second.skipped) == (3, 3, 0)


@pytest.mark.slow
def test_third_party_flashinfer_dataset_runs_restricted(tmp_path, sample_root, local_ray):
    cfg = smoke_config(tmp_path, dataset__root=str(sample_root), dataset__workload_set=None,
                       dataset__definitions=["rmsnorm_h4096", "gemm_n128_k2048"],
                       dataset__max_workloads_per_definition=2)
    report = run_sweep(cfg)
    df = scan(tmp_path).collect()
    assert report.recorded == len(df) == 2 * 7 * 2
    for row in df.iter_rows(named=True):
        assert (row["status"], row["reason"]) == designed_verdict(row["solution"], row["definition"])


def test_a_second_driver_on_the_same_sweep_is_refused(tmp_path):
    store = TraceStore(tmp_path)
    with store.lock("smoke"):
        with pytest.raises(StoreError, match="already being run by another driver"):
            run_sweep(smoke_config(tmp_path))


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "fibray.sweep", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override, expected", [
    ("eval.trials=0", "eval.trials: Input should be greater than or equal to 1"),
    ("+eval.warmups=3", "unknown key eval.warmups (did you mean eval.warmup?)"),
    ("eval.warmups=3", "unknown key eval.warmups (did you mean eval.warmup?)"),
    ("sweep.name=a/b", "sweep.name: must be 1-128 of letters"),
    ("dataset.root=/nonexistent/ds", "/nonexistent/ds: dataset root is not a directory"),
    ("dataset.definitions=[rmsnorm_h4069]", "did you mean rmsnorm_h4096"),
])
def test_cli_rejects_bad_config_with_one_clear_error(tmp_path, override, expected):
    out = _cli("+experiment=smoke", f"store.root={tmp_path}/store", override, cwd=tmp_path)
    assert out.returncode != 0
    assert expected in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.parquet"))
