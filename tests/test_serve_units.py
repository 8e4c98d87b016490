"""The service's pieces that need no cluster: the fair, bounded queue and request validation
(every bad request names its field)."""

from __future__ import annotations

import json

import pytest

from fibray.client.request import RequestError, resolve_jobs
from fibray.dataset import load_dataset
from fibray.serve.config import validate_serve_config
from fibray.serve.scheduler import FairQueue
from fibray.sweep.config import ConfigError
from _sweep_helpers import REPO, smoke_config
from test_slot import _jobs


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                        workload_set="cpu_small")


def _job(tag: str):
    j = _jobs()[0]
    return j.model_copy(update={"job_id": tag})


def test_the_queue_serves_clients_round_robin_so_a_flood_does_not_starve_another():
    q = FairQueue(max_total=100, max_per_client=50)
    q.push("flood", [_job(f"f{i}") for i in range(40)])
    q.push("small", [_job("s0"), _job("s1")])
    order = [q.pop()[1].job_id for _ in range(5)]
    assert order == ["f0", "s0", "f1", "s1", "f2"]


def test_the_queue_groups_a_batch_by_solution_so_a_slot_keeps_its_executor():
    torch_jobs, triton_jobs = _jobs("rmsnorm_h4096_torch"), _jobs("rmsnorm_h4096_triton")
    interleaved = [j for pair in zip(torch_jobs, triton_jobs) for j in pair]  # workload by workload
    q = FairQueue(max_total=100, max_per_client=50)
    q.push("c", [j.model_copy(update={"job_id": f"{j.solution.name}-{i}"}) for i, j in enumerate(interleaved)])
    names = [q.pop()[1].solution.name for _ in range(len(interleaved))]
    assert names == ["rmsnorm_h4096_torch"] * len(torch_jobs) + ["rmsnorm_h4096_triton"] * len(triton_jobs)


def test_the_queue_bounds_each_client_and_the_total_and_puts_retries_first():
    q = FairQueue(max_total=5, max_per_client=3)
    assert q.room("a") == 3
    q.push("a", [_job("a0"), _job("a1"), _job("a2")])
    assert q.room("a") == 0 and q.room("b") == 2
    q.push("b", [_job("b0"), _job("b1")])
    assert q.room("c") == 0
    q.push_front("b", _job("retry"))  # a lost slot's job is never refused, and goes first
    assert q.pop()[1].job_id == "retry" and len(q) == 5


def test_a_valid_request_becomes_one_job_per_selected_workload(dataset):
    sol = dataset.solutions["rmsnorm_h4096_torch"]
    uuids = [w.uuid for w in dataset.workloads["rmsnorm_h4096"]]
    jobs = resolve_jobs({"solution": sol.to_json_dict(), "definition": "rmsnorm_h4096", "workloads": uuids[1:],
                         "settings": {"trials": 1}, "sweep": "mine"}, sweep="http", dataset=dataset, dataset_root=None)
    assert [j.workload.uuid for j in jobs] == uuids[1:]
    assert {j.sweep for j in jobs} == {"mine"} and jobs[0].settings.trials == 1
    inline = resolve_jobs({"solution": json.dumps(sol.to_json_dict()),
                           "definition": dataset.definitions["rmsnorm_h4096"].to_json_dict(),
                           "workloads": [dataset.workloads["rmsnorm_h4096"][1].to_json_dict()], "settings": {"trials": 1}},
                          sweep="http", dataset=None, dataset_root=None)
    assert inline[0].job_id == jobs[0].job_id  # the same job, whether named or sent inline


@pytest.mark.parametrize("change,field", [
    ({"solution": None}, "solution"),
    ({"definition": "nope"}, "definition"),
    ({"workloads": ["not-a-uuid"]}, "workloads[0]"),
    ({"workloads": [{"axes": {}, "inputs": {}, "uuid": "x"}]}, "workloads[0].axes"),
    ({"settings": {"trials": 0}}, "settings.trials"),
    ({"settings": {"bogus": 1}}, "settings.bogus"),
    ({"max_workloads": 0}, "max_workloads"),
    ({"sweep": "../etc"}, "sweep"),
    ({"surprise": 1}, "surprise"),
])
def test_a_bad_request_is_refused_naming_its_field(dataset, change, field):
    body = {"solution": dataset.solutions["rmsnorm_h4096_torch"].to_json_dict(), "definition": "rmsnorm_h4096"}
    body.update(change)
    with pytest.raises(RequestError) as e:
        resolve_jobs(body, sweep="http", dataset=dataset, dataset_root=None)
    assert e.value.field == field, str(e.value)


def test_a_solution_for_another_definition_is_refused(dataset):
    sol = dict(dataset.solutions["rmsnorm_h4096_torch"].to_json_dict(), definition="gemm_n128_k2048")
    with pytest.raises(RequestError, match="solution.definition"):
        resolve_jobs({"solution": sol, "definition": "rmsnorm_h4096"}, sweep="http", dataset=dataset, dataset_root=None)


def test_a_request_for_too_many_workloads_is_refused(dataset):
    body = {"solution": dataset.solutions["rmsnorm_h4096_torch"].to_json_dict(), "definition": "rmsnorm_h4096"}
    with pytest.raises(RequestError, match="at most 2 per request"):
        resolve_jobs(body, sweep="http", dataset=dataset, dataset_root=None, max_workloads=2)


def test_a_bad_service_key_is_one_error_naming_it():
    with pytest.raises(ConfigError, match="service.max_queue"):
        validate_serve_config({"service": {"max_queue": 0}})
    with pytest.raises(ConfigError, match="service.http.bogus: unknown key"):
        validate_serve_config({"service": {"http": {"bogus": 1}}})


def test_sweeps_use_a_service_unless_it_is_off():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import fibray.sweep.__main__  # noqa: F401  (registers the fibray_root resolver)
    from fibray.sweep.config import validate_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        on = compose(config_name="config", overrides=["service.name=mine"])
        off = compose(config_name="config", overrides=["service=off"])
    assert validate_config(OmegaConf.to_container(on, resolve=True)).service.name == "mine"
    assert validate_config(OmegaConf.to_container(off, resolve=True)).service.name is None
    assert smoke_config("/tmp/x").service.name == "fibray"
