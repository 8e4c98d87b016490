"""A CPU-accounting cgroup per executor: the kernel's count of the CPU time of every process the
executor ever started, those that ended without anyone collecting them included.

The timing bound of a CPU slot reads an executor's CPU time (fibray.workers.cpu_clock). The
process's own clocks hold its threads and the children it waited for; a child that does the work
and is collected automatically (SIGCHLD ignored) leaves nothing behind in them, so a candidate
that hides its work in such children read cheaper than it was. Every process forked in a cgroup
stays in it, and the cgroup's usage counter keeps the time of those that have exited. The
executor joins its cgroup before it drops its privileges (launch.apply); the directory is root's,
so the candidate's uid cannot leave it. Never imported by an executor but for `join`.

The same cgroup (or, on cgroup v1, one in the memory hierarchy beside it) bounds the host memory of
everything the executor starts: RLIMIT_AS bounds one process's address space, which a candidate
escapes by forking, and cannot be set at all on a GPU (CUDA maps far more address space than it
uses). When a process of the cgroup goes over, the kernel ends it and counts an OOM kill there.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

CGROUP_REFUSED = 123
"""Exit status of an executor that was to join its cgroup and could not: no executor rather than an unaccounted one."""


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy that counts CPU time, at this process's own place in it."""

    base: Path
    v2: bool

    def usage_file(self, path: Path) -> Path:
        return path / ("cpu.stat" if self.v2 else "cpuacct.usage")


def _own_paths(cgroup_lines: list[str], controller: str) -> tuple[Optional[str], Optional[str]]:
    """A process's cgroup in the v2 hierarchy and in the v1 one holding `controller` (None: not in
    one), from the lines of its /proc/PID/cgroup."""
    v2 = v1 = None
    for line in cgroup_lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def hierarchies(controller: str = "cpuacct") -> list[Hierarchy]:
    """cgroup v2, then the v1 hierarchy of `controller`, each at this process's own place in it and
    then at each cgroup above it that the mount shows, deepest first. Whether a controller can be
    used there is for a probe to find out: on v2 a controller reaches a new cgroup only if its
    parent delegates it, and a cgroup that holds processes (fibray's own, usually) can delegate
    none unless it is the root, so a cgroup above fibray's may be the first that bounds memory."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
        cgroups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    return _hierarchies(mountinfo, cgroups, controller)


def _hierarchies(mountinfo: list[str], cgroups: list[str], controller: str) -> list[Hierarchy]:
    found: list[Hierarchy] = []
    own_v2, own_v1 = _own_paths(cgroups, controller)
    for v2, own in ((True, own_v2), (False, own_v1)):
        if own is None:
            continue
        for line in mountinfo:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if len(fields) < 5 or len(post_fields) < 3:
                continue
            root, mount, fstype, options = fields[3], fields[4], post_fields[0], post_fields[2].split(",")
            if fstype != ("cgroup2" if v2 else "cgroup") or (not v2 and controller not in options):
                continue
            rel = os.path.relpath(own, root) if own.startswith(root) else None
            if rel is None or rel.startswith(".."):
                continue  # our cgroup is not below what this mount shows
            place = Path(mount) / ("" if rel == "." else rel)
            found.extend(Hierarchy(base=base, v2=v2) for base in (place, *place.parents) if base.is_relative_to(mount))
    return list(dict.fromkeys(found))


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
            _rmdir(path)


_HIERARCHY: list[Optional[Hierarchy]] = []
_MEMORY: list[Optional[Hierarchy]] = []
_PROBING = threading.Lock()  # lanes spawn executors from several threads
_SERIAL = itertools.count()


def _limit_file(h: Hierarchy, path: Path) -> Path:
    return path / ("memory.max" if h.v2 else "memory.limit_in_bytes")


def _bound_memory(h: Hierarchy, path: Path, limit: int) -> None:
    """Bound the memory of cgroup `path` to `limit` bytes, swap included where swap is accounted
    (OSError if the limit itself cannot be set)."""
    _limit_file(h, path).write_text(str(limit))
    swap = path / ("memory.swap.max" if h.v2 else "memory.memsw.limit_in_bytes")
    if swap.exists():  # v1: memory and swap together, at least the memory limit; v2: swap alone
        try:
            swap.write_text("0" if h.v2 else str(limit))
        except OSError:
            pass  # the host accounts no swap: memory alone is bounded


def _oom_kills(h: Hierarchy, path: Path) -> int:
    """How many processes the kernel has ended in cgroup `path` for going over its memory limit."""
    name = "memory.events" if h.v2 else "memory.oom_control"
    try:
        for line in (path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def hierarchy() -> Optional[Hierarchy]:
    """The first hierarchy where this process can make a cgroup and read its CPU usage (None: none;
    for example not root and no delegated subtree). Probed once a process."""
    return _once(_HIERARCHY, lambda: _first_usable(hierarchies(), f"fibray-probe-{os.getpid()}", _usage_s))


def memory_hierarchy() -> Optional[Hierarchy]:
    """The first hierarchy where this process can make a cgroup and bound its memory (None: none;
    on v2, for example, the memory controller not delegated here). Probed once a process."""
    return _once(_MEMORY, lambda: _first_usable(hierarchies("memory"), f"fibray-probe-{os.getpid()}-memory",
                                                lambda h, probe: _bound_memory(h, probe, 1 << 40)))


def _once(cache: list[Optional[Hierarchy]], probe: Callable[[], Optional[Hierarchy]]) -> Optional[Hierarchy]:
    with _PROBING:
        if not cache:
            cache.append(probe())
    return cache[0]


def _first_usable(found: list[Hierarchy], name: str, check: Callable[[Hierarchy, Path], object]) -> Optional[Hierarchy]:
    """The first of `found` where a cgroup `name` can be made and `check(h, path)` passes on it (the
    probe is removed again); that hierarchy's stale cgroups are removed."""
    for h in found:
        probe = h.base / name
        if not _mkdir(probe):
            continue
        try:
            check(h, probe)
        except (OSError, ValueError):
            continue
        finally:
            _rmdir(probe)
        _remove_stale(h)
        return h
    return None


@dataclass
class ExecutorCgroup:
    """One executor's cgroups: it and everything it starts are counted (CPU time, `path` in `h`) and
    bounded (host memory, `memory` in `memory_h`; on cgroup v2 one directory does both)."""

    path: Optional[Path]
    h: Optional[Hierarchy]
    memory: Optional[Path] = None
    memory_h: Optional[Hierarchy] = None
    memory_limit: Optional[int] = None

    @classmethod
    def create(cls, h: Optional[Hierarchy] = None, *, cpu: bool = True,
               memory_bytes: Optional[int] = None) -> Optional["ExecutorCgroup"]:
        """New, empty cgroups: one counting CPU time in `h` (by default the usable hierarchy) if `cpu`,
        and one bounding memory to `memory_bytes` if given. What cannot be made is left out (see
        `counts_cpu`, `bounds_memory`); None when neither can."""
        name = f"fibray-{os.getpid()}-{next(_SERIAL)}"
        cg = cls(None, None)
        mh = memory_hierarchy() if memory_bytes else None
        if cpu:
            h = h or hierarchy()
            if h is not None and mh is not None and h.v2 and mh.v2:
                h = mh  # on v2 a process sits in one cgroup, which must bound its memory too
            if h is not None and _mkdir(h.base / name):
                cg.path, cg.h = h.base / name, h
        if mh is not None:
            where = mh.base / name
            shared = where == cg.path  # cgroup v2: one directory counts and bounds
            if shared or _mkdir(where):
                try:
                    _bound_memory(mh, where, memory_bytes)
                    cg.memory, cg.memory_h, cg.memory_limit = where, mh, memory_bytes
                except OSError:
                    if not shared:
                        _rmdir(where)
        return cg if cg.path is not None or cg.memory is not None else None

    @property
    def counts_cpu(self) -> bool:
        return self.path is not None

    @property
    def bounds_memory(self) -> bool:
        return self.memory is not None

    def _dirs(self) -> list[Path]:
        return list(dict.fromkeys(p for p in (self.path, self.memory) if p is not None))

    @property
    def procs_files(self) -> list[str]:
        """What an executor writes "0" to, to join each of its cgroups (launch.apply)."""
        return [str(p / "cgroup.procs") for p in self._dirs()]

    def usage_s(self) -> float:
        """CPU seconds of every process that was ever in it (exited ones included)."""
        if self.path is None or self.h is None:
            raise ValueError("this executor's cgroups count no CPU time")
        return _usage_s(self.h, self.path)

    def oom_kills(self) -> int:
        """Processes the kernel has ended in it for going over its memory bound (0 where unbounded)."""
        return _oom_kills(self.memory_h, self.memory) if self.memory is not None and self.memory_h is not None else 0

    def pids(self) -> list[int]:
        found: dict[int, None] = {}
        for procs in self.procs_files:
            try:
                found.update(dict.fromkeys(int(p) for p in Path(procs).read_text().split()))
            except (OSError, ValueError):
                pass
        return list(found)

    def kill_all(self) -> None:
        """SIGKILL every process in them (whatever an executor or run started, wherever it re-parented),
        again while one forks as it is killed."""
        for _ in range(50):
            if not (pids := self.pids()):
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self, wait_s: float = 1.0) -> bool:
        """Remove them once their processes are gone (they must be killed first); False if one stayed."""
        deadline = time.monotonic() + wait_s
        left = self._dirs()
        while True:
            for path in list(left):
                try:
                    path.rmdir()
                    left.remove(path)
                except FileNotFoundError:
                    left.remove(path)
                except OSError:
                    pass
            if not left:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _mkdir(path: Path) -> bool:
    try:
        path.mkdir()
        return True
    except OSError:
        return False


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def join(procs_files: list[str]) -> None:
    """In the executor, before it drops privileges: move this process into its cgroups, or end it."""
    try:
        for procs_file in procs_files:
            with open(procs_file, "w") as f:
                f.write("0")
    except OSError:
        os._exit(CGROUP_REFUSED)
