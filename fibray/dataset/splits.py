"""Read the workload-split sidecar of a dataset: `splits/**/*.json`, each a JSON object uuid -> split.

The FlashInfer Trace layout has no notion of splits, so they live in their own folder, which
flashinfer-bench does not read: the dataset stays loadable there unchanged. A workload that
no file lists is public. Reading never writes; a bad file is one DatasetError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from fibray.schema import Split

SPLITS_DIR = "splits"
"""Folder under the dataset root holding the split files (conventionally splits/<definition>.json)."""

SPLIT_NAMES = tuple(s.value for s in Split)


def split_files(root: Path) -> list[Path]:
    """The split files of a dataset, in a stable order."""
    folder = Path(root) / SPLITS_DIR
    return sorted(p for p in folder.glob("**/*.json") if p.is_file()) if folder.is_dir() else []


def read_splits(root: Path, error: type[Exception] = ValueError) -> tuple[dict[str, Split], dict[str, str]]:
    """(workload uuid -> split, workload uuid -> file that assigned it) over every split file.

    A uuid that two files assign differently, a value that is not a split, or a file that is
    not a JSON object of strings raises `error` naming the file and the uuid.
    """
    splits: dict[str, Split] = {}
    where: dict[str, str] = {}
    for path in split_files(root):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise error(f"{path}: cannot read: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise error(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(raw, dict):
            raise error(f"{path}: expected a JSON object of workload uuid -> split, got {type(raw).__name__}")
        for uuid, value in raw.items():
            if value not in SPLIT_NAMES:
                raise error(f"{path}: {uuid}: split must be one of {', '.join(SPLIT_NAMES)} (got {value!r})")
            split = Split(value)
            if uuid in splits and splits[uuid] is not split:
                raise error(f"{path}: {uuid}: split {value!r} conflicts with {splits[uuid].value!r} in {where[uuid]}")
            splits[uuid], where[uuid] = split, str(path)
    return splits, where
