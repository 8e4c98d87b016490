"""`python -m fibray.workers.process.launch SANDBOX -- ARGV...`: put this process in an executor's
sandbox, then become the executor (exec: same pid, same inherited channel descriptors).

The sandbox used to be applied by a `preexec_fn` between fork and exec in the supervisor. The
supervisor is threaded (Ray's and gRPC's threads, lanes, CUDA calls), and Python code in a
forked child of a threaded process can deadlock or abort on a lock another thread held; seen on
the H200 as single-use executors killed by SIGABRT before they printed anything. With no
`preexec_fn`, subprocess starts this launcher through vfork and exec alone, and everything
below runs in a fresh, single-threaded process. SANDBOX is a JSON object (see `sandbox_argv`).

With a PID namespace the launcher forks once: the child is pid 1 of a new namespace (with its
own /proc, so it sees no process outside) and becomes the executor; the launcher stays as its
relay (the pid the supervisor started, signals and waits for), ends it if the supervisor goes,
and ends the way it ended. When the executor ends, the kernel kills every process it left.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import select
import signal
import sys
import time

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWIPC = 0x08000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
_SYS_MOUNT_SETATTR, _AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
NETNS_REFUSED = 121
"""Exit status when a network namespace was asked for and refused: better no executor than a networked one."""
PIDNS_REFUSED = 122
"""Exit status when a PID namespace (and its /proc) was asked for and refused."""
SCRATCH_REFUSED = 120
"""Exit status when the executor's writes were to be confined to its scratch and could not be."""
PROC = "/proc"
"""The executor's own procfs: its mount stays writable (see `_confine_writes`)."""
WRITABLE = ("/dev/shm",)
"""Where programs expect to write besides their home and TMPDIR (both the scratch): the scratch is mounted
there too. Not /tmp: the host may keep the interpreter, its packages or fibray there, which must stay visible."""


def sandbox_spec(*, max_open_files: int, max_processes: int, memory_limit_bytes: int | None,
                 cpu_seconds: int | None, netns: bool, uid: int | None, pidns: bool = False,
                 cgroup: list[str] | None = None, scratch_bytes: int | None = None, workdir: str | None = None,
                 max_file_bytes: int | None = None) -> dict:
    """What `apply` puts in force (a JSON object); `parent` is the process that starts the launcher
    (a fork server replaces it with its own pid: it is the forked executor's parent); `cgroup`: the
    cgroup.procs files of the executor's cgroups (fibray.workers.process.cgroup: CPU time, memory);
    `scratch_bytes` (with `pidns`, whose mount namespace it needs): the executor may write only into
    a tmpfs of that size over `workdir`, also mounted on WRITABLE; every other mount is read-only;
    `max_file_bytes`: no file it writes may grow past that (RLIMIT_FSIZE)."""
    return {"nofile": max_open_files, "nproc": max_processes, "as": memory_limit_bytes, "cpu": cpu_seconds,
            "netns": netns, "uid": uid, "pidns": pidns, "cgroup": cgroup, "parent": os.getpid(),
            "scratch": scratch_bytes, "workdir": workdir, "fsize": max_file_bytes}


def launcher_argv(spec: dict) -> list[str]:
    """The launcher's arguments before `--` and the executor's argv."""
    return [sys.executable, "-m", "fibray.workers.process.launch", json.dumps(spec), "--"]


def sandbox_argv(**limits) -> list[str]:
    """launcher_argv of `sandbox_spec(**limits)`."""
    return launcher_argv(sandbox_spec(**limits))


def _relay(child: int, parent: int, alive_fd: int) -> None:
    """The launcher's life after the fork: wait for the executor, end it if the supervisor goes,
    then end as it ended (killed by a signal: the same signal), so the supervisor reads it.
    `alive_fd` stays open while the relay lives (the executor checks it once)."""
    os.closerange(3, alive_fd)  # channel and arena are the executor's alone
    os.closerange(alive_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])

    # no thread for this: after unshare(CLONE_NEWPID) the kernel refuses to start one
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            break
        if os.getppid() != parent:
            os.kill(child, signal.SIGKILL)
        time.sleep(0.05)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # its action cannot be set (and is already the default)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _enter_pid_namespace(libc, parent: int) -> int:
    """Fork into a new PID namespace; returns in the child (pid 1 there, with a /proc of its own)
    a descriptor that reads end-of-file once the relay has ended. Its IPC namespace is its own too:
    SysV shared memory, semaphores and message queues, and POSIX message queues, open to any uid
    and outliving their maker, would otherwise be a channel between candidates."""
    if libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWIPC) != 0:
        os._exit(PIDNS_REFUSED)
    relay_gone, relay_alive = os.pipe()
    child = os.fork()
    if child:
        os.close(relay_gone)
        _relay(child, parent, relay_alive)
    os.close(relay_alive)
    if (libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0
            or libc.mount(b"proc", PROC.encode(), b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0):
        os._exit(PIDNS_REFUSED)
    return relay_gone


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of the mounts this process sees: the last of any stacked on one point."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # " " is written \040
            out.pop(point, None)
            out[point] = set(fields[5].split(","))
    return list(out.items())


def scratch_covers(workdir: str) -> str | None:
    """The one of WRITABLE (where a link leads) that `workdir` lies below: the scratch mounted there would hide it."""
    home = os.path.realpath(workdir)
    for target in WRITABLE:
        real = os.path.realpath(target)
        if os.path.commonpath([real, home]) == real:
            return real
    return None


def _refuse_scratch(what: str) -> None:
    print(f"fibray launcher: cannot confine the executor's writes: {what}", file=sys.stderr, flush=True)
    os._exit(SCRATCH_REFUSED)


def _read_only(libc, path: str, on: bool, flags: int, what: str) -> None:
    """Set (or clear) the read-only attribute of the mount at `path` (flags: _AT_RECURSIVE for those below it too)."""
    attr = (ctypes.c_uint64 * 4)(*((_MOUNT_ATTR_RDONLY, 0) if on else (0, _MOUNT_ATTR_RDONLY)), 0, 0)  # attr_set, attr_clr
    if libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
        _refuse_scratch(f"{what}: {os.strerror(ctypes.get_errno())}")


def _confine_writes(libc, size: int, workdir: str, uid: int | None) -> None:
    """In the executor's own mount namespace: every mount read-only, then a tmpfs of `size` bytes over
    `workdir` (its home and TMPDIR, owned by `uid`), also mounted on WRITABLE, so all it can write is
    bounded: a candidate that fills it fills its own scratch, not the host's disk or memory. Ends the
    process when a step fails: no executor rather than an unconfined one."""
    if (below := scratch_covers(workdir)) is not None:
        _refuse_scratch(f"runner.workdir {workdir} is below {below}, which the scratch covers")
    home = os.path.realpath(workdir)
    covered = [os.path.realpath(t) for t in WRITABLE if os.path.isdir(t)]  # mountinfo names where a link led
    _read_only(libc, "/", True, _AT_RECURSIVE, "mount_setattr (Linux 5.12 or later)")
    # its own /proc (mounted with the PID namespace) stays writable, not what is mounted below it: the CUDA
    # driver writes there (cuInit failed with error 304 on the H200 without it), and procfs holds no file
    # that grows, only the kernel's settings, each guarded by its own permission checks
    _read_only(libc, PROC, False, 0, f"mount_setattr on {PROC}")
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    if libc.mount(b"fibray-scratch", workdir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                  f"size={size},mode=0700{owner}".encode()) != 0:
        _refuse_scratch(f"tmpfs on {workdir}: {os.strerror(ctypes.get_errno())}")
    for real in covered:
        if libc.mount(workdir.encode(), real.encode(), None, _MS_BIND, None) != 0:
            _refuse_scratch(f"bind {real}: {os.strerror(ctypes.get_errno())}")
    still = [point for point, options in _mounts() if "ro" not in options and point not in (home, *covered, PROC)]
    if still:
        _refuse_scratch(f"{len(still)} mount(s) still writable, e.g. {still[0]}")
    os.chdir(workdir)  # the cwd was the directory below the tmpfs


def apply(spec: dict) -> None:
    """A new network namespace, a new PID namespace, its cgroup, limits, an unprivileged uid. (The supervisor's
    threads never see a parent-death signal: Linux sends it when the *thread* that started the
    process ends, and lanes start executors that other lanes' jobs use; the executor watches its
    parent instead, see fibray.workers.process.executor. Only the single-threaded relay arms one.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    if spec["netns"] and libc.unshare(_CLONE_NEWNET) != 0:
        os._exit(NETNS_REFUSED)
    if os.getppid() != spec["parent"]:  # the supervisor is gone already: nobody to serve
        os._exit(1)
    relay_gone = _enter_pid_namespace(libc, spec["parent"]) if spec.get("pidns") else None  # limits below: the executor's
    if spec.get("cgroup"):  # while still root: the candidate's uid cannot leave it
        from fibray.workers.process.cgroup import join

        join(spec["cgroup"])
    if spec.get("scratch"):
        if relay_gone is None:  # no mount namespace of its own: the confinement would be the host's
            _refuse_scratch("it has no PID (and mount) namespace of its own")
        _confine_writes(libc, spec["scratch"], spec["workdir"], spec["uid"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["as"]:
        resource.setrlimit(resource.RLIMIT_AS, (spec["as"], spec["as"]))
    if spec["cpu"]:
        resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 5))
    if spec.get("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if relay_gone is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it; the relay is single-threaded
        if select.select([relay_gone], [], [], 0)[0]:  # the relay ended before the signal was armed
            os._exit(1)
        os.close(relay_gone)


def become_subreaper() -> None:
    """Orphans of our executors re-parent to us (not to init), so we can find and kill them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m fibray.workers.process.launch SANDBOX_JSON -- ARGV...")
    apply(json.loads(argv[0]))
    os.execv(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
