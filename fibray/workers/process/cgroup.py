"""A CPU-accounting cgroup per executor: the kernel's count of the CPU time of every process the
executor ever started, those that ended without anyone collecting them included.

The timing bound of a CPU slot reads an executor's CPU time (fibray.workers.cpu_clock). The
process's own clocks hold its threads and the children it waited for; a child that does the work
and is collected automatically (SIGCHLD ignored) leaves nothing behind in them, so a candidate
that hides its work in such children read cheaper than it was. Every process forked in a cgroup
stays in it, and the cgroup's usage counter keeps the time of those that have exited. The
executor joins its cgroup before it drops its privileges (launch.apply); the directory is root's,
so the candidate's uid cannot leave it. Never imported by an executor but for `join`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CGROUP_REFUSED = 123
"""Exit status of an executor that was to join its cgroup and could not: no executor rather than an unaccounted one."""


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy that counts CPU time, at this process's own place in it."""

    base: Path
    v2: bool

    def usage_file(self, path: Path) -> Path:
        return path / ("cpu.stat" if self.v2 else "cpuacct.usage")


def _own_paths() -> tuple[Optional[str], Optional[str]]:
    """This process's cgroup in the v2 hierarchy and in the v1 one holding cpuacct (None: not in one)."""
    v2 = v1 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2 = path
        elif "cpuacct" in controllers.split(","):
            v1 = path
    return v2, v1


def hierarchies() -> list[Hierarchy]:
    """cgroup v2, then v1 cpuacct, each where this process sits in it (from /proc/self/mountinfo)."""
    found: list[Hierarchy] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
        own_v2, own_v1 = _own_paths()
    except OSError:
        return found
    for v2, own in ((True, own_v2), (False, own_v1)):
        if own is None:
            continue
        for line in lines:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if len(fields) < 5 or len(post_fields) < 3:
                continue
            root, mount, fstype, options = fields[3], fields[4], post_fields[0], post_fields[2].split(",")
            if fstype != ("cgroup2" if v2 else "cgroup") or (not v2 and "cpuacct" not in options):
                continue
            rel = os.path.relpath(own, root) if own.startswith(root) else None
            if rel is None or rel.startswith(".."):
                continue  # our cgroup is not below what this mount shows
            found.append(Hierarchy(base=Path(mount) / ("" if rel == "." else rel), v2=v2))
    return found


def _usage_s(h: Hierarchy, path: Path) -> float:
    text = h.usage_file(path).read_text()
    if not h.v2:
        return int(text) / 1e9
    for line in text.splitlines():
        key, value = line.split()
        if key == "usage_usec":
            return int(value) / 1e6
    raise ValueError(f"{h.usage_file(path)} has no usage_usec")


def _remove_stale(h: Hierarchy) -> None:
    """Remove the empty cgroups of fibray processes that are gone (a supervisor killed before it
    retired its executors); one still holding a process stays."""
    for path in h.base.glob("fibray-*"):
        owner = path.name.split("-")[-2]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            try:
                path.rmdir()
            except OSError:
                pass


_HIERARCHY: list[Optional[Hierarchy]] = []
_PROBING = threading.Lock()  # lanes spawn executors from several threads
_SERIAL = itertools.count()


def hierarchy() -> Optional[Hierarchy]:
    """The first hierarchy where this process can make a cgroup and read its CPU usage (None: none;
    for example not root and no delegated subtree). Probed once a process."""
    with _PROBING:
        if not _HIERARCHY:
            _HIERARCHY.append(_probe())
    return _HIERARCHY[0]


def _probe() -> Optional[Hierarchy]:
    for h in hierarchies():
        probe = h.base / f"fibray-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            _usage_s(h, probe)
        except (OSError, ValueError):
            continue
        finally:
            try:
                probe.rmdir()
            except OSError:
                pass
        _remove_stale(h)
        return h
    return None


@dataclass
class ExecutorCgroup:
    """One executor's cgroup: it and everything it starts are counted here."""

    path: Path
    h: Hierarchy

    @classmethod
    def create(cls, h: Optional[Hierarchy] = None) -> Optional["ExecutorCgroup"]:
        """A new, empty cgroup in `h` (by default the usable hierarchy; None where there is none)."""
        h = h or hierarchy()
        if h is None:
            return None
        path = h.base / f"fibray-{os.getpid()}-{next(_SERIAL)}"
        try:
            path.mkdir()
        except OSError:
            return None
        return cls(path, h)

    @property
    def procs_file(self) -> str:
        """What an executor writes "0" to, to join (launch.apply)."""
        return str(self.path / "cgroup.procs")

    def usage_s(self) -> float:
        """CPU seconds of every process that was ever in it (exited ones included)."""
        return _usage_s(self.h, self.path)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self.procs_file).read_text().split()]
        except (OSError, ValueError):
            return []

    def remove(self, wait_s: float = 1.0) -> bool:
        """Remove it once its processes are gone (they must be killed first); False if it stayed."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)


def join(procs_file: str) -> None:
    """In the executor, before it drops privileges: move this process into its cgroup, or end it."""
    try:
        with open(procs_file, "w") as f:
            f.write("0")
    except OSError:
        os._exit(CGROUP_REFUSED)
