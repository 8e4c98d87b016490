"""The append-only trace store: hive-partitioned Parquet, each file published atomically.

Files are written under a hidden temporary name, fsynced, and renamed into place, so a
reader never sees half a file and a killed writer leaves no visible debris. Nothing is
ever rewritten in place. The sweep driver is the only writer of a sweep (see `lock`), and
readers read only the files it published (fibray.store.manifest), in publication order.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq

from fibray.store import manifest
from fibray.store.columns import PARTITION_COLUMNS, SCHEMA


class StoreError(RuntimeError):
    """The store cannot be used as asked (unwritable root, sweep already running)."""


def _enc(value: str) -> str:
    return quote(value, safe="")


def _mkdirs(folder: Path) -> None:
    """Create folder and its missing parents as 0755 whatever the umask: writable by the driver only."""
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
        os.chmod(path, 0o755)


class TraceStore:
    """A store root holding definition=<d>/sweep=<s>/part-*.parquet files."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.ignored: list[Path] = []
        """Files the last listing found in partitions but did not read (not published by a driver)."""

    def partition(self, definition: str, sweep: str) -> Path:
        return self.root / f"definition={_enc(definition)}" / f"sweep={_enc(sweep)}"

    def append(self, rows: list[dict]) -> list[Path]:
        """Write rows as new Parquet files (one per partition); returns the published paths."""
        groups: dict[tuple[str, str], list[dict]] = {}
        for row in rows:
            groups.setdefault((row["definition"], row["sweep"]), []).append(row)
        published = []
        for (definition, sweep), group in groups.items():
            table = pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA.names} for r in group], schema=SCHEMA)
            published.append(self._publish(self.partition(definition, sweep), table))
        return published

    def _publish(self, folder: Path, table: pa.Table, replaces: tuple[str, ...] = (),
                 published_ns: Optional[int] = None) -> Path:
        try:
            _mkdirs(folder)
        except OSError as e:
            raise StoreError(f"store.root: cannot create {folder}: {e.strerror}") from None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        name = f"part-{stamp}-{uuid.uuid4().hex[:12]}.parquet"
        tmp = folder / f".{name}.tmp"
        try:
            pq.write_table(table, tmp, compression="zstd")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, folder / name)
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        manifest.record(self.root, folder / name, table.num_rows, replaces, published_ns)
        return folder / name

    def published(self, sweep: Optional[str] = None, definition: Optional[str] = None) -> list[manifest.Published]:
        """Files the driver published (optionally of one sweep and/or definition), in publication
        order; any other file under a partition is ignored (`ignored` lists them) with a warning."""
        d = f"definition={_enc(definition)}" if definition else "definition=*"
        s = f"sweep={_enc(sweep)}" if sweep else "sweep=*"
        out, self.ignored = [], []
        for folder in sorted(p for p in self.root.glob(f"{d}/{s}") if p.is_dir()):
            verdict = manifest.verify(self.root, folder)
            out += verdict.files
            self.ignored += verdict.ignored
        manifest.warn_ignored(self.root, self.ignored)
        return sorted(out, key=lambda p: (p.published_ns, str(p.path.parent), p.line))

    def files(self, sweep: Optional[str] = None, definition: Optional[str] = None) -> list[Path]:
        """Published Parquet files, optionally of one sweep and/or definition, in publication order."""
        return [p.path for p in self.published(sweep, definition)]

    def read(self, sweep: Optional[str] = None, columns: Optional[list[str]] = None) -> pa.Table:
        """Rows as an Arrow table (partition columns included), with pyarrow only."""
        tables = []
        wanted = [c for c in (columns or SCHEMA.names) if c not in PARTITION_COLUMNS]
        for path in self.files(sweep=sweep):
            t = _read_columns(path, wanted)
            parts = dict(p.split("=", 1) for p in (path.parent.parent.name, path.parent.name))
            for col in PARTITION_COLUMNS:
                if columns is None or col in columns:
                    t = t.append_column(col, pa.array([unquote(parts[col])] * t.num_rows, pa.string()))
            tables.append(t)
        if not tables:
            schema = pa.schema([pa.field(c, pa.string()) for c in PARTITION_COLUMNS if columns is None or c in columns]
                               + [SCHEMA.field(c) for c in wanted])
            return schema.empty_table()
        return pa.concat_tables(tables)

    def job_ids(self, sweep: Optional[str] = None) -> set[str]:
        """Ids of the jobs already recorded (the ledger)."""
        return set(self.read(sweep=sweep, columns=["job_id"]).column("job_id").to_pylist())

    def sweep_salt(self, sweep: str, adopt: Optional[bytes] = None) -> bytes:
        """The sweep's secret input salt: drawn at random when the sweep first runs, kept for its
        resumes in `_secrets/sweep=<s>` (mode 0600, in a 0700 folder: the driver's, unreadable to
        executors that run as other users). Call it holding the sweep's lock. `adopt` gives a sweep
        that has none yet another's salt (two sweeps that must see the same inputs)."""
        folder = self.root / "_secrets"
        path = folder / f"sweep={_enc(sweep)}"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)
            try:
                salt = path.read_bytes()
            except FileNotFoundError:
                tmp = folder / f".{path.name}.{uuid.uuid4().hex}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(adopt if adopt is not None else os.urandom(32))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                salt = path.read_bytes()
        except OSError as e:
            raise StoreError(f"store.root: cannot keep the sweep's input salt in {folder}: {e.strerror}") from None
        if len(salt) != 32:
            raise StoreError(f"{path}: not a sweep input salt ({len(salt)} bytes, expected 32); remove it to draw a new one")
        if adopt is not None and salt != adopt:
            raise StoreError(f"{path}: sweep {sweep!r} already has a different input salt")
        return salt

    @contextlib.contextmanager
    def lock(self, sweep: str) -> Iterator[None]:
        """Hold the single-writer lock of a sweep; a second driver fails at once."""
        lock_dir = self.root / "_locks"
        try:
            _mkdirs(lock_dir)
        except OSError as e:
            raise StoreError(f"store.root: cannot create {lock_dir}: {e.strerror}") from None
        path = lock_dir / f"{_enc(sweep)}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                raise StoreError(f"sweep {sweep!r} is already being run by another driver ({holder or 'unknown'}) on {self.root}") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
            # a driver killed while it wrote a file left its temporary behind: only this sweep's
            # lock holder writes these partitions, so none of them is being written now
            for tmp in self.root.glob(f"definition=*/sweep={_enc(sweep)}/.part-*.parquet.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            yield
        finally:
            os.close(fd)


def _read_columns(path: Path, wanted: list[str]) -> pa.Table:
    """Some columns of one file, in order; a column newer than the file (e.g. `split`) reads as nulls."""
    present = set(pq.read_schema(path).names)
    t = pq.read_table(path, columns=[c for c in wanted if c in present])
    for c in wanted:
        if c not in present:
            t = t.append_column(SCHEMA.field(c), pa.nulls(t.num_rows, SCHEMA.field(c).type))
    return t.select(wanted)


def scan(root: str | Path):
    """A Polars LazyFrame over every published row of the store (hive partition columns as
    strings), rows in publication order: the last row of a unit is the last one published."""
    import polars as pl

    files = TraceStore(root).files()
    if not files:
        empty = pa.schema([pa.field(c, pa.string()) for c in PARTITION_COLUMNS] + list(SCHEMA)).empty_table()
        return pl.from_arrow(empty).lazy()
    # only the partition folders: _promotions/ and other side tables are not evaluations; files
    # written before a column existed read it as nulls
    return pl.scan_parquet(
        [str(f) for f in files], hive_partitioning=True, schema=_polars_schema(),
        missing_columns="insert", hive_schema={"definition": pl.String, "sweep": pl.String},
    )


def _polars_schema():
    import polars as pl

    return pl.from_arrow(SCHEMA.empty_table()).schema
