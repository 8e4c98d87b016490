"""Load and validate a FlashInfer Trace dataset folder.

Layout: definitions/**.json, solutions/**.json, workloads/**.jsonl, blob/**.safetensors,
traces/**.jsonl, and fibray's sidecar splits/**.json (workload uuid -> public|hidden|replay).
Every problem is reported as a DatasetError naming the file (and line) and the field;
loading never writes anything.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from fibray.dataset.splits import read_splits
from fibray.schema import Definition, SafetensorsInput, Solution, Split, Trace, Workload

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class DatasetError(ValueError):
    """A dataset file is missing, malformed or inconsistent. The message names file and field."""


def _where(path: Path, line: Optional[int] = None) -> str:
    return f"{path}:{line}" if line is not None else str(path)


def _format_validation(e: ValidationError) -> str:
    """'field.path: message' for each error; validator messages that name a sub-field are joined."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if loc and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", head) and ":" in msg:
            parts.append(f"{loc}.{msg}")  # e.g. spec + 'entry_point: ...' -> spec.entry_point: ...
        elif loc:
            parts.append(f"{loc}: {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


def parse_model(model: type[M], text: str, where: str) -> M:
    """Parse JSON text into a model, raising DatasetError that names `where` and the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise DatasetError(f"{where}: {_format_validation(e)}") from None


def read_json(model: type[M], path: Path) -> M:
    """Read one JSON file into a model."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    return parse_model(model, text, str(path))


def read_jsonl(model: type[M], path: Path) -> list[tuple[int, M]]:
    """Read a JSONL file into (line number, model) pairs; blank lines are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    return [
        (i, parse_model(model, line, _where(path, i)))
        for i, line in enumerate(lines, start=1)
        if line.strip()
    ]


@dataclass
class Dataset:
    """A validated dataset: definitions, solutions, workloads and traces, by name."""

    root: Path
    definitions: dict[str, Definition] = field(default_factory=dict)
    solutions: dict[str, Solution] = field(default_factory=dict)
    workloads: dict[str, list[Workload]] = field(default_factory=dict)
    traces: list[Trace] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """'definition:NAME' / 'solution:NAME' / 'workload:UUID' -> file[:line] it came from."""
    splits: dict[str, Split] = field(default_factory=dict)
    """Workload uuid -> split, as the splits/ sidecar lists it (unlisted workloads are public)."""

    def split_of(self, uuid: str) -> Split:
        """The split of a workload: what splits/ says, else public."""
        return self.splits.get(uuid, Split.PUBLIC)
    name: str = ""
    """The dataset's name: its root folder's name."""
    hash: str = ""
    """sha256 of every definition and workload file of the dataset (paths and bytes), whatever was selected."""

    def solutions_for(self, definition: str) -> list[Solution]:
        """Solutions of one definition, by name."""
        return sorted((s for s in self.solutions.values() if s.definition == definition), key=lambda s: s.name)


def _files(folder: Path, pattern: str) -> list[Path]:
    return sorted(p for p in folder.glob(pattern) if p.is_file()) if folder.is_dir() else []


def content_hash(root: Path) -> str:
    """sha256 over definitions/**.json and workloads/**.jsonl (relative path and bytes of each, sorted).

    Filters (definitions, workload_set, ...) do not change it: it names the dataset, not the selection.
    """
    h = hashlib.sha256()
    for path in [*_files(root / "definitions", "**/*.json"), *_files(root / "workloads", "**/*.jsonl")]:
        rel = path.relative_to(root).as_posix().encode()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _unknown_name(kind: str, name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown {kind} {name!r}{hint}"


def load_dataset(
    root: str | Path,
    *,
    definitions: Optional[Sequence[str]] = None,
    solution_roots: Sequence[str | Path] = (),
    solutions: Optional[Sequence[str]] = None,
    workload_set: Optional[str] = None,
    max_workloads_per_definition: Optional[int] = None,
    require_blobs: bool = True,
    split: Optional[str] = None,
) -> Dataset:
    """Load a dataset folder plus extra solution folders, validated and filtered.

    definitions: keep only these definition names (each must exist).
    solution_roots: more folders whose **/*.json are Solutions (beside root/solutions).
    solutions: keep only these solution names.
    workload_set: read workloads from workloads/<workload_set>/ only.
    max_workloads_per_definition: keep the first N workloads of each definition (file order).
    require_blobs: fail when a kept workload names a safetensors blob that is not there.
    split: keep only workloads of this split (public, hidden, replay); None or "all" keeps every one.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: dataset root is not a directory")
    ds = Dataset(root=root, name=root.resolve().name, hash=content_hash(root))
    if split not in (None, "all") and split not in {s.value for s in Split}:
        raise DatasetError(f"dataset.split: must be one of all, {', '.join(s.value for s in Split)} (got {split!r})")
    ds.splits, split_origin = read_splits(root, DatasetError)

    for path in _files(root / "definitions", "**/*.json"):
        d = read_json(Definition, path)
        key = f"definition:{d.name}"
        if key in ds.origin:
            raise DatasetError(f"{path}: name: duplicate definition {d.name!r} (also in {ds.origin[key]})")
        ds.definitions[d.name] = d
        ds.origin[key] = str(path)
    if not ds.definitions:
        raise DatasetError(f"{root / 'definitions'}: no definition files (*.json) found")

    if definitions is not None:
        for name in definitions:
            if name not in ds.definitions:
                raise DatasetError(f"dataset.definitions: {_unknown_name('definition', name, ds.definitions)} in {root}")
        ds.definitions = {n: ds.definitions[n] for n in definitions}

    workload_dir = root / "workloads" / workload_set if workload_set else root / "workloads"
    if workload_set and not workload_dir.is_dir():
        raise DatasetError(f"dataset.workload_set: {workload_dir} does not exist")
    seen_uuid: dict[str, str] = {}
    all_definition_names = {k.split(":", 1)[1] for k in ds.origin if k.startswith("definition:")}
    for path in _files(workload_dir, "**/*.jsonl"):
        for line, trace in read_jsonl(Trace, path):
            where = _where(path, line)
            if trace.definition not in all_definition_names:
                raise DatasetError(f"{where}: definition: {_unknown_name('definition', trace.definition, all_definition_names)}")
            if trace.workload.uuid in seen_uuid:
                raise DatasetError(f"{where}: workload.uuid: duplicate {trace.workload.uuid!r} (also at {seen_uuid[trace.workload.uuid]})")
            seen_uuid[trace.workload.uuid] = where
            if trace.definition not in ds.definitions:
                continue
            _check_workload(ds.definitions[trace.definition], trace.workload, where)
            ds.workloads.setdefault(trace.definition, []).append(trace.workload)
            ds.origin[f"workload:{trace.workload.uuid}"] = where

    stray = sorted(set(ds.splits) - set(seen_uuid)) if workload_set is None else []
    if stray:
        log.warning("%s: %d workload uuid(s) name no workload of %s (first: %s)", split_origin[stray[0]], len(stray),
                    root, stray[0])
    if split not in (None, "all"):
        ds.workloads = {k: kept for k, v in ds.workloads.items() if (kept := [w for w in v if ds.split_of(w.uuid) == split])}
    if max_workloads_per_definition is not None:
        ds.workloads = {k: v[:max_workloads_per_definition] for k, v in ds.workloads.items()}
    for name, wls in ds.workloads.items():
        for w in wls if require_blobs else ():
            _check_blobs(root, w, ds.origin[f"workload:{w.uuid}"])

    roots = [root / "solutions", *(Path(r) for r in solution_roots)]
    for sroot in roots[1:]:
        if not Path(sroot).is_dir():
            raise DatasetError(f"solutions.roots: {sroot} is not a directory")
    for sroot in roots:
        for path in _files(Path(sroot), "**/*.json"):
            s = read_json(Solution, path)
            key = f"solution:{s.name}"
            if key in ds.origin:
                raise DatasetError(f"{path}: name: duplicate solution {s.name!r} (also in {ds.origin[key]})")
            ds.origin[key] = str(path)
            if s.definition not in all_definition_names:
                log.warning("%s: solution %r is for definition %r, which %s does not have; skipped", path, s.name, s.definition, root)
                continue
            if s.definition in ds.definitions:
                ds.solutions[s.name] = s
    if solutions is not None:
        for name in solutions:
            if name not in ds.solutions:
                raise DatasetError(f"solutions.names: {_unknown_name('solution', name, ds.solutions)}")
        ds.solutions = {n: ds.solutions[n] for n in solutions}

    for path in _files(root / "traces", "**/*.jsonl"):
        ds.traces.extend(t for _, t in read_jsonl(Trace, path))
    return ds


def _check_workload(d: Definition, w: Workload, where: str) -> None:
    missing_axes = [a for a in d.var_axes if a not in w.axes]
    if missing_axes:
        raise DatasetError(f"{where}: workload.axes: missing var axes {missing_axes} of definition {d.name!r}")
    unknown = [n for n in w.inputs if n not in d.inputs]
    if unknown:
        raise DatasetError(f"{where}: workload.inputs: {unknown} are not inputs of definition {d.name!r} ({list(d.inputs)})")
    for name, spec in d.inputs.items():
        src = w.inputs.get(name)
        if spec.shape is None and (src is None or src.type == "random") and spec.dtype.value.startswith(("float8", "float4")):
            raise DatasetError(f"{where}: workload.inputs.{name}: a low-bit scalar cannot be random")


def _check_blobs(root: Path, w: Workload, where: str) -> None:
    for name, src in w.inputs.items():
        if isinstance(src, SafetensorsInput) and not (root / src.path).is_file():
            raise DatasetError(
                f"{where}: workload.inputs.{name}.path: safetensors blob {src.path!r} not found under {root}"
            )
