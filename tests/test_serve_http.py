"""The service's HTTP front through a real Ray Serve deployment on 127.0.0.1, with a real HTTP
client (urllib): verdicts for a good request; a 4xx naming the field, and nothing queued, for bad ones."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from fibray.dataset import load_dataset
from _service_helpers import start_service
from _sweep_helpers import REPO, designed_verdict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http_service(tmp_path_factory):
    svc = start_service(tmp_path_factory.mktemp("http"), "service.http.max_body_bytes=200000", http=True)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def solutions():
    return load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                        workload_set="cpu_small").solutions


def _call(url: str, body: bytes | None = None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _submitted(url: str) -> int:
    code, status = _call(f"{url}/status", method="GET")
    assert code == 200
    return status["submitted"]


def test_a_posted_solution_gets_json_verdicts_and_status_answers(http_service, solutions):
    url = http_service.http_url
    assert url.startswith("http://127.0.0.1:")
    for name in ("rmsnorm_h4096_torch", "rmsnorm_h4096_torch_fp32_out"):
        body = {"solution": solutions[name].to_json_dict(), "definition": "rmsnorm_h4096", "max_workloads": 2,
                "settings": {"warmup": 0, "iterations": 2, "trials": 1}, "sweep": "web"}
        code, answer = _call(f"{url}/evaluate", json.dumps(body).encode())
        assert code == 200, answer
        assert answer["solution"] == name and len(answer["verdicts"]) == 2
        for v in answer["verdicts"]:
            assert (v["status"], v["reason"]) == designed_verdict(name, "rmsnorm_h4096")
            assert v["evaluation"]["status"] == v["status"]
    code, status = _call(f"{url}/status", method="GET")
    assert code == 200 and status["answered"] >= 4 and [s["phase"] for s in status["slots"]] == ["ready", "ready"]


@pytest.mark.parametrize("body,code,field", [
    (b"{not json", 400, "body"),
    (b"[1, 2]", 422, "body"),
    (json.dumps({"definition": "rmsnorm_h4096"}).encode(), 422, "solution"),
    (b"x" * 300_000, 413, "body"),
])
def test_a_malformed_or_oversized_request_gets_a_4xx_naming_the_field(http_service, body, code, field):
    url = http_service.http_url
    before = _submitted(url)
    got, answer = _call(f"{url}/evaluate", body)
    assert (got, answer["field"]) == (code, field), answer
    assert _submitted(url) == before  # nothing queued for it


def test_an_invalid_field_gets_a_422_naming_it_and_queues_nothing(http_service, solutions):
    url = http_service.http_url
    good = {"solution": solutions["rmsnorm_h4096_torch"].to_json_dict(), "definition": "rmsnorm_h4096"}
    before = _submitted(url)
    for change, field in (({"definition": "no_such_definition"}, "definition"),
                          ({"workloads": ["no-such-uuid"]}, "workloads[0]"),
                          ({"settings": {"iterations": -1}}, "settings.iterations"),
                          ({"solution": {**good["solution"], "spec": {**good["solution"]["spec"], "language": "cobol"}}},
                           "solution.spec.language")):
        code, answer = _call(f"{url}/evaluate", json.dumps({**good, **change}).encode())
        assert code == 422 and answer["field"] == field, answer
    assert _submitted(url) == before
    code, answer = _call(f"{url}/nowhere", b"{}")
    assert code == 404 and answer["field"] == "path"
