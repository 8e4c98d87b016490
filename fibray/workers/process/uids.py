"""One unprivileged uid per executor, leased from a configured range (fibray running as root).

A lease is an flock on a per-uid file in a directory only root can write, so slots of several
processes on one host never hand out the same uid, and a lease dies with the process holding
it. A uid is handed out only once no process runs as it (leftovers are killed first), so an
executor can neither signal nor read the files of any other executor, nor of fibray.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_UID_RANGE = (200000, 200999)
"""uids (inclusive) for executors when runner.uid_range is not set; no account needs to exist."""


class NoUidAvailable(RuntimeError):
    """Every uid of the range is leased (by this host's slots) or could not be cleared."""


@dataclass
class UidLease:
    """A uid held for one executor; `release` kills whatever still runs as it."""

    uid: int
    fd: int

    def release(self) -> None:
        if self.fd < 0:
            return
        kill_uid(self.uid)
        os.close(self.fd)  # closing drops the flock: another slot may take the uid now
        self.fd = -1


def lease_dir() -> Path:
    """Where the per-uid lock files live: root's own directory, mode 0700 (checked, not assumed)."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    path = base / f"fibray-uids-{os.geteuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise NoUidAvailable(f"uid lease directory {path} is not a directory owned by uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def process_uids(pid: int) -> tuple[bool, tuple[int, ...]]:
    """Whether `pid` is a zombie (or dead), and its real, effective and saved uids, from
    /proc/<pid>/status (kernel accounting a process cannot rewrite). OSError when it is gone."""
    zombie = False
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"State:"):
                zombie = line.split()[1] in (b"Z", b"X")
            elif line.startswith(b"Uid:"):
                return zombie, tuple(int(v) for v in line.split()[1:4])
    raise OSError(f"/proc/{pid}/status has no Uid line")


def uids_running(uid: int) -> list[int]:
    """Pids of live processes (not zombies) whose real, effective or saved uid is `uid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            zombie, uids = process_uids(int(entry))
        except (OSError, ValueError):
            continue
        if uid in uids and not zombie:
            out.append(int(entry))
    return out


def kill_uid(uid: int) -> None:
    """SIGKILL every process running as uid (never raises)."""
    for pid in uids_running(uid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class UidPool:
    """Leases uids of [first, last] to executors, one uid per live executor."""

    def __init__(self, first: int, last: int) -> None:
        if not 0 < first <= last:
            raise ValueError(f"runner.uid_range: expected [first, last] with 0 < first <= last, got [{first}, {last}]")
        self.first, self.last = first, last
        self._dir: Optional[Path] = None
        self._lock = threading.Lock()

    def lease(self) -> UidLease:
        """A uid no other executor on this host holds, with nothing running as it."""
        with self._lock:
            if self._dir is None:
                self._dir = lease_dir()
            n = self.last - self.first + 1
            start = random.randrange(n)  # spread leases: a just-released uid is not the next one handed out
            for i in range(n):
                uid = self.first + (start + i) % n
                fd = os.open(self._dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                kill_uid(uid)  # a previous holder died without cleaning up
                if uids_running(uid):
                    os.close(fd)
                    continue
                return UidLease(uid, fd)
        raise NoUidAvailable(f"runner.uid_range: all {n} uids of [{self.first}, {self.last}] are in use on this host; "
                             "widen the range")


_SIGNALLER = r"""
import os, sys
for line in sys.stdin.buffer:  # "<own uid> <signal> <uid> ...": that signal to every process of each uid
    own, sig, *uids = (int(v) for v in line.split())
    code = 0
    for uid in uids:
        try:
            os.setresuid(own, uid, 0)  # uid as effective only: its processes cannot signal or trace us
            os.kill(-1, sig)  # every process whose real or saved uid is uid (or own: none but us)
        except ProcessLookupError:
            pass
        except OSError:
            code = 1
        finally:
            os.setresuid(0, 0, 0)  # the saved uid allows it; failing, the helper dies and is started again
    sys.stdout.buffer.write(b"%d\n" % code)
    sys.stdout.flush()
"""


class UidSignaller:
    """Sends a signal to every process of some uids at once: kill(-1) while holding each uid.

    Unlike a list of pids read from /proc, this reaches processes that fork and exit without end
    (a fork in progress passes the signal to the child). The sender holds the target uid as its
    effective uid only; its real uid is one leased for the signaller alone and its saved uid root's,
    so the processes it signals cannot signal or trace it (the kernel lets a sender's real or
    effective uid reach a target's real or saved one). The sender is a small single-threaded helper
    process, root like fibray and started once (fibray's own process may be Ray's, with threads).
    """

    def __init__(self, own: UidLease) -> None:
        self._own: Optional[UidLease] = own
        """The uid leased for the signaller alone: its real uid while it holds a target's."""
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> Optional[int]:
        """The helper's pid (None before the first send); a new one each time it had to be started again."""
        return self._proc.pid if self._proc is not None else None

    def send(self, uids: list[int], sig: int) -> None:
        """Raises OSError when the signal could not be sent (the caller fails closed)."""
        if not uids:
            return
        if min(uids) <= 0:
            raise ValueError(f"refusing to signal every process of uid {min(uids)}")
        with self._lock:
            if self._own is None:
                raise OSError("the uid signaller is closed")
            request = " ".join(str(v) for v in (self._own.uid, sig, *uids)).encode() + b"\n"
            for _ in (0, 1):
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SIGNALLER], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE, close_fds=True)
                try:
                    self._proc.stdin.write(request)
                    self._proc.stdin.flush()
                    code = self._proc.stdout.readline()
                except (BrokenPipeError, ValueError):
                    code = b""
                if code.strip() == b"0":
                    return
                if code:
                    raise OSError(f"could not send signal {sig} to the processes of uids {uids}")
                self._close()  # the helper died: start it again once
            raise OSError(f"the uid signaller died twice sending signal {sig} to uids {uids}")

    def _close(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._close()
            if self._own is not None:
                self._own.release()
                self._own = None


def owned_by(uids: set[int]) -> list[int]:
    """Pids whose /proc entry belongs to one of uids: their processes, read fast (a stat, not a parse, each).

    A process that made itself non-dumpable shows as root's here; use this only where missing one
    is safe (waiting for processes a whole-uid signal has already reached), never to kill or count."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat(follow_symlinks=False).st_uid in uids:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out
