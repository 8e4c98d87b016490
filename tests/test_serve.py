"""The evaluation service: started, described and stopped by its command; a sweep, Python clients
and HTTP (a real Ray Serve deployment on 127.0.0.1, a real client: urllib) on it; a slot killed
under load; a client that leaves. Each test runs against a real service (its own Ray head in its
own process group), stopped by the fixture's finalizer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import json
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import ray

from fibray.client import Client
from fibray.dataset import load_dataset
from fibray.schema import EvalSettings, Evaluation
from fibray.store import TraceStore, scan
from fibray.sweep.service import auth_kept
from _service_helpers import Service, start_service
from _sweep_helpers import REPO, designed_verdict

DEFINITION = "rmsnorm_h4096"
FAST = {"warmup": 0, "iterations": 2, "trials": 1}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    # as earlier modules of the suite do: a local Ray started (with its token) and shut down in this
    # process; joining a service whose head checks no token must still work after that
    ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
    ray.shutdown()
    with auth_kept():  # joining the service sets this process's auth mode: later modules' local Rays get theirs back
        svc = start_service(tmp_path_factory.mktemp("serve"), "service.http.max_body_bytes=200000", http=True)
        yield svc
        if ray.is_initialized():
            ray.shutdown()
        svc.stop()


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(REPO / "datasets" / "core", definitions=[DEFINITION], solution_roots=[REPO / "solutions"],
                        workload_set="cpu_small")


def _client(service: Service, sweep: str, **kw) -> Client:
    return Client(sweep, store=service.store, service=service.name, state_dir=str(service.state_dir),
                  dataset=REPO / "datasets" / "core", workload_set="cpu_small", **kw)


def _status(client: Client) -> dict:
    return client.status()


def _wait_rows(store: Path, sweep: str, n: int, deadline_s: float = 120) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        rows = TraceStore(store).read(sweep=sweep, columns=["job_id"]).num_rows if TraceStore(store).files(sweep=sweep) else 0
        if rows >= n:
            return rows
        time.sleep(0.5)
    return rows


@pytest.mark.slow
def test_a_service_starts_reports_its_status_and_stops_leaving_nothing_running(tmp_path):
    """With a head that checks a token: the commands that join it learn the auth mode from its state file."""
    svc = start_service(tmp_path, "cluster.num_gpus=1", token=True)
    assert svc.state()["auth_mode"] == "token" and "RAY_AUTH_MODE" not in svc.env
    try:
        head = svc.state()["head_pid"]
        status = svc.cli("--status")
        assert status.returncode == 0, status.stderr[-2000:]
        out = status.stdout
        assert "slots: 1/1 ready" in out and "queue: 0 waiting" in out and "quarantined: none" in out, out
        assert "throughput" in out and "up " in out
        store = tmp_path / "sweep-store"
        sweep = subprocess.run([sys.executable, "-m", "fibray.sweep", "+experiment=smoke", f"dataset.definitions=[{DEFINITION}]",
                                f"solutions.names=[{DEFINITION}_torch]", f"store.root={store}", f"service.name={svc.name}"],
                               env=svc.env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert sweep.returncode == 0 and "3 evaluated" in sweep.stdout, sweep.stderr[-3000:]
        again = svc.cli(*svc.overrides, env=svc.start_env)
        assert again.returncode == 2 and "already running" in again.stderr, again.stderr[-2000:]
        stop = svc.cli("--stop")
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stderr[-2000:]
        assert not (svc.state_dir / f"{svc.name}.json").exists()
        gone = svc.cli("--status")
        assert gone.returncode == 2 and "no service named" in gone.stderr
        deadline = time.monotonic() + 30
        while psutil.pid_exists(head) and psutil.Process(head).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the service's Ray head outlived --stop"
            time.sleep(0.5)
    finally:
        svc.stop()


@pytest.mark.slow
def test_a_sweep_on_a_running_service_records_every_verdict_once_and_resumes(service, tmp_path):
    store = tmp_path / "sweep-store"
    cmd = [sys.executable, "-m", "fibray.sweep", "+experiment=smoke", f"dataset.definitions=[{DEFINITION}]",
           f"store.root={store}", "sweep.progress=false", f"service.name={service.name}"]
    first = subprocess.run(cmd, env=service.env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"sweep runs on service '{service.name}'" in first.stderr
    assert "21 evaluated" in first.stdout
    df = scan(store).collect()
    assert len(df) == 21 and df["job_id"].n_unique() == 21
    for row in df.iter_rows(named=True):
        assert (row["status"], row["reason"]) == designed_verdict(row["solution"], row["definition"]), row["solution"]
    slots = {s["pid"] for s in _status(_client(service, "probe")).get("slots", [])}
    assert {int(w.rsplit(":", 1)[1]) for w in df["worker"]} <= slots, "the sweep started slots of its own"
    second = subprocess.run(cmd, env=service.env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "21 already recorded, 0 evaluated" in second.stdout, second.stdout[-2000:]


@pytest.mark.slow
def test_two_clients_get_futures_of_their_evaluations_at_once(service, dataset):
    """One client waits on concurrent.futures, the other awaits asyncio futures, both at once."""
    a, b = _client(service, "client-a"), _client(service, "client-b")
    solutions = [s for s in dataset.solutions_for(DEFINITION)]
    answers: dict[str, list] = {}

    def with_futures() -> None:
        fs = [f for sol in solutions for f in a.submit(sol, DEFINITION, settings=FAST)]
        answers["a"] = [f.result(timeout=300) for f in fs]

    async def with_asyncio() -> list:
        fs = [f for sol in solutions for f in await b.submit_async(sol, DEFINITION, settings=FAST)]
        return list(await asyncio.wait_for(asyncio.gather(*fs), timeout=300))

    threads = [threading.Thread(target=with_futures),
               threading.Thread(target=lambda: answers.__setitem__("b", asyncio.run(with_asyncio())))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    expected = [designed_verdict(sol.name, DEFINITION) for sol in solutions for _ in range(3)]
    for name in ("a", "b"):
        assert all(isinstance(ev, Evaluation) for ev in answers[name])
        assert [(ev.status.value, ev.reason) for ev in answers[name]] == expected, name
    a.close()
    for sweep in ("client-a", "client-b"):
        rows = TraceStore(service.store).read(sweep=sweep, columns=["job_id", "status"]).to_pylist()
        assert len(rows) == len({r["job_id"] for r in rows}) == 3 * len(solutions)
    before = a.status()["from_store"]
    again = a.submit(solutions[0], DEFINITION, settings=FAST)  # recorded: answered from the store, not re-run
    assert [f.result(60).status.value for f in again] == ["PASSED"] * 3
    assert a.status()["from_store"] == before + 3
    assert TraceStore(service.store).read(sweep="client-a", columns=["job_id"]).num_rows == 3 * len(solutions)


@pytest.mark.slow
def test_a_slot_killed_under_load_loses_no_job_and_answers_none_twice(service, dataset):
    solutions = [dataset.solutions[f"{DEFINITION}_torch"]]  # honest: every answer must be PASSED
    clients = [_client(service, f"load-{i}") for i in range(2)]
    futures: list = []
    lock = threading.Lock()

    def submit(i: int, client: Client) -> None:
        for seed in range(10):
            settings = EvalSettings(**FAST, seed=seed + 100 * i)
            fs = [f for sol in solutions for f in client.submit(sol, DEFINITION, settings=settings)]
            with lock:
                futures.extend(fs)

    threads = [threading.Thread(target=submit, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    victim = None
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline:
        st = clients[0].status()
        busy = [s for s in st["slots"] if s["phase"] == "ready" and s["inflight"] > 0]
        if busy and st["answered"] >= 2:
            victim = busy[0]["pid"]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert victim is not None, "no slot was busy to be killed"
    total = 2 * 10 * len(solutions) * 3
    assert len(futures) == total
    answers = [f.result(timeout=600) for f in futures]
    assert all(ev.status.value == "PASSED" for ev in answers), [ev.log[-200:] for ev in answers if ev.status.value != "PASSED"]
    clients[0].close()
    rows = TraceStore(service.store).read(columns=["job_id", "sweep", "attempt", "worker"]).to_pylist()
    rows = [r for r in rows if r["sweep"].startswith("load-")]
    assert len(rows) == len({(r["sweep"], r["job_id"]) for r in rows}) == total  # nothing lost, nothing twice
    assert any(r["attempt"] > 1 for r in rows), "the killed slot's job was not re-run"
    assert not any(r["attempt"] > 1 and int(r["worker"].rsplit(":", 1)[1]) == victim for r in rows)
    st = clients[0].status()
    assert st["slot_restarts"] >= 1 and st["requeued"] >= 1 and st["late_answers"] == 0


_LEAVER = """
import os, sys
from fibray.client import Client
from fibray.dataset import load_dataset
ds = load_dataset(sys.argv[3], definitions=["rmsnorm_h4096"], solution_roots=[sys.argv[4]], workload_set="cpu_small")
c = Client("leaver", store=sys.argv[2], service=sys.argv[1], dataset=sys.argv[3], workload_set="cpu_small")
fs = c.submit(ds.solutions["rmsnorm_h4096_torch"], "rmsnorm_h4096", settings={"warmup": 0, "iterations": 2, "trials": 1, "seed": 7})
print(len(fs), flush=True)
os._exit(0)  # gone before any verdict: no close, no flush
"""


@pytest.mark.slow
def test_a_client_that_disconnects_still_has_its_jobs_finished_and_recorded(service):
    proc = subprocess.run([sys.executable, "-c", _LEAVER, service.name, str(service.store),
                           str(REPO / "datasets" / "core"), str(REPO / "solutions")],
                          env=service.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stderr[-3000:]
    assert _wait_rows(service.store, "leaver", 3) == 3
    rows = TraceStore(service.store).read(sweep="leaver", columns=["status"]).to_pylist()
    assert [r["status"] for r in rows] == ["PASSED"] * 3


# -- HTTP -------------------------------------------------------------------------------------
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


@pytest.mark.slow
def test_a_posted_solution_gets_json_verdicts_and_status_answers(service, dataset):
    url = service.http_url
    assert url.startswith("http://127.0.0.1:")
    for name in ("rmsnorm_h4096_torch", "rmsnorm_h4096_torch_fp32_out"):
        body = {"solution": dataset.solutions[name].to_json_dict(), "definition": "rmsnorm_h4096", "max_workloads": 2,
                "settings": {"warmup": 0, "iterations": 2, "trials": 1}, "sweep": "web"}
        code, answer = _call(f"{url}/evaluate", json.dumps(body).encode())
        assert code == 200, answer
        assert answer["solution"] == name and len(answer["verdicts"]) == 2
        for v in answer["verdicts"]:
            assert (v["status"], v["reason"]) == designed_verdict(name, "rmsnorm_h4096")
            assert v["evaluation"]["status"] == v["status"]
    code, status = _call(f"{url}/status", method="GET")
    assert code == 200 and status["answered"] >= 4 and len(status["slots"]) == 2  # one may still be restarting
    assert "ready" in {s["phase"] for s in status["slots"]} and status["queue_depth"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("body,code,field", [
    (b"{not json", 400, "body"),
    (b"[1, 2]", 422, "body"),
    (json.dumps({"definition": "rmsnorm_h4096"}).encode(), 422, "solution"),
    (b"x" * 300_000, 413, "body"),
])
def test_a_malformed_or_oversized_request_gets_a_4xx_naming_the_field(service, body, code, field):
    url = service.http_url
    before = _submitted(url)
    got, answer = _call(f"{url}/evaluate", body)
    assert (got, answer["field"]) == (code, field), answer
    assert _submitted(url) == before  # nothing queued for it


@pytest.mark.slow
def test_an_invalid_field_gets_a_422_naming_it_and_queues_nothing(service, dataset):
    url = service.http_url
    good = {"solution": dataset.solutions["rmsnorm_h4096_torch"].to_json_dict(), "definition": "rmsnorm_h4096"}
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
