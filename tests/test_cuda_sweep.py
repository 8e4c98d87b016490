"""CUDA solutions in a real sweep on a machine with no GPU: compiled ahead on CPU Ray tasks into
the store's shared artifact cache, a compile error recorded as such, the rest marked as needing
a GPU (never silently skipped)."""

from __future__ import annotations

import shutil

import pytest

import ray

from fibray.store import TraceStore, scan
from fibray.sweep import run_sweep, sweep_summary
from _sweep_helpers import REPO, reachable_tmpdir, smoke_config

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

CUDA = ["rmsnorm_h4096_cuda_c_abi", "rmsnorm_h4096_cuda_torch", "rmsnorm_h4096_cuda_compile_error"]


def test_cuda_solutions_compile_ahead_and_get_verdicts_without_a_gpu():
    base = reachable_tmpdir("fibray-cuda-")
    store = base / "store"
    cfg = smoke_config(store, dataset__root=str(REPO / "datasets" / "llm"), dataset__definitions=["rmsnorm_h4096"],
                       dataset__max_workloads_per_definition=1, solutions__roots=[], solutions__names=CUDA,
                       sweep__name="cuda")
    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = run_sweep(cfg)
    finally:
        ray.shutdown()
    rows = {r["solution"]: r for r in scan(store).collect().iter_rows(named=True)}
    assert report.recorded == len(rows) == 3
    assert (rows["rmsnorm_h4096_cuda_compile_error"]["status"], rows["rmsnorm_h4096_cuda_compile_error"]["reason"]) \
        == ("COMPILE_ERROR", "nvcc_error")
    assert "error" in rows["rmsnorm_h4096_cuda_compile_error"]["log"]
    for name in CUDA[:2]:
        assert (rows[name]["status"], rows[name]["reason"]) == ("RUNTIME_ERROR", "device_required"), rows[name]["log"][-500:]
        assert rows[name]["environment_limited"] is True  # could not run here: not charged to its author
    assert rows["rmsnorm_h4096_cuda_compile_error"]["environment_limited"] is False  # a compile error is the author's
    summary = sweep_summary(TraceStore(store), "cuda")
    table, limited = summary.split("could not run here", 1)
    assert "rmsnorm_h4096_cuda_compile_error" in table and "rmsnorm_h4096_cuda_torch " not in table
    assert "rmsnorm_h4096_cuda_torch" in limited and "needs a GPU, this machine has none:1" in limited
    built = [p for p in (store / "_builds").iterdir() if not p.name.startswith(".")]
    assert len(built) >= 3  # every solution compiled (or failed) once, ahead, into the shared cache
    shutil.rmtree(base, ignore_errors=True)
