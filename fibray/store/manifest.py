"""Which files of a store partition the driver published: a signed, append-only manifest.

Every file the writer publishes gets a line in its partition's `_manifest.jsonl`: its name,
size, sha256, row count and the driver's publication time, signed with an HMAC key that only
the driver's uid can read (`_keys/manifest.key`, mode 0600). Readers take a partition's files
from its manifest alone, in publication order; a file it does not list (or lists with other
contents, or under a bad signature) is ignored and counted, never read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

MANIFEST = "_manifest.jsonl"
KEY_DIR = "_keys"
KEY_FILE = "manifest.key"


@dataclass(frozen=True)
class Published:
    """A file its partition's manifest vouches for."""

    path: Path
    published_ns: int
    """The driver's clock when it published the file (orders files across partitions)."""
    line: int
    """Its line in the manifest (orders files published in the same nanosecond)."""


@dataclass
class Verdict:
    """A partition as its manifest has it: the files to read, and how many others were ignored."""

    files: list[Published]
    ignored: list[Path]


def signed(root: Path) -> bool:
    """Whether the store was written with manifests (then a partition without one is not read)."""
    return (root / KEY_DIR).is_dir()


def _key(root: Path, create: bool) -> Optional[bytes]:
    path = root / KEY_DIR / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    except PermissionError:
        return None  # another uid's store: the manifests' hashes are checked, not their signatures
    (root / KEY_DIR).mkdir(mode=0o700, exist_ok=True)
    os.chmod(root / KEY_DIR, 0o700)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never replaces a key another writer made first
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


def _mac(key: bytes, partition: str, entry: dict) -> str:
    body = json.dumps({"partition": partition, **{k: v for k, v in entry.items() if k != "mac"}}, sort_keys=True)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def record(root: Path, path: Path, rows: int, replaces: tuple[str, ...] = (),
           published_ns: Optional[int] = None) -> None:
    """Vouch for a file just published in its partition (the writer holds the sweep's lock)."""
    key = _key(root, create=True)
    folder = path.parent
    entry = {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path), "rows": rows,
             "published_ns": published_ns if published_ns is not None else time.time_ns(), "replaces": list(replaces)}
    entry["mac"] = _mac(key, _partition(root, folder), entry) if key else ""
    fd = os.open(folder / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _partition(root: Path, folder: Path) -> str:
    return folder.resolve().relative_to(root.resolve()).as_posix()


_HASHED: dict[tuple, str] = {}
"""(path, inode, size, mtime) -> sha256: a file is hashed once per process while it stays the same."""


def _matches(path: Path, entry: dict) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != entry.get("bytes"):
        return False
    stamp = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if stamp not in _HASHED:
        _HASHED[stamp] = sha256_of(path)
    return hmac.compare_digest(_HASHED[stamp], str(entry.get("sha256")))


def verify(root: Path, folder: Path) -> Verdict:
    """The files of one partition its manifest vouches for, and the others on disk."""
    on_disk = sorted(folder.glob("*.parquet"))
    if not signed(root):
        return Verdict([Published(p, 0, i) for i, p in enumerate(on_disk)], [])  # a store from before manifests
    key = _key(root, create=False)
    partition = _partition(root, folder)
    entries: list[tuple[int, dict]] = []
    try:
        lines = (folder / MANIFEST).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or (key is not None and not hmac.compare_digest(
                str(entry.get("mac", "")), _mac(key, partition, entry))):
            continue
        entries.append((i, entry))
    replaced = {name for _, e in entries for name in e.get("replaces", [])}
    good = []
    for i, e in entries:
        path = folder / str(e.get("file"))
        if e["file"] in replaced or path.parent != folder or not _matches(path, e):
            continue
        good.append(Published(path, int(e.get("published_ns", 0)), i))
    vouched = {p.path for p in good}
    return Verdict(good, [p for p in on_disk if p not in vouched])


def warn_ignored(root: Path, ignored: list[Path]) -> None:
    if ignored:
        log.warning("store %s: ignored %d file(s) its driver never published (not in a signed manifest), e.g. %s",
                    root, len(ignored), ignored[0])
