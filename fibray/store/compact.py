"""Compaction: merge a closed partition's small files into one, rows unchanged.

The merged file is published like any other (temporary name, fsync, rename) and records
the files it replaces in its Parquet metadata; the old files are removed only after the
new one is in place and read back equal. A compaction killed between the two steps
leaves duplicates that the next compaction (or `recover`) removes, never lost rows.
It holds the sweep's writer lock, so it never runs beside the sweep that writes there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from fibray.store.columns import SCHEMA
from fibray.store.writer import StoreError, TraceStore

# Parquet key-value metadata listing the file names a compacted file replaces.
REPLACES_KEY = b"fibray.compacted_from"


@dataclass(frozen=True)
class CompactionResult:
    """What one partition's compaction did."""

    definition: str
    sweep: str
    rows: int
    """Rows in the partition, before and after."""
    files_before: int
    files_after: int
    new_file: Optional[Path] = None
    """The merged file; None when there was nothing to merge."""
    removed: list[Path] = field(default_factory=list)


def _replaces(path: Path) -> list[str]:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[REPLACES_KEY]) if REPLACES_KEY in meta else []


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(paths: list[Path]) -> list[Path]:
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        _fsync_dir(removed[0].parent)
    return removed


def recover(store: TraceStore, definition: str, sweep: str) -> list[Path]:
    """Remove files that a completed merge already replaced (left by a killed compaction)."""
    files = store.files(sweep=sweep, definition=definition)  # only published files say what they replaced
    names = {p.name for p in store.partition(definition, sweep).glob("*.parquet")}
    stale = [p for f in files for name in _replaces(f) if name in names and name != f.name
             for p in [f.parent / name]]
    return _remove(sorted(set(stale)))


def compact_partition(store: TraceStore, definition: str, sweep: str) -> CompactionResult:
    """Merge every file of one partition into one new file; the rows and their order stay the same."""
    with store.lock(sweep):
        recovered = recover(store, definition, sweep)
        published = store.published(sweep=sweep, definition=definition)
        files = [p.path for p in published]
        if len(files) < 2:
            rows = pq.read_metadata(files[0]).num_rows if files else 0
            return CompactionResult(definition, sweep, rows, len(files), len(files), None, recovered)
        # in publication order; the merged file takes the place of the last of them in that order
        merged = pa.concat_tables([pq.read_table(p, schema=SCHEMA) for p in files])
        merged = merged.replace_schema_metadata({REPLACES_KEY: json.dumps([p.name for p in files]).encode()})
        new_file = store._publish(store.partition(definition, sweep), merged, replaces=tuple(p.name for p in files),
                                  published_ns=max(p.published_ns for p in published))
        if not pq.read_table(new_file, schema=SCHEMA).equals(merged.replace_schema_metadata(None)):
            new_file.unlink()
            raise StoreError(f"compaction of {store.partition(definition, sweep)}: merged file read back different; kept the originals")
        removed = _remove(files)
        return CompactionResult(definition, sweep, merged.num_rows, len(files), 1, new_file, recovered + removed)


def partitions(store: TraceStore, sweep: Optional[str] = None, definition: Optional[str] = None) -> list[tuple[str, str]]:
    """(definition, sweep) of every partition that holds files, optionally filtered."""
    keys = {(unquote(p.parent.parent.name.split("=", 1)[1]), unquote(p.parent.name.split("=", 1)[1]))
            for p in store.files(sweep=sweep, definition=definition)}
    return sorted(keys)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m fibray.store.compact --store ROOT --sweep S [--definition D]`."""
    parser = argparse.ArgumentParser(prog="python -m fibray.store.compact",
                                     description="Merge a closed sweep's small Parquet files, one file per partition.")
    parser.add_argument("--store", required=True, help="store root")
    parser.add_argument("--sweep", required=True, help="sweep to compact (must not be running)")
    parser.add_argument("--definition", help="only this definition (default: every definition of the sweep)")
    args = parser.parse_args(argv)
    store = TraceStore(args.store)
    if not store.root.is_dir():
        print(f"fibray.store.compact: error: store {store.root} does not exist", file=sys.stderr)
        return 2
    targets = partitions(store, sweep=args.sweep, definition=args.definition)
    if not targets:
        what = f"sweep {args.sweep!r}" + (f", definition {args.definition!r}" if args.definition else "")
        print(f"fibray.store.compact: error: no files for {what} in {store.root}", file=sys.stderr)
        return 2
    try:
        rows = merged = 0
        for definition, sweep in targets:
            r = compact_partition(store, definition, sweep)
            wrote = f"; wrote {r.new_file}" if r.new_file else "; already one file, nothing written"
            print(f"{definition}/{sweep}: {r.rows} rows, {r.files_before} -> {r.files_after} files{wrote}")
            rows, merged = rows + r.rows, merged + (r.new_file is not None)
        print(f"compacted {merged} of {len(targets)} partition(s) of sweep {args.sweep!r} ({rows} rows, unchanged) "
              f"in {store.root.resolve()}")
    except StoreError as e:
        print(f"fibray.store.compact: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
