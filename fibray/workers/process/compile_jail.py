"""Compiling a CUDA/C++ solution ahead, from a process with fibray's privileges (the sweep's compile-ahead
tasks, the promotion gates), without lending them to the compiler.

A compiler reads every file a source names: `#include "/path"` prints what it could parse of it in
the error that lands in the row's log, and `.incbin "/path"` copies a whole file into the library the
candidate then runs. Run as root, that is every file on the host, the store's signing keys included.
Here each solution's compile is one process (`python -m fibray.compile.jailed`) that runs as a leased
uid of its own, without network and with a bound on any file it writes; it writes only into the
artifact's folder, which is handed to that uid for the compile and taken back after it: whatever
still runs as the uid is killed, and anything but plain files and folders is removed, before fibray
writes there again (a link planted there could otherwise turn fibray's next write into one elsewhere).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from fibray.compile.base import BuildError
from fibray.compile.jailed import MARK
from fibray.compile.toolchain import bound_output
from fibray.schema import Solution
from fibray.schema.reasons import Reason
from fibray.workers.process.launch import launcher_argv, sandbox_spec
from fibray.workers.process.sandbox import (SandboxPolicy, kill_tree, network_namespaces_available, scrubbed_env,
                                            uid_pool)
from fibray.workers.process.uids import kill_uid, uids_running

STARTUP_S = 60.0
"""Beyond the compile deadlines: the compiling interpreter's start and torch's import."""


@dataclass(frozen=True)
class CompileJail:  # a fibray.compile.cache.Jail
    """Compilers run as a leased uid of `uid_range` (None: the default range), with no network and no file
    past `max_file_bytes`. Needs root (it hands folders to other uids)."""

    uid_range: Optional[tuple[int, int]] = None
    max_file_bytes: int = 4 << 30

    def compile(self, solution: Solution, outdir: Path, timeout_s: float) -> None:
        lease = uid_pool(SandboxPolicy(uid_range=self.uid_range)).lease()
        try:
            os.chown(outdir, lease.uid, lease.uid)  # empty: the compile writes everything in it
            spec = sandbox_spec(max_open_files=1024, max_processes=1024, memory_limit_bytes=None, cpu_seconds=None,
                                netns=network_namespaces_available(), uid=lease.uid, max_file_bytes=self.max_file_bytes)
            argv = [*launcher_argv(spec), sys.executable, "-m", "fibray.compile.jailed", str(outdir), str(timeout_s)]
            env = scrubbed_env({"HOME": str(outdir), "PYTHONDONTWRITEBYTECODE": "1"})
            proc = subprocess.Popen(argv, cwd=outdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
            limit = 3 * timeout_s + STARTUP_S  # a backstop: each compiler command has timeout_s of its own
            try:
                out, _ = proc.communicate(solution.model_dump_json(), timeout=limit)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid, proc.pid)
                out, _ = proc.communicate()
                raise BuildError(f"the compile did not finish within {limit:.0f}s\n{bound_output(out)}",
                                 Reason.COMPILE_TIMEOUT) from None
        finally:
            try:
                _end_everything_of(lease.uid)
                reclaim(outdir)
            finally:
                lease.release()  # only now may another executor take the uid
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(MARK)), None)
        if line is None:
            raise BuildError(f"the compiling process ended (status {proc.returncode}) without a result:\n{bound_output(out)}",
                             Reason.BUILD_FAILED)
        result = json.loads(line[len(MARK):])
        if not result["ok"]:
            raise BuildError(str(result["message"]), str(result["reason"]))


def _end_everything_of(uid: int, deadline_s: float = 10.0) -> None:
    """SIGKILL whatever runs as `uid`, and wait until nothing does (BuildError if something outlives it)."""
    end = time.monotonic() + deadline_s
    while uids_running(uid):
        if time.monotonic() > end:
            raise BuildError(f"processes of the compile's uid {uid} outlived SIGKILL", Reason.BUILD_FAILED)
        kill_uid(uid)
        time.sleep(0.01)


def reclaim(folder: Path) -> None:
    """Take `folder` back from the uid that wrote it: nothing but plain files and folders is kept, every
    entry becomes ours and writable by nobody else. Never follows a link."""
    for top, dirs, files in os.walk(folder, topdown=True, followlinks=False):
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                os.unlink(path)  # a link, a fifo, a socket: nothing a build needs
                if name in dirs:
                    dirs.remove(name)
                continue
            os.lchown(path, os.geteuid(), os.getegid())
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022 & ~stat.S_ISUID & ~stat.S_ISGID)
    os.lchown(folder, os.geteuid(), os.getegid())
    os.chmod(folder, 0o755)


def compile_jail(drop_privileges: bool, uid_range: Optional[Sequence[int]]) -> Optional[CompileJail]:
    """The jail for a run's compiles ahead: None where candidates keep fibray's privileges anyway
    (runner.drop_privileges=false)."""
    return CompileJail(tuple(uid_range) if uid_range else None) if drop_privileges else None
