"""An executor's sandbox, read off the running process: its uid, limits, network namespace, and
that it is the very process the supervisor started (the launcher execs it, same pid)."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fibray.workers.process import sandbox
from fibray.workers.process.launch import sandbox_argv
from fibray.workers.process.channel import recv
from fibray.workers.process.uids import DEFAULT_UID_RANGE, UidPool, UidSignaller, uids_running
from _sweep_helpers import assert_memory_bound, reachable_tmpdir

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes


def _limits(pid: int) -> dict[str, str]:
    out = {}
    for line in open(f"/proc/{pid}/limits").read().splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        out[name] = soft
    return out


def test_an_executor_runs_in_its_sandbox_as_the_process_that_was_started():
    base = reachable_tmpdir("fibray-sandbox-")
    policy = sandbox.SandboxPolicy(max_open_files=512, max_processes=300, memory_limit_bytes=8 << 30, cpu_seconds=900)
    ex = sandbox.spawn("cpu", base, policy, single_use=True)
    try:
        hello = recv(ex.conn, time.monotonic() + 120, ex.arena)
        with open(f"/proc/{ex.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # our child, for the stray reaper
        if ex.pid_namespace:  # pid 1 of its own namespace, below the launcher that relays for it
            (pid,) = sandbox._children(ex.pid)
            assert hello.value.pid == 1
            assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        else:
            pid = ex.pid
            assert hello.value.pid == ex.pid  # exec'd in place: the pid the supervisor watches and kills
        limits = _limits(pid)
        assert limits["Max open files"] == "512" and limits["Max processes"] == "300"
        assert limits["Max core file size"] == "0" and limits["Max cpu time"] == "900"
        assert_memory_bound(ex, limits, 8 << 30)
        first, last = DEFAULT_UID_RANGE
        assert first <= hello.value.uid <= last and ex.privileges_dropped and ex.uid.uid == hello.value.uid
        if sandbox.network_namespaces_available():
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net") and ex.network_isolated
        assert ex.pid_namespace == sandbox.pid_namespaces_available()
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
ex = sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=False)
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


def test_each_executor_runs_as_a_uid_of_its_own():
    base = reachable_tmpdir("fibray-uids-")
    executors = [sandbox.spawn("cpu", base, sandbox.SandboxPolicy(), single_use=True) for _ in range(3)]
    try:
        uids = [recv(ex.conn, time.monotonic() + 120, ex.arena).value.uid for ex in executors]
        assert len(set(uids)) == 3 and 0 not in uids
        for ex, uid in zip(executors, uids):
            st = os.stat(ex.workdir)
            assert st.st_uid == uid and st.st_mode & 0o077 == 0  # its directory: no other executor looks in
            assert set(ex.processes()[1 if ex.pid_namespace else 0:]) <= set(uids_running(uid))
    finally:
        for ex in executors:
            sandbox.retire(ex)
    assert not any(uids_running(uid) for uid in uids)


def test_a_released_uid_has_nothing_left_running_as_it():
    pool = UidPool(*DEFAULT_UID_RANGE)
    lease = pool.lease()
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=lease.uid)
    # a process of that uid that left its executor's tree (double fork, a session of its own) still dies with the lease
    escape = "import os, time\nif os.fork():\n    os._exit(0)\nos.setsid()\ntime.sleep(60)"
    launcher = subprocess.Popen([*argv, sys.executable, "-c", escape], start_new_session=True)
    assert launcher.wait(timeout=30) == 0
    deadline = time.monotonic() + 30
    while not uids_running(lease.uid):
        assert time.monotonic() < deadline, "the escaped process never ran"
        time.sleep(0.05)
    escaped = uids_running(lease.uid)
    assert launcher.pid not in escaped  # it is not below anything fibray started any more
    lease.release()
    deadline = time.monotonic() + 10
    while set(escaped) & set(uids_running(lease.uid)):
        assert time.monotonic() < deadline, "the escaped process outlived its uid's lease"
        time.sleep(0.05)


def test_processes_of_a_uid_cannot_kill_what_stops_them():
    """Timed windows stop a neighbour executor as a whole uid, by a sender that holds that uid; the
    neighbour's processes, killing the sender and everything else of their uid without end, must not
    reach it (it holds the uid as effective only): it is never killed and no signal fails."""
    pool = UidPool(*DEFAULT_UID_RANGE)
    target = pool.lease()
    signaller = UidSignaller(pool.lease())
    signaller.send([target.uid], signal.SIGCONT)
    sender = signaller.pid
    spin = ("import os, signal, sys\nwhile True:\n    try:\n        os.kill(int(sys.argv[1]), signal.SIGKILL)\n"
            "    except OSError:\n        pass")
    attackers = [subprocess.Popen([sys.executable, "-c", spin, str(who)], user=target.uid, group=target.uid,
                                  extra_groups=[]) for who in (sender, sender)]
    try:
        deadline = time.monotonic() + 30
        while len(uids_running(target.uid)) < len(attackers):
            assert time.monotonic() < deadline, "the attackers never ran as their uid"
            time.sleep(0.01)
        failed = 0
        for i in range(1500):
            try:  # mostly SIGCONT, so that the attackers run between the sends
                signaller.send([target.uid], signal.SIGSTOP if i % 10 == 0 else signal.SIGCONT)
            except OSError:
                failed += 1
        assert all(a.poll() is None for a in attackers)  # they ran (and were stopped and continued) throughout
        survived = signaller.pid == sender  # never killed and started again
    finally:
        for a in attackers:
            a.kill()
            a.wait()
        signaller.close()
        target.release()
    assert failed == 0 and survived


def test_privilege_separation_refuses_an_interpreter_other_users_cannot_reach(tmp_path, monkeypatch):
    hidden = tmp_path / "hidden"
    (hidden / "bin").mkdir(parents=True)
    (hidden / "bin" / "python").touch()
    os.chmod(hidden, 0o700)  # what /root looks like with pyenv under it
    monkeypatch.setattr(sys, "executable", str(hidden / "bin" / "python"))
    why = sandbox.privilege_problem(sandbox.SandboxPolicy(), str(reachable_tmpdir("fibray-refuse-")))
    assert why is not None and str(hidden) in why and "chmod o+x" in why and "runner.drop_privileges=false" in why
    try:
        sandbox.spawn("cpu", reachable_tmpdir("fibray-refuse-"), sandbox.SandboxPolicy(), single_use=True)
    except sandbox.PrivilegeError as e:
        assert str(e) == why
    else:
        raise AssertionError("an executor started as root although privileges were to be dropped")
    assert sandbox.privilege_problem(sandbox.SandboxPolicy(drop_privileges=False), None) is None


def test_privilege_separation_refuses_when_fibray_is_not_root():
    code = ("from fibray.workers.process import sandbox; "
            "print(sandbox.privilege_problem(sandbox.SandboxPolicy(), '/tmp'))")
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=65534)
    out = subprocess.run([*argv, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "not root" in out.stdout and "runner.drop_privileges=false" in out.stdout


def test_a_store_writable_by_others_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    os.chmod(tmp_path, 0o755)
    assert sandbox.writable_by_others(str(store)) is None
    os.chmod(store, 0o777)
    assert "writable by no one else" in sandbox.writable_by_others(str(store))
    os.chmod(store, 0o755)
    os.chmod(tmp_path, 0o777)  # others could rename the store away and put their own in its place
    assert str(tmp_path) in sandbox.writable_by_others(str(store))


_LOOK_AROUND = """
import os, signal, sys
seen = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    os.kill(int(sys.argv[1]), signal.SIGKILL)
    print("killed", seen)
except OSError as e:
    print(type(e).__name__, seen)
"""


def test_an_executor_sees_and_signals_no_process_outside_its_own():
    if not sandbox.pid_namespaces_available():
        import pytest

        pytest.skip("this OS refuses PID namespaces")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                            netns=False, uid=None, pidns=True)  # even as root: a PID namespace alone
        out = subprocess.run([*argv, sys.executable, "-c", _LOOK_AROUND, str(victim.pid)], capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.split()[0] == "ProcessLookupError" and out.stdout.split(None, 1)[1].strip() == "[1]", out
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


_SYSV_SEGMENT = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
key, flags = int(sys.argv[1]), int(sys.argv[2])
shm = libc.shmget(key, 4096, flags)
print(shm, ctypes.get_errno())
"""


def test_an_executor_shares_no_sysv_ipc_with_other_processes():
    """SysV segments (and semaphores, message queues) are open to any uid that knows the key and
    outlive their maker: without an IPC namespace of its own, a candidate leaves a mark for the next."""
    if not sandbox.pid_namespaces_available():
        pytest.skip("this OS refuses PID namespaces")
    key = 0x0F1B0000 + os.getpid() % 0xFFFF
    host = subprocess.run([sys.executable, "-c", _SYSV_SEGMENT, str(key), str(0o1000 | 0o666)],  # IPC_CREAT
                          capture_output=True, text=True, timeout=60)
    shm = int(host.stdout.split()[0])
    assert shm >= 0, host
    try:
        argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                            netns=False, uid=DEFAULT_UID_RANGE[0], pidns=True)
        out = subprocess.run([*argv, sys.executable, "-c", _SYSV_SEGMENT, str(key), "0"], capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.split() == ["-1", str(errno.ENOENT)], out  # the host's segment is not there
    finally:
        ctypes.CDLL(None).shmctl(shm, 0, None)  # IPC_RMID


_FORK_BOMB = r"""
import os, signal
made = 0
while made < 10000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    made += 1
print(made, flush=True)
"""


def test_a_fork_bomb_stops_at_the_executors_process_limit_and_dies_with_it():
    if not sandbox.pid_namespaces_available():
        pytest.skip("this OS refuses PID namespaces")
    uid = DEFAULT_UID_RANGE[0] + 7
    argv = sandbox_argv(max_open_files=256, max_processes=64, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=uid, pidns=True)
    out = subprocess.run([*argv, sys.executable, "-c", _FORK_BOMB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and 0 < int(out.stdout.split()[0]) < 64, out  # the kernel refused the 64th
    time.sleep(0.5)
    assert not uids_running(uid), "the bomb's children outlived their executor"


_DIES_IN_A_WINDOW = r"""
import os, sys, pathlib, time
from fibray.workers.process import sandbox
from fibray.workers.quiesce import Quiet
policy = sandbox.SandboxPolicy(memory_limit_bytes=None, scratch_bytes=None)
ex = sandbox.spawn("cpu", pathlib.Path(sys.argv[1]), policy, single_use=True)
while ex.executor_pid() == ex.pid:  # the relay has not forked its executor yet
    time.sleep(0.05)
quiet = Quiet(policy, ack_deadline_s=0.5)
with quiet.window("timing", [ex], None):
    print(ex.pid, ex.executor_pid(), flush=True)
    os._exit(0)  # the supervisor dies while its executor is stopped
"""


def test_an_executor_stopped_for_a_window_dies_with_a_supervisor_that_dies_in_it():
    """A stopped process cannot watch its parent: were the PID namespace's relay stopped with its
    executor, both would stay stopped for ever (holding memory, and on a GPU a context) once the
    supervisor died with the window open."""
    if os.geteuid() != 0 or not sandbox.pid_namespaces_available():
        pytest.skip("needs root and PID namespaces (an executor of a uid of its own, below a relay)")
    base = reachable_tmpdir("fibray-window-")
    out = subprocess.run([sys.executable, "-c", _DIES_IN_A_WINDOW, str(base)], capture_output=True, text=True,
                         timeout=120)
    relay, executor = (int(p) for p in out.stdout.split()[:2])
    assert relay != executor, out
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in (relay, executor)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in (relay, executor) if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still there, stopped, after their supervisor died: {left}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_what_an_executor_leaves_behind_dies_with_it():
    if not sandbox.pid_namespaces_available():
        import pytest

        pytest.skip("this OS refuses PID namespaces")
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=DEFAULT_UID_RANGE[0], pidns=True)
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); "
            "time.sleep(60)'], start_new_session=True); print(p.pid, flush=True)")
    proc = subprocess.run([*argv, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 10
    while uids_running(DEFAULT_UID_RANGE[0]):  # the orphan went with its namespace's first process
        assert time.monotonic() < deadline, "an orphan outlived its executor"
        time.sleep(0.05)


def test_an_executor_in_a_pid_namespace_killed_by_sigkill_reads_so():
    """The supervisor reads an executor's end from the relay above it, which ends by the signal that
    ended the executor; for SIGKILL (the kernel's OOM killer, say), whose action cannot be set, the relay
    had raised and said status 1."""
    if not sandbox.pid_namespaces_available():
        pytest.skip("this OS refuses PID namespaces")
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=DEFAULT_UID_RANGE[0], pidns=True)
    relay = subprocess.Popen([*argv, sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout.readline().strip() == "up"
        (executor,) = sandbox._children(relay.pid)
        os.kill(executor, signal.SIGKILL)  # from outside: its namespace's init ignores its own signals
        assert relay.wait(timeout=30) == -signal.SIGKILL
    finally:
        relay.kill()
        relay.wait()


_HIDE_AND_LEAVE = """
import os, signal, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel collects the child: its CPU time comes back to no one
if os.fork() == 0:
    t = time.thread_time()
    while time.thread_time() - t < 0.2:
        pass
    os._exit(0)
time.sleep(0.5)
try:
    with open({parent!r}, "w") as f:
        f.write("0")  # leave the cgroup for the one above it
    print("left")
except OSError as e:
    print(type(e).__name__)
"""


def _hierarchies() -> list:
    from fibray.workers.process.cgroup import hierarchies

    return [pytest.param(h, id="v2" if h.v2 else "v1") for h in hierarchies()] or [
        pytest.param(None, marks=pytest.mark.skip(reason="no cgroup hierarchy counts CPU time here"))]


def test_a_memory_cgroup_may_be_made_above_fibrays_own_cgroup_deepest_first():
    """On cgroup v2 a cgroup that holds processes delegates no controller (the root excepted), so
    the memory bound of executors is probed at fibray's own cgroup and then at each one above it."""
    from fibray.workers.process.cgroup import Hierarchy, _hierarchies

    mountinfo = ["35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate",
                 "36 24 0:31 /outer /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory"]
    cgroups = ["0::/system.slice/job.scope", "4:memory:/outer/job"]
    assert _hierarchies(mountinfo, cgroups, "memory") == [
        Hierarchy(Path("/sys/fs/cgroup/system.slice/job.scope"), True),
        Hierarchy(Path("/sys/fs/cgroup/system.slice"), True),
        Hierarchy(Path("/sys/fs/cgroup"), True),
        Hierarchy(Path("/sys/fs/cgroup/memory/job"), False),  # the v1 mount shows /outer as its root
        Hierarchy(Path("/sys/fs/cgroup/memory"), False),
    ]
    assert _hierarchies(mountinfo, ["0::/"], "memory") == [Hierarchy(Path("/sys/fs/cgroup"), True)]
    assert _hierarchies(mountinfo, ["4:memory:/elsewhere"], "memory") == []  # not below the v1 mount's root


@pytest.mark.parametrize("h", _hierarchies())
def test_what_an_executor_starts_is_counted_in_a_cgroup_it_cannot_leave(h):
    from fibray.workers.process.cgroup import ExecutorCgroup

    cg = ExecutorCgroup.create(h)
    if cg is None:
        pytest.skip(f"cannot make a cgroup in {h.base} (fibray not root)")
    try:
        argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                            netns=False, uid=DEFAULT_UID_RANGE[0], pidns=False, cgroup=cg.procs_files)
        code = _HIDE_AND_LEAVE.format(parent=str(cg.h.base / "cgroup.procs"))
        out = subprocess.run([*argv, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "PermissionError", out
        assert cg.usage_s() >= 0.2  # the child's work, though nobody waited for it
    finally:
        assert cg.remove()


def test_a_cpu_executor_is_in_its_own_cgroup_until_it_is_retired():
    ex = sandbox.spawn("cpu", reachable_tmpdir("fibray-cgroup-"), sandbox.SandboxPolicy(), single_use=True)
    try:
        recv(ex.conn, time.monotonic() + 120, ex.arena)
        if ex.cgroup is None:
            from fibray.workers.process.cgroup import hierarchy

            assert hierarchy() is None  # only where none can be made
            pytest.skip("no writable cgroup hierarchy (fibray not root)")
        assert ex.cgroup.pids() == [ex.executor_pid()]  # the executor alone: not its relay
        path = ex.cgroup.path
    finally:
        sandbox.retire(ex)
    assert not path.exists()


def test_an_executor_that_cannot_join_its_cgroup_does_not_start(tmp_path):
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=None, pidns=False, cgroup=[str(tmp_path / "missing" / "cgroup.procs")])
    out = subprocess.run([*argv, sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60)
    from fibray.workers.process.cgroup import CGROUP_REFUSED

    assert out.returncode == CGROUP_REFUSED and "ran" not in out.stdout


_WRITES = r'''
import errno, os, sys
def write(path, n):
    try:
        with open(path, "wb") as f:
            for i in range(n):
                f.write(b"x" * (1 << 20))
                f.flush()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
here = os.getcwd()
import tempfile
print(here == sys.argv[1], os.environ["HOME"] == here == tempfile.gettempdir())
for place in [here, "/dev/shm", "/tmp", "/var/tmp", "/", "/etc", os.path.dirname(here), os.path.dirname(os.__file__)]:
    print(place, write(os.path.join(place, "probe"), 1))
print("big", write(os.path.join(here, "big"), 64))
try:  # its own procfs stays writable: the CUDA driver writes there (cuInit fails on a read-only /proc)
    with open("/proc/self/comm", "w") as f:
        f.write("renamed")
    print("proc", open("/proc/self/comm").read().strip())
except OSError as e:
    print("proc", errno.errorcode[e.errno])
'''


@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.pid_namespaces_available(), reason="needs root and namespaces")
def test_an_executor_writes_only_into_a_scratch_of_its_own_of_bounded_size():
    base = reachable_tmpdir("fibray-scratch-")
    workdir = base / "exec"
    lease = sandbox.uid_pool(sandbox.SandboxPolicy()).lease()
    try:
        workdir.mkdir()
        os.chown(workdir, lease.uid, lease.uid)
        argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                            netns=False, uid=lease.uid, pidns=True, scratch_bytes=16 << 20, workdir=str(workdir))
        out = subprocess.run([*argv, sys.executable, "-c", _WRITES, str(workdir)], cwd=workdir, capture_output=True,
                             text=True, timeout=120, env={"HOME": str(workdir), "TMPDIR": str(workdir), "PATH": os.environ["PATH"],
                                                          "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == "True True", out.stdout  # its directory, at the same path, is its cwd, home and TMPDIR
        got = dict(line.rsplit(" ", 1) for line in lines[1:])
        for place in (str(workdir), "/dev/shm"):
            assert got[place] == "ok", out.stdout
        for place in ("/tmp", "/var/tmp", "/", "/etc", str(base), os.path.dirname(os.__file__)):
            assert got[place] in ("EROFS", "EACCES"), out.stdout
        assert got["/tmp"] == "EROFS", out.stdout  # writable by every uid on the host, read-only here
        assert got["big"] == "ENOSPC", out.stdout  # 64 MiB into a 16 MiB scratch
        assert got["proc"] == "renamed", out.stdout
        assert os.listdir(workdir) == [] and os.listdir(base) == ["exec"]  # nothing reached the host
    finally:
        lease.release()


def test_executors_whose_memory_cannot_be_bounded_are_refused(monkeypatch):
    """Fail closed: no memory cgroup, no executor (a GPU candidate could take the host's memory), unless
    runner.memory_limit_gb=null says so explicitly."""
    if os.geteuid() != 0:
        pytest.skip("the refusal before it names root")
    from fibray.workers.process import cgroup

    monkeypatch.setattr(cgroup, "_MEMORY", [None])  # as if probed and none could be made
    base = str(reachable_tmpdir("fibray-refuse-"))
    why = sandbox.privilege_problem(sandbox.SandboxPolicy(), base)
    assert why is not None and "runner.memory_limit_gb=null" in why and "memory cgroup" in why
    with pytest.raises(sandbox.PrivilegeError, match="runner.memory_limit_gb"):
        sandbox.spawn("cuda", Path(base), sandbox.SandboxPolicy(), single_use=True)
    assert sandbox.privilege_problem(sandbox.SandboxPolicy(memory_limit_bytes=None), base) is None
    assert sandbox.privilege_problem(sandbox.SandboxPolicy(drop_privileges=False), base) is None
    from fibray.promote.sanitizer import sandbox_problem

    assert "runner.memory_limit_gb" in sandbox_problem(sandbox.SandboxPolicy())  # the promotion gates' runs too
    assert sandbox_problem(sandbox.SandboxPolicy(memory_limit_bytes=None)) is None


def test_executors_whose_writes_cannot_be_confined_are_refused(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the refusal before it names root")
    monkeypatch.setattr(sandbox, "_SCRATCH", ["mount_setattr (Linux 5.12 or later): Function not implemented"])
    why = sandbox.privilege_problem(sandbox.SandboxPolicy(), str(reachable_tmpdir("fibray-refuse-")))
    assert why is not None and "mount_setattr" in why and "runner.scratch_gb=null" in why
    with pytest.raises(sandbox.PrivilegeError, match="runner.scratch_gb"):
        sandbox.spawn("cpu", reachable_tmpdir("fibray-refuse-"), sandbox.SandboxPolicy(), single_use=True)
    assert sandbox.privilege_problem(sandbox.SandboxPolicy(scratch_bytes=None), None) is None
    monkeypatch.setattr(sandbox, "_SCRATCH", [None])
    shm = tempfile.mkdtemp(prefix="fibray-work-", dir="/dev/shm")
    try:
        os.chmod(shm, 0o755)
        why = sandbox.privilege_problem(sandbox.SandboxPolicy(), shm)
        assert why is not None and f"runner.workdir {shm} is below /dev/shm" in why
    finally:
        os.rmdir(shm)


_FORKS_PAST_MEMORY = r"""
import os, time
pids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        held = [b"\x01" * (1 << 27) for _ in range(3)]  # 384 MiB each, written: resident
        time.sleep(1.0)
        os._exit(0)
    pids.append(pid)
print([os.waitpid(pid, 0)[1] for pid in pids])
"""


def test_the_processes_an_executor_starts_stay_under_its_memory_bound_together():
    """RLIMIT_AS bounds one process (and cannot be set under CUDA at all); the memory cgroup bounds all
    of them: two children of 384 MiB each, under 512 MiB together, and the kernel ends one."""
    from fibray.workers.process.cgroup import ExecutorCgroup, memory_hierarchy

    if memory_hierarchy() is None:
        pytest.skip("no memory cgroup can be made here (fibray not root, or no memory controller)")
    cg = ExecutorCgroup.create(cpu=False, memory_bytes=512 << 20)
    assert cg is not None and cg.bounds_memory and not cg.counts_cpu
    try:
        argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                            netns=False, uid=DEFAULT_UID_RANGE[0], pidns=False, cgroup=cg.procs_files)
        out = subprocess.run([*argv, sys.executable, "-c", _FORKS_PAST_MEMORY], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out
        killed = [os.WTERMSIG(s) for s in eval(out.stdout) if os.WIFSIGNALED(s)]
        assert signal.SIGKILL in killed and cg.oom_kills() >= 1, out
    finally:
        assert cg.remove()


def test_an_executor_the_kernel_ended_for_going_over_its_memory_bound_says_so():
    """On a GPU no RLIMIT_AS stops the executor itself: the memory cgroup does, and its end is a verdict
    (out_of_memory), not a crash. Here the kernel picks the executor, whatever else its cgroup holds."""
    from fibray.schema.reasons import Reason
    from fibray.workers.process.cgroup import _bound_memory

    ex = sandbox.spawn("cpu", reachable_tmpdir("fibray-memcg-"), sandbox.SandboxPolicy(), single_use=True)
    hog = None
    try:
        recv(ex.conn, time.monotonic() + 120, ex.arena)
        if ex.cgroup is None or not ex.cgroup.bounds_memory:
            pytest.skip("no memory cgroup can be made here (fibray not root, or no memory controller)")
        assert ex.cgroup.memory_limit == 16 << 30  # runner.memory_limit_gb's default
        _bound_memory(ex.cgroup.memory_h, ex.cgroup.memory, 1 << 30)  # a small bound, for a small test
        with open(f"/proc/{ex.executor_pid()}/oom_score_adj", "w") as f:
            f.write("1000")  # the kernel's first choice in its cgroup
        hog = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                                "held = [b'1' * (1 << 27) for _ in range(12)]\ntime.sleep(30)"], stdin=subprocess.PIPE)
        with open(ex.cgroup.memory / "cgroup.procs", "w") as f:
            f.write(str(hog.pid))
        hog.stdin.write(b"go\n")
        hog.stdin.flush()
        ex.proc.wait(timeout=60)
        reason, detail = ex.exit_reason()
        assert reason == Reason.OUT_OF_MEMORY and "runner.memory_limit_gb" in detail, (reason, detail)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        sandbox.retire(ex)


def test_a_killed_process_is_ending_as_soon_as_the_kill_returns():
    """A fork server reports an executor's end some time after it: the slot asks the kernel too, so a job
    is never sent to an executor that a SIGKILL already ends (tests/test_slot.py's killed active executor)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        assert not sandbox.ending(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        assert sandbox.ending(proc.pid)  # pending, or a zombie: never running again
    finally:
        proc.kill()
        proc.wait()
    assert sandbox.ending(proc.pid)
