"""No work twice: a reference latency in the store is reused by a later sweep of the same definition,
workload, environment and timing settings, with its provenance, and the reference is not timed again."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from fibray.schema.job import KnownReference, environment_key
from fibray.store import TraceStore
from fibray.sweep import run_sweep
from _sweep_helpers import smoke_config
from test_slot import _jobs


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _rows(root, sweep: str) -> list[dict]:
    cols = ["workload_uuid", "status", "job_id", "reference_latency_ms", "reference_latency_source", "reference_job_id"]
    t = TraceStore(root).read(sweep=sweep, columns=cols)
    return t.filter(pc.equal(t["status"], "PASSED")).to_pylist()


@pytest.mark.slow
def test_a_second_sweep_reuses_the_first_sweeps_reference_latencies(tmp_path, local_ray):
    defs = ["rmsnorm_h4096"]
    run_sweep(smoke_config(tmp_path, sweep__name="first", dataset__definitions=defs, cluster__num_gpus=1))
    second = run_sweep(smoke_config(tmp_path, sweep__name="second", dataset__definitions=defs, cluster__num_gpus=1))
    first_rows, second_rows = _rows(tmp_path, "first"), _rows(tmp_path, "second")
    assert first_rows and second_rows
    assert {r["reference_latency_source"] for r in first_rows} == {"measured"}
    measured = {r["workload_uuid"]: (r["reference_latency_ms"], r["reference_job_id"]) for r in first_rows}
    assert set(measured.values()) <= {(r["reference_latency_ms"], r["reference_job_id"]) for r in first_rows}
    first_ids = {r["job_id"] for r in first_rows}
    for r in second_rows:
        assert r["reference_latency_source"] == "reused"
        assert r["reference_latency_ms"] == measured[r["workload_uuid"]][0]
        assert r["reference_job_id"] in first_ids
    assert second.phases.get("reference_timing", 0.0) == 0.0


def test_a_known_reference_of_another_environment_is_not_reused(tmp_path):
    from fibray.evaluate.run import Judge
    from fibray.evaluate.environment import default_device, environment

    device = default_device()
    judge = Judge(tmp_path, device, environment(device))
    env = judge.env
    job = _jobs()[0]
    here = {environment_key(env.hardware, env.libs): KnownReference(latency_ms=1.5, job_id="j-here")}
    other = {environment_key("NVIDIA H200", env.libs): KnownReference(latency_ms=1.5, job_id="j-other")}
    assert judge.known_reference(job.model_copy(update={"known_references": here})).job_id == "j-here"
    assert judge.known_reference(job.model_copy(update={"known_references": other})) is None
    untimed = job.model_copy(update={"known_references": here,
                                     "settings": job.settings.model_copy(update={"time_reference": False})})
    assert judge.known_reference(untimed) is None
