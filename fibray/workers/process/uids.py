"""One unprivileged uid per executor, leased from a configured range (fibray running as root).

A lease is an flock on a per-uid file in a directory only root can write, so slots of several
processes on one host never hand out the same uid, and a lease dies with the process holding
it. A uid is handed out only once no process runs as it (leftovers are killed first), so an
executor can neither signal nor read the files of any other executor, nor of fibray.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import stat
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
