"""An executor's sandbox, read off the running process: its uid, limits, network namespace, and
that it is the very process the supervisor started (the launcher execs it, same pid)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fibray.workers.process import sandbox
from fibray.workers.process.launch import sandbox_argv
from fibray.workers.process.channel import recv
from _sweep_helpers import reachable_tmpdir


def _limits(pid: int) -> dict[str, str]:
    out = {}
    for line in open(f"/proc/{pid}/limits").read().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        out[name] = soft
    return out


def test_an_executor_runs_in_its_sandbox_as_the_process_that_was_started():
    base = reachable_tmpdir("fibray-sandbox-")
    policy = sandbox.SandboxPolicy(max_open_files=512, max_processes=300, memory_limit_bytes=8 << 30, cpu_seconds=900)
    ex = sandbox.spawn("cpu", base, policy, single_use=True, shared_cache=base / "cache")
    try:
        hello = recv(ex.conn, time.monotonic() + 120, ex.arena)
        assert hello.value["pid"] == ex.pid  # exec'd in place: the pid the supervisor watches and kills
        with open(f"/proc/{ex.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # our child, for the stray reaper
        limits = _limits(ex.pid)
        assert limits["Max open files"] == "512" and limits["Max processes"] == "300"
        assert limits["Max core file size"] == "0" and limits["Max cpu time"] == "900"
        assert limits["Max address space"] == str(8 << 30)
        if sandbox.can_drop_privileges():
            assert hello.value["uid"] == 65534 and ex.privileges_dropped
        if sandbox.network_namespaces_available():
            assert os.readlink(f"/proc/{ex.pid}/ns/net") != os.readlink("/proc/self/ns/net") and ex.network_isolated
    finally:
        sandbox.retire(ex)


def test_the_launcher_dies_with_a_parent_that_is_already_gone():
    # a spec naming another parent than the launcher's own is what a supervisor that died first looks like
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=None)
    argv[3] = argv[3].replace(f'"parent": {os.getpid()}', '"parent": 1')
    proc = subprocess.run([*argv, sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ran" not in proc.stdout
    ok = subprocess.run([*sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                                       netns=False, uid=None), sys.executable, "-c", "print('ran')"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "ran"


_SUPERVISOR = """
import sys, time
from pathlib import Path
from fibray.dataset import load_dataset
from fibray.schema import EvalSettings, Job
from fibray.workers.process import sandbox
from fibray.workers.process.channel import Request, recv, send
base, repo = Path(sys.argv[1]), Path(sys.argv[2])
ds = load_dataset(repo / "datasets" / "core", definitions=["rmsnorm_h4096"], workload_set="cpu_small",
                  solution_roots=[repo / "tests" / "candidates"], solutions=["offender_sleep_at_import"])
job = Job(job_id="j", sweep="t", definition=ds.definitions["rmsnorm_h4096"], workload=ds.workloads["rmsnorm_h4096"][0],
          solution=ds.solutions["offender_sleep_at_import"], settings=EvalSettings(), dataset_root=str(ds.root))
ex = sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=False, shared_cache=base / "cache")
recv(ex.conn, time.monotonic() + 120, ex.arena)
send(ex.conn, Request("build", job))  # the candidate's import sleeps: the executor is busy, not reading
print(ex.pid, flush=True)
time.sleep(600)
"""


def test_an_executor_busy_in_a_candidate_ends_soon_after_its_supervisor_is_killed():
    from _sweep_helpers import REPO

    base = reachable_tmpdir("fibray-orphaned-")
    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(base), str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(sup.stdout.readline())
        time.sleep(2.0)
        assert os.path.exists(f"/proc/{pid}")
    finally:
        sup.kill()
        sup.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the executor outlived its supervisor"
        time.sleep(0.2)
