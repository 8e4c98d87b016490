"""A slot's fork server: executors forked from it are sandboxed as launched ones are, hold none of
the server's descriptors, and a server that refuses, dies or forks broken executors costs speed only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fibray.dataset import load_dataset
from fibray.evaluate import now_iso
from fibray.schema import EvalSettings, Job
from fibray.workers.process import sandbox
from fibray.workers.process.channel import recv
from fibray.workers.process.forkserver import ForkedProcess, ForkServerGone
from fibray.workers.process.uids import DEFAULT_UID_RANGE
from fibray.workers.slot import GpuSlot
from fibray.workers.spec import SlotSpec
from fibray.workers.start import SlotStart
from _sweep_helpers import REPO, assert_memory_bound, reachable_tmpdir

pytestmark = pytest.mark.slow  # sandboxed processes, torch imports


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


@pytest.fixture(scope="module")
def server():
    base = reachable_tmpdir("fibray-forkserver-")
    srv = sandbox.fork_server("cpu", base, sandbox.SandboxPolicy())
    assert srv.ready.wait(180) and not srv.lost, srv.why
    yield base, srv
    srv.close()


def test_a_forked_executor_is_sandboxed_and_holds_none_of_the_servers_descriptors(server):
    base, srv = server
    policy = sandbox.SandboxPolicy(max_open_files=512, max_processes=300, memory_limit_bytes=8 << 30)
    ex = sandbox.spawn("cpu", base, policy, single_use=True, server=srv)
    try:
        assert isinstance(ex.proc, ForkedProcess)
        hello = recv(ex.conn, time.monotonic() + 60, ex.arena).value
        pid = sandbox._children(ex.pid)[0] if ex.pid_namespace else ex.pid
        assert hello.pid == (1 if ex.pid_namespace else ex.pid)
        first, last = DEFAULT_UID_RANGE
        assert first <= hello.uid <= last and ex.uid.uid == hello.uid
        limits = {line[:26].strip(): line[26:47].strip() for line in Path(f"/proc/{pid}/limits").read_text().splitlines()}
        assert limits["Max open files"] == "512" and limits["Max processes"] == "300"
        assert limits["Max core file size"] == "0"
        assert_memory_bound(ex, limits, 8 << 30)
        if sandbox.network_namespaces_available():
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # the process tree: the server forked it, in a session of its own
        ppid = int(Path(f"/proc/{ex.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid == srv.pid and os.getpgid(ex.pid) == ex.pid
        # not one of the server's sockets (its end of our channel above all) is open in the executor
        assert _socket_inodes(srv.pid) and not _socket_inodes(srv.pid) & (_socket_inodes(pid) | _socket_inodes(ex.pid))
    finally:
        sandbox.retire(ex)
    assert ex.proc.returncode == -signal.SIGKILL
    assert ex.exit_reason()[1] == "executor killed by SIGKILL"


def test_a_server_for_uids_of_their_own_refuses_a_request_that_keeps_its_uid(server):
    base, srv = server
    out_r, out_w = os.pipe()
    a, b = os.pipe()
    try:
        with pytest.raises(ForkServerGone, match="without a uid of its own"):
            srv.spawn({"sandbox": {"uid": None}, "env": {}, "cwd": str(base), "device": "cpu", "workdir": str(base)},
                      {"stdout": out_w, "channel": a, "quiesce": b}, open(out_r, "rb", buffering=0), 30)
    finally:
        for fd in (out_w, a, b):
            os.close(fd)
    assert not srv.lost  # the server goes on serving proper requests
    ex = sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=True, server=srv)
    try:
        assert recv(ex.conn, time.monotonic() + 60, ex.arena).value.uid != 0
    finally:
        sandbox.retire(ex)


def test_executors_start_their_own_interpreters_once_the_server_is_gone():
    base = reachable_tmpdir("fibray-forkserver-gone-")
    srv = sandbox.fork_server("cpu", base, sandbox.SandboxPolicy())
    forked = sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=True, server=srv)
    recv(forked.conn, time.monotonic() + 120, forked.arena)
    os.kill(srv.pid, signal.SIGKILL)
    srv.proc.wait()
    deadline = time.monotonic() + 10
    while not srv.lost:
        assert time.monotonic() < deadline, "the server's end went unnoticed"
        time.sleep(0.05)
    # what the server forked ends with it (it watches its parent) and is collected here, a subreaper
    assert forked.proc.wait(timeout=20) is not None and not forked.alive()
    ex = sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=True, server=srv)
    try:
        assert isinstance(ex.proc, subprocess.Popen)
        assert recv(ex.conn, time.monotonic() + 120, ex.arena).value.uid != 0
    finally:
        sandbox.retire(ex)
        sandbox.retire(forked)
        srv.close()


def test_a_slot_whose_forked_executor_failed_to_start_starts_interpreters():
    spec = SlotSpec("forkfail", workdir=str(reachable_tmpdir("fibray-forkfail-")), standby=0, spare_isolated=0)
    start = SlotStart.begin(spec, "cpu")
    try:
        start.wait_first()
        assert isinstance(start.persistent[0].proc, ForkedProcess)
        start.fork_failed("a test says so")
        ex = start.spawn(single_use=True)
        assert isinstance(ex.proc, subprocess.Popen)
        sandbox.retire(ex)
    finally:
        for ex in start.persistent:
            sandbox.retire(ex)
        start.close()


def test_a_candidate_holding_a_servers_socket_would_be_judged_wrong_and_is_not():
    """offender_steals_spawns zeroes its output when it holds any fork server socket (it would take
    other executors' spawn requests and channels); forked executors hold none, so it passes."""
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], workload_set="cpu_small",
                      solution_roots=[REPO / "tests" / "candidates"], solutions=["offender_steals_spawns"])
    sol = ds.solutions["offender_steals_spawns"]
    slot = GpuSlot(SlotSpec("steal", workdir=str(reachable_tmpdir("fibray-steal-")), standby=1, spare_isolated=0))
    try:
        assert slot.start.server is not None
        for i, w in enumerate(ds.workloads["rmsnorm_h4096"][:2]):
            job = Job(job_id=f"s{i}", sweep="t", definition=ds.definitions["rmsnorm_h4096"], workload=w, solution=sol,
                      settings=EvalSettings(warmup=1, iterations=2, trials=1), dataset_root=str(ds.root))
            result = slot.evaluate(job, "persistent", now_iso())
            assert result.evaluation.status.value == "PASSED", result.evaluation.log
        assert all(isinstance(ex.proc, ForkedProcess) for ex in slot._executors())
    finally:
        slot.shutdown()
