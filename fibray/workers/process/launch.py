"""`python -m fibray.workers.process.launch SANDBOX -- ARGV...`: put this process in an executor's
sandbox, then become the executor (exec: same pid, same inherited channel descriptors).

The sandbox used to be applied by a `preexec_fn` between fork and exec in the supervisor. The
supervisor is threaded (Ray's and gRPC's threads, lanes, CUDA calls), and Python code in a
forked child of a threaded process can deadlock or abort on a lock another thread held; seen on
the H200 as single-use executors killed by SIGABRT before they printed anything. With no
`preexec_fn`, subprocess starts this launcher through vfork and exec alone, and everything
below runs in a fresh, single-threaded process. SANDBOX is a JSON object (see `sandbox_argv`).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

_CLONE_NEWNET = 0x40000000
NETNS_REFUSED = 121
"""Exit status when a network namespace was asked for and refused: better no executor than a networked one."""


def sandbox_argv(*, max_open_files: int, max_processes: int, memory_limit_bytes: int | None,
                 cpu_seconds: int | None, netns: bool, uid: int | None) -> list[str]:
    """The launcher's arguments before `--` and the executor's argv."""
    spec = {"nofile": max_open_files, "nproc": max_processes, "as": memory_limit_bytes, "cpu": cpu_seconds,
            "netns": netns, "uid": uid, "parent": os.getpid()}
    return [sys.executable, "-m", "fibray.workers.process.launch", json.dumps(spec), "--"]


def apply(spec: dict) -> None:
    """Limits, a new network namespace, an unprivileged uid. (No parent-death signal: Linux sends
    it when the *thread* that started the process ends, and lanes start executors that other
    lanes' jobs use; the executor watches its parent instead, see fibray.workers.process.executor.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["as"]:
        resource.setrlimit(resource.RLIMIT_AS, (spec["as"], spec["as"]))
    if spec["cpu"]:
        resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 5))
    if spec["netns"] and libc.unshare(_CLONE_NEWNET) != 0:
        os._exit(NETNS_REFUSED)
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if os.getppid() != spec["parent"]:  # the supervisor is gone already: nobody to serve
        os._exit(1)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m fibray.workers.process.launch SANDBOX_JSON -- ARGV...")
    apply(json.loads(argv[0]))
    os.execv(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
