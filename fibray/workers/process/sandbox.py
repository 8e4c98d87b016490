"""Start candidate executor processes with least privilege, and put them down completely.

An executor gets a scrubbed environment (an allowlist, minus anything that looks like a
secret), a private working directory, resource limits, its own session (process group),
no network where the OS allows it (a new network namespace), and a uid of its own (leased
from runner.uid_range). Privilege separation fails closed: asked for and impossible, no
executor starts. Killing one kills its whole process group and every process it left behind.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Iterable, Optional

import fibray
from fibray import deadlines
from fibray.workers.process import executor
from fibray.workers.process.arena import ARENA_BYTES, Arena
from fibray.workers.process.cgroup import CGROUP_REFUSED, ExecutorCgroup, memory_hierarchy
from fibray.workers.process.forkserver import ForkServer, ForkServerGone
from fibray.workers.process.launch import (NETNS_REFUSED, PIDNS_REFUSED, SCRATCH_REFUSED, launcher_argv, sandbox_argv,
                                           sandbox_spec, scratch_covers)
from fibray.schema.reasons import Reason
from fibray.workers.process.uids import DEFAULT_UID_RANGE, UidLease, UidPool, process_uids

_ENV_ALLOW = {
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "TRITON_INTERPRET",
    "TRITON_PTXAS_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VIRTUAL_ENV", "CONDA_PREFIX",
    "TORCH_CUDA_ARCH_LIST", "FIBRAY_CUDA_ARCH", "CC", "CXX", "NVCC",
}
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE|AUTH|COOKIE|SESSION", re.I)
_LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class SandboxPolicy:
    """Limits for executor processes."""

    max_open_files: int = 4096
    max_processes: int = 4096
    memory_limit_bytes: Optional[int] = 16 << 30  # a memory cgroup's bound (without one: RLIMIT_AS on CPU)
    cpu_seconds: Optional[int] = None              # CPU time, for single-use executors
    isolate_network: bool = True
    pid_namespace: bool = True                      # own PID namespace and /proc where the OS allows it
    drop_privileges: bool = True
    uid_range: Optional[tuple[int, int]] = None     # executors' uids, inclusive; None: DEFAULT_UID_RANGE
    build_cache: Optional[str] = None               # compiled-artifact cache written by fibray, read-only to executors
    arena_bytes: int = ARENA_BYTES                  # shared memory for replies' tensors (0: the socket carries them)
    executor_checks: bool = False                   # a GPU without CUDA VMM stages job memory through the host
    fork_server: bool = True                        # fork executors from a warm server (forkserver.py), not exec each
    scratch_bytes: Optional[int] = 1 << 30          # all an executor may write: a tmpfs this big (None: anywhere its uid may)


def scrubbed_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment an executor starts with: allowlisted names, nothing secret-looking."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_ALLOW and not _SECRET.search(k)}
    pkg_root = str(Path(fibray.__file__).resolve().parents[1])
    paths = [pkg_root] + [p for p in sys.path if p and p.endswith(("site-packages", "dist-packages")) or p.startswith("/tmp/site")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra)
    return env


class PrivilegeError(RuntimeError):
    """Privilege separation was asked for (runner.drop_privileges) and cannot be put in force."""


def not_traversable(path: str) -> Optional[Path]:
    """The first directory on the way to `path` (resolved) that other users cannot enter, or the
    path itself if they cannot use it; None when an unprivileged user reaches it."""
    p = Path(path).resolve()
    for part in [*reversed(p.parents), p]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return part
        if not mode & stat.S_IXOTH:
            return part
    return None


def world_executable(path: str) -> bool:
    return not_traversable(path) is None


def privilege_problem(policy: SandboxPolicy, base_dir: Optional[str] = None) -> Optional[str]:
    """Why executors cannot run as uids of their own under this policy (None: they can, or it
    was not asked for). One sentence saying what is wrong and how to fix it."""
    if not policy.drop_privileges:
        return None
    off = "or run candidates with fibray's own privileges, explicitly, with runner.drop_privileges=false"
    if os.geteuid() != 0:
        return (f"privilege separation (runner.drop_privileges=true) cannot be put in force: fibray runs as uid "
                f"{os.geteuid()}, not root, so it cannot give each executor a uid of its own; run the sweep as root "
                f"(executors then take uids from runner.uid_range), {off}")
    needed = [("the Python interpreter", sys.executable), ("fibray's package", str(Path(fibray.__file__).parent))]
    if base_dir is not None:
        needed.append(("the executors' directory (runner.workdir)", base_dir))
    for what, path in needed:
        blocked = not_traversable(path)
        if blocked is not None:
            return (f"privilege separation (runner.drop_privileges=true) cannot be put in force: {what} {path} is "
                    f"not reachable by an unprivileged uid ({blocked} lacks other-execute permission); fix: "
                    f"chmod o+x {blocked} and every directory above it (traverse only, as .ci/run does), {off}")
    if policy.scratch_bytes:
        why = "no PID and mount namespace of their own" if not policy.pid_namespace else scratch_problem()
        below = scratch_covers(base_dir) if base_dir else None
        if below is not None:
            why = f"runner.workdir {base_dir} is below {below}, which each executor's scratch covers (choose another)"
        if why is not None:
            return (f"executors' writes cannot be confined to a scratch of runner.scratch_gb: {why}; fix that, or let "
                    f"candidates write wherever their uid may (one that fills the disk could then stop the sweep) "
                    f"with runner.scratch_gb=null, {off}")
    if policy.memory_limit_bytes and memory_hierarchy() is None:
        return (f"executors' host memory cannot be bounded to runner.memory_limit_gb: no memory cgroup can be made "
                f"here (no cgroup hierarchy with the memory controller is writable by fibray: a read-only "
                f"/sys/fs/cgroup, or the controller not delegated to fibray's cgroup); fix that, or run without the "
                f"bound (a candidate could then take the host's memory; on a CPU each process keeps no address-space "
                f"limit either) with runner.memory_limit_gb=null, {off}")
    return None


def writable_by_others(root: str) -> Optional[str]:
    """Why a uid other than ours could change what is under `root` (None: it cannot): root must be
    ours and writable by no one else; above it, no directory may let others rename entries."""
    p = Path(root).resolve()
    for part in [p, *p.parents]:
        try:
            st = part.stat()
        except OSError:
            continue  # not created yet: it will be ours
        mode = stat.S_IMODE(st.st_mode)
        if part == p and (st.st_uid != os.geteuid() or mode & 0o022):
            return (f"the store root {p} is owned by uid {st.st_uid} with mode {mode:o}; it must be owned by the "
                    f"driver's uid {os.geteuid()} and writable by no one else (fix: chown {os.geteuid()} {p}; chmod go-w {p})")
        if part != p and mode & 0o002 and not mode & stat.S_ISVTX:
            return f"{part}, above the store root {p}, is writable by every user (fix: chmod o-w {part}, or +t)"
    return None


def preflight(pol: SandboxPolicy, store_root: str, workdir: Optional[str]) -> Optional[str]:
    """Why a sweep with this sandbox policy must not start (None: it may): privilege separation
    asked for and impossible here, or a store an executor could write into."""
    problem = privilege_problem(pol, workdir or tempfile.gettempdir())
    if problem is None and pol.drop_privileges:
        problem = writable_by_others(store_root)
    return problem


_POOLS: dict[tuple[int, int], UidPool] = {}


def uid_pool(policy: SandboxPolicy) -> UidPool:
    """This process's lease book for the policy's uid range (leases are host-wide flocks)."""
    first, last = policy.uid_range or DEFAULT_UID_RANGE
    key = (int(first), int(last))
    if key not in _POOLS:
        _POOLS[key] = UidPool(*key)
    return _POOLS[key]


def network_namespaces_available() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux")


_PIDNS: list[bool] = []


def _launcher_probe(code: str, cwd: Optional[str] = None, **spec) -> Optional[str]:
    """Run `python -c code` under the launcher with sandbox `spec` (as root, no limits to speak of);
    None when it succeeded, else why not (the launcher's last line of complaint)."""
    argv = sandbox_argv(max_open_files=256, max_processes=256, memory_limit_bytes=None, cpu_seconds=None,
                        netns=False, uid=None, **spec)
    try:
        r = subprocess.run([*argv, sys.executable, "-c", code], cwd=cwd, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the probe failed: {e}"
    lines = (r.stderr or "").strip().splitlines()
    return None if r.returncode == 0 else (lines[-1] if lines else f"exit status {r.returncode}")


def pid_namespaces_available() -> bool:
    """Whether the launcher can put an executor in a PID namespace with its own /proc here (tried
    once per process: containers often refuse it)."""
    if not _PIDNS:
        ok = os.geteuid() == 0 and sys.platform.startswith("linux")
        _PIDNS.append(ok and _launcher_probe("import os; assert os.getpid() == 1", pidns=True) is None)
    return _PIDNS[0]


_SCRATCH: list[Optional[str]] = []


def scratch_problem() -> Optional[str]:
    """Why the launcher cannot confine an executor's writes to a scratch here (None: it can); tried
    once per process, as root, in a PID and mount namespace like an executor's."""
    if not _SCRATCH:
        why = None if pid_namespaces_available() else "this host refuses PID and mount namespaces"
        if why is None:
            with tempfile.TemporaryDirectory(prefix="fibray-scratch-probe-") as home:
                # into the scratch, at the path it was given: nothing may reach the host's folder
                why = _launcher_probe("open('mark', 'w').close()", cwd=home, pidns=True, scratch_bytes=1 << 20, workdir=home)
                if why is None and os.listdir(home):
                    why = "the probe's writes reached the host"
        _SCRATCH.append(why)
    return _SCRATCH[0]


@dataclass
class Executor:
    """A running executor process and its end of the control channel."""

    proc: subprocess.Popen
    conn: Connection
    workdir: Path
    single_use: bool
    network_isolated: bool
    privileges_dropped: bool
    pid_namespace: bool = False
    """The executor is pid 1 of a namespace of its own; `proc` is the launcher that relays for it."""
    uid: Optional[UidLease] = None
    """The uid this executor alone runs as (released when it is retired)."""
    cgroup: Optional[ExecutorCgroup] = None
    """The cgroups it and everything it starts are in: CPU time counted (CPU slots), host memory bounded
    (policy.memory_limit_bytes); removed when it is retired."""
    solution: Optional[str] = None
    """Hash of the one solution this executor serves (set by its first job); it is retired before another."""
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    info: dict = field(default_factory=dict)
    arena: Optional[Arena] = None
    """Shared memory the executor writes its replies' tensors into."""
    region: Optional[Any] = None
    """The job region it keeps mapped from job to job (fibray.evaluate.memory.KeptRegion); closed when it is retired."""
    drainer: Optional[threading.Thread] = None
    quiesce: Optional[socket.socket] = None
    """The supervisor's end of the executor's side channel: a byte asks it to synchronise its device and ack."""
    _tail: deque = field(default_factory=lambda: deque(maxlen=256))
    _tail_bytes: list = field(default_factory=lambda: [0])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output_tail(self) -> str:
        """The last bytes the candidate printed (stdout and stderr), bounded."""
        return b"".join(self._tail).decode(errors="replace")[-_LOG_TAIL_BYTES:]

    def alive(self) -> bool:
        """Not ended, and not ending: the kernel's word (ending), not only whoever collects its exit
        status (a fork server reports it some time after)."""
        return self.proc.poll() is None and not ending(self.pid)

    def executor_pid(self) -> int:
        """The executor's own pid on the host (below the relay in a PID namespace)."""
        kids = _children(self.pid) if self.pid_namespace else []
        return kids[0] if kids else self.pid

    def started_processes(self) -> list[int]:
        """Live processes below the executor (its candidates' children and orphans), not itself."""
        tops = _children(self.pid) if self.pid_namespace else [self.pid]
        return [p for top in tops for p in live_descendants(top)]

    def processes(self) -> list[int]:
        """The executor's own processes, relay and executor included (host pids)."""
        return [self.pid, *descendants(self.pid)]

    def exit_reason(self) -> tuple[Optional[Reason], str]:
        """(reason, detail) once the process has ended; (None, "") while it runs."""
        code = self.proc.poll()
        if code is None:
            return None, ""
        if code == -signal.SIGKILL and self.cgroup is not None and self.cgroup.oom_kills():
            return Reason.OUT_OF_MEMORY, f"{over_memory_bound(self.cgroup)}; the kernel ended the executor"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return Reason.KILLED_BY_SIGNAL, f"executor killed by {name}"
        if code == NETNS_REFUSED:
            return Reason.SANDBOX_FAILED, "network namespace could not be created"
        if code == PIDNS_REFUSED and self.pid_namespace:
            return Reason.SANDBOX_FAILED, "PID namespace could not be created"
        if code == SCRATCH_REFUSED:
            return Reason.SANDBOX_FAILED, "the executor's writes could not be confined to its scratch"
        if code == CGROUP_REFUSED and self.cgroup is not None:
            return Reason.SANDBOX_FAILED, f"the executor could not join its cgroups {self.cgroup.procs_files}"
        return Reason.CRASHED, f"executor exited with status {code}"


def over_memory_bound(cgroup: ExecutorCgroup) -> str:
    """What an OOM kill in an executor's memory cgroup means, for its verdict's log."""
    return (f"the executor and the processes it started went over their host memory bound of "
            f"{cgroup.memory_limit / (1 << 30):g} GiB (runner.memory_limit_gb)")


def _drain(ex: Executor) -> None:
    """Read the executor's output forever, keeping a bounded tail (no pipe ever fills up)."""
    fd = ex.proc.stdout
    while True:
        chunk = fd.read1(65536) if hasattr(fd, "read1") else fd.read(65536)
        if not chunk:
            return
        ex._tail.append(chunk)


def _executor_env(device: str, home: Path, policy: SandboxPolicy) -> dict[str, str]:
    """The environment of an executor (or of the fork server it comes from) living in `home`:
    every cache it writes is its own; the shared build cache is written by fibray only."""
    env = scrubbed_env({
        "HOME": str(home), "TMPDIR": str(home), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
        "TRITON_CACHE_DIR": str(home / ".triton"), "TRITON_HOME": str(home), "FIBRAY_EXECUTOR": "1",
    })
    env.pop("FIBRAY_BUILD_CACHE", None)
    if policy.build_cache:
        env["FIBRAY_BUILD_CACHE"] = policy.build_cache
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def fork_server(device: str, base_dir: Path, policy: SandboxPolicy) -> Optional[ForkServer]:
    """A warm fork server for this slot's executors on `device` (None when the policy asks for none).
    It warms up on its own; spawn() waits for it only when it needs it."""
    if not policy.fork_server:
        return None
    home = Path(tempfile.mkdtemp(prefix="forkserver-", dir=base_dir))
    os.chmod(home, 0o755)
    env = {**_executor_env(device, home, policy), "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # no CUDA before a fork
           **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}  # no idle pools to fork
    return ForkServer(device, env, home, require_uid=policy.drop_privileges)


_FALLBACK_SAID: list[bool] = []
"""Non-empty once a spawn said that the fork server could not start executors (said once a process)."""
_UNBOUNDED_SAID: set[str] = set()
"""The devices whose executors' host memory a spawn said it could not bound (said once a process)."""


def _say_memory_unbounded(device: str) -> None:
    if device in _UNBOUNDED_SAID:
        return
    _UNBOUNDED_SAID.add(device)
    what = ("is bounded per process only (RLIMIT_AS), not for the processes they start together" if device == "cpu"
            else "is not bounded (RLIMIT_AS cannot be set under CUDA)")
    print(f"fibray: no memory cgroup can be made (fibray runs unprivileged, or the memory controller is not "
          f"delegated to its cgroup): the host memory of {device} executors {what}", file=sys.stderr)


def spawn(device: str, base_dir: Path, policy: SandboxPolicy, single_use: bool,
          server: Optional[ForkServer] = None) -> Executor:
    """Start an executor; it warms up (device context, and imports unless `server` forks it warm)
    on its own and says when ready. Raises PrivilegeError when privileges are to be dropped and cannot be."""
    problem = privilege_problem(policy, str(base_dir))
    if problem is not None:
        raise PrivilegeError(problem)
    lease = uid_pool(policy).lease() if policy.drop_privileges else None
    ours, theirs = socket.socketpair()
    side_ours, side_theirs = socket.socketpair()  # the quiesce side channel (fibray.workers.quiesce)
    workdir = Path(tempfile.mkdtemp(prefix="exec-", dir=base_dir))
    uid = lease.uid if lease is not None else None
    netns = policy.isolate_network and network_namespaces_available()
    pidns = policy.pid_namespace and pid_namespaces_available()
    scratch = policy.scratch_bytes if policy.drop_privileges else None  # privilege_problem said pidns is there
    if uid is not None:
        os.chown(workdir, uid, uid)  # mode 0700 (mkdtemp): no other executor may look in
    env = _executor_env(device, workdir, policy)
    arena = Arena.create(policy.arena_bytes) if policy.arena_bytes else None
    # CPU time: what a CPU slot's timing bound reads; memory: what RLIMIT_AS cannot bound (forks, CUDA)
    cgroup = ExecutorCgroup.create(cpu=device == "cpu", memory_bytes=policy.memory_limit_bytes)
    bounded = cgroup is not None and cgroup.bounds_memory
    if policy.memory_limit_bytes and not bounded:
        _say_memory_unbounded(device)
    # the cgroup bounds the memory all of its processes use; without it, a CPU executor's address space
    # is bounded, process by process (never under CUDA, which reserves far more than it uses)
    address_space = policy.memory_limit_bytes if device == "cpu" and not bounded else None
    spec = sandbox_spec(max_open_files=policy.max_open_files, max_processes=policy.max_processes,
                        memory_limit_bytes=address_space, cpu_seconds=policy.cpu_seconds,
                        netns=netns, uid=uid, pidns=pidns, cgroup=cgroup.procs_files if cgroup is not None else None,
                        scratch_bytes=scratch, workdir=str(workdir))
    try:
        proc = _forked(server, spec, env, workdir, device, theirs, side_theirs, arena) if server is not None else None
        if proc is None:
            argv = [*launcher_argv(spec), sys.executable, "-m", "fibray.workers.process.executor",
                    *executor.arguments(channel_fd=theirs.fileno(), device=device, workdir=str(workdir),
                                   quiesce_fd=side_theirs.fileno(), arena_fd=arena.fd if arena else None,
                                   arena_bytes=arena.size if arena else 0)]
            proc = subprocess.Popen(
                argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(), side_theirs.fileno(), *([arena.fd] if arena else [])), start_new_session=True,
            )  # no preexec_fn: the launcher applies the sandbox after exec (see fibray.workers.process.launch)
    except BaseException:
        if arena is not None:
            arena.close()
        if lease is not None:
            lease.release()
        if cgroup is not None:
            cgroup.remove(0)
        raise
    finally:
        theirs.close()
        side_theirs.close()
    ex = Executor(proc=proc, conn=Connection(ours.detach()), workdir=workdir, single_use=single_use,
                  network_isolated=netns, privileges_dropped=uid is not None, pid_namespace=pidns, uid=lease,
                  cgroup=cgroup, arena=arena, quiesce=side_ours)
    ex.drainer = threading.Thread(target=_drain, args=(ex,), daemon=True)
    ex.drainer.start()
    return ex


def _forked(server: ForkServer, spec: dict, env: dict, workdir: Path, device: str, channel: socket.socket,
            side: socket.socket, arena: Optional[Arena]):
    """The executor forked by `server` (a ForkedProcess), or None when the server cannot (said once)."""
    out_r, out_w = os.pipe()
    fds = {"stdout": out_w, "channel": channel.fileno(), "quiesce": side.fileno(), **({"arena": arena.fd} if arena else {})}
    request = {"sandbox": spec, "env": env, "cwd": str(workdir), "device": device, "workdir": str(workdir),
               "arena_bytes": arena.size if arena else 0}
    stdout = open(out_r, "rb", buffering=0)
    try:
        return server.spawn(request, fds, stdout, deadlines.EXECUTOR_READY_S)
    except ForkServerGone as e:
        stdout.close()
        if not _FALLBACK_SAID:
            print(f"fibray: the fork server cannot start executors ({e}); each starts its own interpreter", file=sys.stderr)
            _FALLBACK_SAID.append(True)
        return None
    finally:
        os.close(out_w)


def _children(pid: int) -> list[int]:
    """Direct children of pid, from /proc/<pid>/task/*/children (a child belongs to the thread that forked it)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


_HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def children(pid: int) -> list[int]:
    """Direct children of pid: from the kernel's per-thread lists where it keeps them, else by every
    process's parent. (A stray reap needs no more: descendants() reads the list of every thread of every
    executor below, some 300 files a job on a GPU slot.)"""
    if _HAS_CHILDREN_FILES:
        return _children(pid)
    return _parents().get(pid, [])


def _parents() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from every process's /proc/<pid>/stat."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid, _ = _stat(int(entry))
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below pid (via /proc), children first. Walks the tree from pid where
    the kernel lists children per thread; otherwise scans every process's parent."""
    if _HAS_CHILDREN_FILES:
        out, todo = [], [pid]
        while todo:
            for child in _children(todo.pop()):
                out.append(child)
                todo.append(child)
        return out
    below = _parents()
    out, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def live_descendants(pid: int) -> list[int]:
    """descendants(pid) that have not exited (an exited one waits as a zombie for its parent to collect it)."""
    out = []
    for p in descendants(pid):
        try:
            if _stat(p)[1] != "Z":
                out.append(p)
        except (OSError, ValueError, IndexError):
            continue
    return out


def kill_tree(pid: int, pgid: Optional[int] = None) -> list[int]:
    """SIGKILL a process group and every descendant of pid; never raises. Returns the descendants."""
    victims = descendants(pid)
    for target in filter(None, [pgid]):
        try:
            os.killpg(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in [pid, *victims]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return victims


def uid_of(pid: int) -> Optional[int]:
    """The real uid of a live process (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def stat_fields(pid: int) -> list[bytes]:
    """/proc/<pid>/stat's fields after the command name: state, ppid, ... (proc(5)'s field 3 is [0])."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2:].split()


def ending(pid: int) -> bool:
    """Whether a process has ended (gone, or a zombie) or is ending: a SIGKILL is pending for it, which
    kill(2) queues before it returns, and on which the process ends the next time it runs."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return True
    fields = dict(line.split(b":", 1) for line in lines if b":" in line)
    if fields.get(b"State", b"").strip()[:1] in (b"Z", b"X"):
        return True
    kill = 1 << (signal.SIGKILL - 1)
    try:
        return any(int(fields.get(key, b"0").strip(), 16) & kill for key in (b"ShdPnd", b"SigPnd"))
    except ValueError:
        return False


def _stat(pid: int) -> tuple[int, str]:
    """(parent pid, state letter) of a process."""
    fields = stat_fields(pid)
    return int(fields[1]), fields[0].decode()


def reap_strays(keep: set[int], candidates_run_as_others: bool = False, spare_uids: frozenset[int] = frozenset()) -> list[int]:
    """Kill every live child of this process that is not a known executor (orphans that
    re-parented to us); collect exited ones (zombies) without counting them.

    `candidates_run_as_others`: every executor runs as a uid other than ours (privileges
    dropped), so a child whose real uid is ours cannot descend from a candidate and is spared
    (a process that hosts a slot may have children of its own: a local Ray's raylet, for one).
    Otherwise every child but `keep` is a stray. A child running as one of `spare_uids` (an executor
    being retired: its uid's release kills it) is spared too."""
    me, killed = os.getpid(), []
    ours = os.getuid()
    for child in children(me):  # a stray re-parents to this process: its own subtree goes with it (kill_tree)
        try:
            ppid, state = _stat(child)
            uids = process_uids(child)[1] if candidates_run_as_others or spare_uids else ()
            spared = (candidates_run_as_others and uids[0] == ours) or any(u in spare_uids for u in uids)
        except (OSError, ValueError, IndexError):
            continue
        if ppid != me or child in keep or spared:
            continue
        if state != "Z":
            kill_tree(child, child)
            killed.append(child)
        try:
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pass
    return killed


def kill_executor(ex: Executor) -> list[int]:
    """SIGKILL an executor's process group and tree, unless it has been reaped already: its pid
    and group id could then belong to a process started since (what it left behind re-parented
    to this process, where the stray reap finds it). Returns the descendants it killed."""
    return kill_tree(ex.pid, ex.pid) if ex.proc.returncode is None else []


def wait_exited(pids: Iterable[int], deadline: float, poll_s: float = 0.01) -> None:
    """Until each of `pids` has exited (a zombie, or gone), or the monotonic `deadline` has passed."""
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if _stat(pid)[1] in ("Z", "X"):
                    break
            except (OSError, ValueError, IndexError):
                break
            time.sleep(poll_s)


def retire(ex: Executor, wait_s: float = deadlines.RETIRE_EXIT_S, tree: Optional[list[int]] = None) -> None:
    """Put an executor down with its whole tree, close its channel, remove its directory. `tree`: its
    descendants, where the caller took them (and killed them) already."""
    killed = kill_executor(ex)
    tree = killed if tree is None else tree
    try:
        ex.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    # with a PID namespace the executor is the launcher's child: once the launcher is gone it
    # re-parents to us, and must be dead (and collected) before a stray reap could take it for a stray
    wait_exited(tree, time.monotonic() + wait_s)
    for pid in tree:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if ex.drainer is not None:
        ex.drainer.join(deadlines.OUTPUT_DRAIN_S)  # its last output is in the tail before anyone reads why it ended
    ex.conn.close()
    if ex.quiesce is not None:
        ex.quiesce.close()
    if ex.arena is not None:
        ex.arena.close()
        ex.arena = None
    if ex.region is not None:  # the executor is gone: this side's mapping is the last
        ex.region.close()
        ex.region = None
    if ex.cgroup is not None:  # whatever it started still runs in its cgroup, wherever it re-parented
        ex.cgroup.kill_all()
        ex.cgroup.remove()
    if ex.uid is not None:
        ex.uid.release()  # whatever still runs as its uid (escaped its tree) dies here
    import shutil

    shutil.rmtree(ex.workdir, ignore_errors=True)
