"""On-disk build artifacts shared by every worker of a sweep, keyed by content hash and toolchain.

One directory per key (solution hash + toolchain fingerprint), published by an atomic rename
and compiled under a per-key file lock, so two workers never compile the same key at once. A
failed compile is cached with its log and re-raised as the same BuildError. It must never hand
out a half-written artifact, and it never compiles anything itself: compilers register here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional, Protocol

from pydantic import BaseModel, ConfigDict

from fibray import deadlines
from fibray.compile.base import BuildError
from fibray.schema import Solution
from fibray.schema.reasons import Reason

__all__ = [
    "ArtifactCache", "BuildLockTimeout", "CacheEntry", "CacheResult", "compile_ahead", "compiler_for",
    "register_compiler",
]

ENTRY_FILE = "entry.json"
"""Written last inside an artifact directory; its presence means the directory is complete."""

# A compile that ran out of time may only have been starved of CPU: it is reported, never cached.
_UNCACHED_REASONS = frozenset({Reason.COMPILE_TIMEOUT})


class Compiler(Protocol):
    def __call__(self, solution: Solution, outdir: Path, timeout_s: float) -> None:
        """Write the solution's artifact into outdir (which exists and is empty); raise BuildError."""


Fingerprint = Callable[[Solution], dict[str, str]]


class Jail(Protocol):
    def compile(self, solution: Solution, outdir: Path, timeout_s: float) -> None:
        """Run the solution's compiler into outdir somewhere it reads and writes only what any user may
        (fibray.workers.process.compile_jail); outdir is fibray's again when it returns. Raise BuildError."""

_COMPILERS: dict[str, tuple[Compiler, Fingerprint]] = {}


def register_compiler(*languages: str, fingerprint: Fingerprint) -> Callable[[Compiler], Compiler]:
    """Register the ahead-of-time compiler (and its toolchain fingerprint) of some languages."""

    def deco(fn: Compiler) -> Compiler:
        for lang in languages:
            _COMPILERS[lang] = (fn, fingerprint)
        return fn

    return deco


def compiler_for(language: str) -> Optional[tuple[Compiler, Fingerprint]]:
    """The (compiler, fingerprint) of a language, or None when it has nothing to compile."""
    return _COMPILERS.get(language)


class BuildLockTimeout(TimeoutError):
    """Another worker held a build lock past the deadline; nothing was cached."""


class CacheEntry(BaseModel):
    """What entry.json records about one cached build."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    key: str
    """Cache key: sha256 of solution hash and toolchain fingerprint (hex, 40 chars)."""
    solution_hash: str
    """Solution.hash the artifact was built from."""
    solution_name: str
    """Solution name at build time (informational; the hash is the identity)."""
    status: Literal["ok", "failed"]
    """Whether the compile succeeded."""
    reason: Optional[str] = None
    """BuildError reason of a failed compile (nvcc_error, unsupported_binding, ...)."""
    message: str = ""
    """BuildError message of a failed compile: the bounded compiler output."""
    fingerprint: dict[str, str]
    """Toolchain the key was derived from (nvcc, torch, arch, ...)."""
    compile_s: float
    """Wall time of the compile, seconds."""
    created_at: str
    """ISO-8601 UTC time the entry was published."""
    builder: str
    """host:pid of the process that compiled it."""


@dataclass(frozen=True)
class CacheResult:
    """One lookup: where the artifact is, its entry, and whether this call compiled it."""

    path: Path
    entry: CacheEntry
    compiled_here: bool
    waited_s: float

    def raise_if_failed(self) -> Path:
        """The artifact directory; the cached BuildError if the compile failed."""
        if self.entry.status == "failed":
            raise BuildError(self.entry.message, self.entry.reason or Reason.BUILD_FAILED)
        return self.path


class ArtifactCache:
    """A directory of compiled artifacts that many processes (and nodes on a shared FS) use at once."""

    def __init__(self, root: str | Path, *, lock_deadline_s: float = deadlines.BUILD_LOCK_S,
                 compile_timeout_s: float = deadlines.COMPILE_S,
                 poll_s: float = deadlines.BUILD_LOCK_POLL_S, jail: Optional[Jail] = None) -> None:
        self.root = Path(root)
        self.jail = jail
        """Where compilers run (None: in this process, with its privileges)."""
        self.lock_deadline_s = lock_deadline_s
        self.compile_timeout_s = compile_timeout_s
        self.poll_s = poll_s

    def key(self, solution: Solution) -> str:
        """The cache key of a solution under the current toolchain."""
        _, fingerprint = self._compiler(solution)
        return _key(solution, fingerprint(solution))

    def lookup(self, solution: Solution) -> Optional[CacheEntry]:
        """The published entry of a solution, or None (never waits, never compiles)."""
        return _read_entry(self.root / self.key(solution))

    def ensure(self, solution: Solution) -> CacheResult:
        """Compile the solution unless its key is cached; failures are results, not exceptions.

        Raises BuildLockTimeout when another process holds the key's lock past the deadline.
        """
        compiler, fingerprint = self._compiler(solution)
        fp = fingerprint(solution)
        key = _key(solution, fp)
        final = self.root / key
        entry = _read_entry(final)
        if entry is not None:
            return CacheResult(final, entry, compiled_here=False, waited_s=0.0)
        t0 = time.monotonic()
        with self._lock(key):
            waited = time.monotonic() - t0
            entry = _read_entry(final)  # published while we waited for the lock
            if entry is not None:
                return CacheResult(final, entry, compiled_here=False, waited_s=waited)
            return self._compile(solution, compiler, fp, key, waited)

    def artifact(self, solution: Solution) -> Path:
        """The artifact directory of a solution, compiling it if needed; raises its BuildError."""
        return self.ensure(solution).raise_if_failed()

    # -- internals -----------------------------------------------------------------------
    def _compiler(self, solution: Solution) -> tuple[Compiler, Fingerprint]:
        found = compiler_for(solution.spec.language.value)
        if found is None:
            raise BuildError(f"spec.language: {solution.spec.language.value!r} has no ahead-of-time compiler",
                             Reason.UNSUPPORTED_LANGUAGE)
        return found

    def _compile(self, solution: Solution, compiler: Compiler, fp: dict[str, str], key: str,
                 waited: float) -> CacheResult:
        tmp_root = _shared_dir(self.root / ".tmp")
        for stale in tmp_root.glob(f"{key}-*"):  # left by a compiler that died holding this lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tmp_root / f"{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        t0 = time.monotonic()
        status, reason, message = "ok", None, ""
        try:
            (self.jail.compile if self.jail is not None else compiler)(solution, tmp, self.compile_timeout_s)
        except BuildError as e:
            status, reason, message = "failed", e.reason, str(e)
        entry = CacheEntry(
            key=key, solution_hash=solution.hash, solution_name=solution.name, status=status, reason=reason,
            message=message, fingerprint=fp, compile_s=round(time.monotonic() - t0, 3),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            builder=f"{socket.gethostname()}:{os.getpid()}",
        )
        final = self.root / key
        if reason in _UNCACHED_REASONS:
            shutil.rmtree(tmp, ignore_errors=True)
            return CacheResult(final, entry, compiled_here=True, waited_s=waited)
        _write_atomic(tmp / ENTRY_FILE, entry.model_dump_json(indent=2))
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # published by a process that ignored the lock
            published = _read_entry(final)
            if published is not None:
                return CacheResult(final, published, compiled_here=False, waited_s=waited)
            raise
        return CacheResult(final, entry, compiled_here=True, waited_s=waited)

    def _lock(self, key: str) -> contextlib.AbstractContextManager[None]:
        return exclusive_lock(_shared_dir(self.root / ".locks") / f"{key}.lock", self.lock_deadline_s, self.poll_s)


@contextlib.contextmanager
def exclusive_lock(path: Path, deadline_s: float, poll_s: float = deadlines.BUILD_LOCK_POLL_S) -> Iterator[None]:
    """Hold an exclusive flock on `path` (any user may take it), waiting at most deadline_s for
    another holder; BuildLockTimeout names the holder (host:pid written by it) when it does not let go."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(PermissionError):
        os.fchmod(fd, 0o666)  # umask aside: a worker running as another user must be able to lock it too
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 128, 0).decode(errors="replace").strip() or "unknown"
                    raise BuildLockTimeout(f"build lock {path} still held by {holder} after {deadline_s:.0f}s") from None
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()}:{os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def compile_ahead(solution: Solution, cache_dir: str | Path, timeout_s: float = deadlines.COMPILE_S,
                  jail: Optional[Jail] = None) -> Optional[str]:
    """Compile a solution into the shared cache before any GPU sees it (a plain CPU task).

    Returns the error text of a failed compile (cached or fresh), or None when the solution
    built or its language needs no compile; timeout_s bounds the compile (use the sweep's
    eval.build_deadline_s). Raises BuildLockTimeout if another compiler held the key too long.
    Safe in `ray.remote(num_cpus=1)`: it needs nvcc, no GPU. `jail`: where the compiler runs (a process
    with fibray's privileges must not let a solution's `#include` read what they can).
    """
    if compiler_for(solution.spec.language.value) is None:
        return None
    result = ArtifactCache(cache_dir, compile_timeout_s=timeout_s, lock_deadline_s=timeout_s + deadlines.BUILD_LOCK_GRACE_S,
                           jail=jail).ensure(solution)
    return None if result.entry.status == "ok" else result.entry.message


def _shared_dir(path: Path) -> Path:
    """Create a cache folder that only its writer's uid may write into (0755).

    The cache is written by fibray (the driver's compile-ahead tasks, or an unsandboxed
    process) and only read by sandboxed executors, which compile into folders of their own: a
    cache executors could write would be a channel from one candidate to another.
    """
    for folder in (path.parent, path):
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):
                os.chmod(folder, 0o755)
    return path


def _key(solution: Solution, fingerprint: dict[str, str]) -> str:
    payload = json.dumps({"solution": solution.hash, "toolchain": fingerprint}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


def _read_entry(folder: Path) -> Optional[CacheEntry]:
    try:
        return CacheEntry.model_validate_json((folder / ENTRY_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
