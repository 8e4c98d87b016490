"""Multi-node on one machine: a sweep spread over two Ray nodes loses one node mid-sweep and
still records every job exactly once with its designed verdict; a sweep joins an existing
cluster through RAY_ADDRESS. No Ray or executor process outlives the test."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from fibray.store import TraceStore, scan
from fibray.sweep import run_sweep
from _sweep_helpers import REPO, designed_verdict, smoke_config

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

DEFINITIONS = ["rmsnorm_h4096", "fused_add_rmsnorm_h4096"]
TOTAL = 2 * 3 * 7  # definitions x cpu_small workloads x bundled solutions per definition
# Node death is noticed by the GCS health check; the default (about 15 s) would dominate the test.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_no_process_left(before: set[int], deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        left = []
        for pid in _descendants() - before:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail("processes left behind:\n" + "\n".join(left))
        time.sleep(0.5)


def _worker_pid(worker: str) -> int:
    return int(worker.rsplit(":", 1)[1])  # JobResult.worker is name@host:pid


def _slot_pids_under(raylet_pid: int) -> set[int]:
    """Slot actor processes (SlotActor) started by one node's raylet (all nodes share this host)."""
    pids = set()
    for child in psutil.Process(raylet_pid).children(recursive=True):
        try:
            if "SlotActor" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _raylet_pid(node) -> int:
    return node.all_processes["raylet"][0].process.pid


def _rows(store: Path) -> list[dict]:
    if not TraceStore(store).files():
        return []
    return TraceStore(store).read(columns=["job_id", "worker", "attempt"]).to_pylist()


def _assert_complete(store: Path) -> "object":
    df = scan(store).collect()
    assert len(df) == TOTAL and df["job_id"].n_unique() == TOTAL
    for row in df.iter_rows(named=True):
        assert (row["status"], row["reason"]) == designed_verdict(row["solution"], row["definition"]), row["solution"]
    return df


def test_sweep_over_two_nodes_survives_losing_one_mid_sweep(tmp_path):
    before = _descendants()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 1, "resources": {"node_head": 1}, "include_dashboard": False,
        "_system_config": FAST_NODE_DEATH})
    node_b = cluster.add_node(num_cpus=1, num_gpus=1, resources={"node_b": 1})
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        assert ray.cluster_resources().get("GPU") == 2
        store = tmp_path / "store"
        lost: dict[str, set[int]] = {}

        def kill_node_b_once_both_nodes_recorded() -> None:
            deadline = time.monotonic() + 150
            b_raylet = _raylet_pid(node_b)
            while time.monotonic() < deadline and not done.is_set():
                try:
                    on_b = _slot_pids_under(b_raylet)
                except psutil.NoSuchProcess:
                    return
                workers = {_worker_pid(r["worker"]) for r in _rows(store)}
                if on_b & workers and workers - on_b:
                    lost["pids"] = on_b
                    cluster.remove_node(node_b, allow_graceful=False)
                    return
                time.sleep(0.1)

        done = threading.Event()
        killer = threading.Thread(target=kill_node_b_once_both_nodes_recorded, daemon=True)
        killer.start()
        # the replacement of node b's slot can never be placed: it must give up quickly, not hang the sweep
        try:
            report = run_sweep(smoke_config(store, dataset__definitions=DEFINITIONS, cluster__num_gpus=2,
                                            cluster__start_deadline_s=60, sweep__flush_rows=1,
                                            runner__standby=False, runner__spare_isolated=0))
        finally:
            done.set()
            killer.join(timeout=10)
        assert lost, "node b was never killed (both nodes did not record before the sweep ended)"
        assert report.recorded == TOTAL
        df = _assert_complete(store)
        retried = df.filter(df["attempt"] > 1)
        assert len(retried) >= 1, "the job running on the lost node was not re-run"
        assert not {_worker_pid(w) for w in retried["worker"]} & lost["pids"], "a retry ran on the dead node"
        after_kill = {_worker_pid(w) for w in df["worker"]} - lost["pids"]
        assert after_kill, "no job ran on the surviving node"
    finally:
        ray.shutdown()
        cluster.shutdown()
    _assert_no_process_left(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_head(port: int, temp_dir: str, env: dict) -> subprocess.Popen:
    """`ray start --head --block`: every process of this head is its descendant, so stopping it by
    pid stops exactly this cluster (`ray stop` would stop every Ray on the host)."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={port}", "--num-gpus=1", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = head.stdout.readline()
        out.append(line)
        if "block forever" in line:
            threading.Thread(target=head.stdout.read, daemon=True).start()  # keep the pipe drained
            return head
        if not line and head.poll() is not None:
            break
    head.kill()
    pytest.fail("ray start --head did not come up:\n" + "".join(out)[-3000:])


def test_sweep_joins_an_existing_cluster_through_ray_address(tmp_path):
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="fr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # Ray 2.60 secures a `ray start` head with a token; whoever joins must present it
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    before = _descendants()
    head = _start_head(port, temp_dir, env)
    store = tmp_path / "store"
    joined = {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    try:
        wait = subprocess.run([sys.executable, str(REPO / "jobs" / "wait_for_cluster.py"), "--address", joined["RAY_ADDRESS"],
                               "--nodes", "1", "--gpus", "1", "--timeout", "60"],
                              env=joined, capture_output=True, text=True, timeout=120)
        assert wait.returncode == 0 and "1 nodes, 1 GPUs ready" in wait.stdout, wait.stderr[-3000:]
        proc = subprocess.run(
            [sys.executable, "-m", "fibray.sweep", "+experiment=smoke",
             "dataset.definitions=[rmsnorm_h4096]", "solutions.names=[rmsnorm_h4096_torch]",
             f"store.root={store}", "sweep.progress=false"],
            cwd=tmp_path, env=joined, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        df = scan(store).collect()
        assert len(df) == 3 and set(df["status"]) == {"PASSED"}
        assert df["worker"].n_unique() == 1  # the cluster's one GPU is one slot: it joined, it did not start a Ray
        # fibray says where it went (Ray's own "Connecting to existing Ray cluster" is kept quiet since issue 19)
        assert f"joining the Ray cluster at 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
        assert "starting a local Ray" not in proc.stderr
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
    _assert_no_process_left(before)


def test_a_service_restores_a_slot_lost_with_its_node_once_a_gpu_is_free_again(tmp_path, monkeypatch):
    """Issue 16.5: the node holding the service's only slot is lost; a request sent then waits (its
    job is re-queued, the replacement slot cannot be placed and gives up); a node with a GPU joins and
    the service starts the slot there: the request is answered, once."""
    from fibray.sweep.service import auth_kept, use_auth

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = _descendants()
    with auth_kept():  # Ray caches the auth mode in this process: later tests get theirs back
        use_auth("disabled")  # the in-process cluster and everyone joining it
        _restore_after_node_loss(tmp_path)
    _assert_no_process_left(before)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # an earlier test may have made us a subreaper
    except psutil.NoSuchProcess:
        return False


def _restore_after_node_loss(tmp_path: Path) -> None:
    from _service_helpers import Service

    from fibray.client import Client
    from fibray.dataset import load_dataset

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH})
    node_b = cluster.add_node(num_cpus=0, num_gpus=1)
    state_dir = Path(tempfile.mkdtemp(prefix="fibray-state-", dir="/tmp"))
    env = {**os.environ, "FIBRAY_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO)}
    svc = Service(f"restore{os.getpid()}", state_dir, env, tmp_path / "store")
    data = REPO / "datasets" / "core"
    try:
        cluster.wait_for_nodes()
        started = svc.cli(f"cluster.address={cluster.address}", "cluster.num_gpus=1", "cluster.start_deadline_s=20",
                          f"store.root={svc.store}", "runner.spare_isolated=0", "service.restore_interval_s=1",
                          f"dataset.root={data}", "dataset.workload_set=cpu_small", timeout=600)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-4000:]
        ds = load_dataset(data, definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                          solutions=["rmsnorm_h4096_torch"], workload_set="cpu_small")
        sol, (w0, w1) = ds.solutions["rmsnorm_h4096_torch"], [w.uuid for w in ds.workloads["rmsnorm_h4096"][:2]]
        client = Client("restore", store=svc.store, service=svc.name, state_dir=str(state_dir), dataset=data,
                        workload_set="cpu_small")
        fast = {"warmup": 0, "iterations": 2, "trials": 1}
        assert client.submit(sol, "rmsnorm_h4096", workloads=[w0], settings=fast)[0].result(timeout=300).status.value == "PASSED"

        status = client.status()
        slot_pid = status["slots"][0]["pid"]
        on_b = {c.pid for c in psutil.Process(_raylet_pid(node_b)).children(recursive=True)}
        assert slot_pid in on_b and status["pid"] not in on_b  # the coordinator stays where the service started
        cluster.remove_node(node_b, allow_graceful=False)
        deadline = time.monotonic() + 60
        while _alive(slot_pid) or any(n["NodeID"] == node_b.node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "node b or its slot outlived remove_node"
            time.sleep(0.2)
        waiting = client.submit(sol, "rmsnorm_h4096", workloads=[w1], settings=fast)
        deadline = time.monotonic() + 120
        while not any(s.get("phase") == "dead" for s in client.status()["slots"]):  # its replacement gave up
            assert time.monotonic() < deadline, repr(client.status())
            time.sleep(1.0)
        assert not waiting[0].done()  # no GPU anywhere: the request waits, it is not failed
        cluster.add_node(num_cpus=0, num_gpus=1)
        ev = waiting[0].result(timeout=300)
        assert ev.status.value == "PASSED", ev.log[-500:]
        status = client.status()
        assert status["slot_restores"] >= 1 and status["requeued"] >= 1, status
        def rows() -> list[str]:
            store = TraceStore(svc.store)
            return [r["workload_uuid"] for r in store.read(sweep="restore", columns=["workload_uuid"]).to_pylist()
                    ] if store.files(sweep="restore") else []

        deadline = time.monotonic() + 60
        while len(rows()) < 2 and time.monotonic() < deadline:  # the service publishes its rows each second
            time.sleep(0.5)
        time.sleep(2.0)  # and nothing more comes
        assert sorted(rows()) == sorted([w0, w1])  # each answered once
    finally:
        svc.stop()
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
