"""The dispatch index: which verified solution is fastest for each (definition, var-axis values).

Built once, from store rows read with pyarrow only (no Polars on the serving path). A row
counts only if it PASSED within the configured tolerances, ran on this hardware and
library stack, and still describes the loaded definition and solution (its job id is
recomputed). A solution that failed at a key in a compatible environment is never
chosen for that key, whatever it did elsewhere, nor for any key that was not measured.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fibray.apply.compat import incompatibility
from fibray.apply.config import ApplyConfig
from fibray.schema import (
    Definition,
    Environment,
    EvaluationStatus,
    Solution,
    content_hash,
)
from fibray.schema.job import settings_for_id
from fibray.store import TraceStore

Key = tuple[int, ...]
"""Var-axis values in the definition's var-axis order."""

INDEX_COLUMNS = [
    "definition", "sweep", "job_id", "workload", "axes", "solution", "solution_hash", "status",
    "max_abs_error", "latency_ms", "speedup", "hardware", "libs", "settings",
]


@dataclass(frozen=True)
class Candidate:
    """A verified solution at one key, with its measured latency."""

    solution: Solution
    latency_ms: float
    """Median over the compatible PASSED evaluations at this key of their median latency, ms."""
    evaluations: int
    """How many evaluations the latency summarises (>= 1)."""


@dataclass
class DefinitionIndex:
    """Ranked candidates (fastest first) per measured key of one definition."""

    definition: Definition
    ranked: dict[Key, list[Candidate]] = field(default_factory=dict)
    """Key -> candidates that passed there, fastest first."""
    failed: dict[Key, set[str]] = field(default_factory=dict)
    """Key -> hashes of solutions that failed there (never used there, nor for unmeasured keys)."""


@dataclass
class IndexReport:
    """What happened to the store rows while the index was built."""

    rows: int = 0
    """Rows read."""
    used: int = 0
    """PASSED rows that entered the ranking."""
    rejected: Counter[str] = field(default_factory=Counter)
    """Reason -> rows left out (incompatible_hardware, incompatible_torch, outside_tolerance, ...)."""


def read_rows(store: str | Path | TraceStore, sweeps: list[str] | None = None) -> list[dict[str, Any]]:
    """The store rows the index needs, as dicts (pyarrow only)."""
    store = store if isinstance(store, TraceStore) else TraceStore(store)
    if sweeps is None:
        return store.read(columns=INDEX_COLUMNS).to_pylist()
    return [row for sweep in sweeps for row in store.read(sweep=sweep, columns=INDEX_COLUMNS).to_pylist()]


def _tolerance_ok(row: dict[str, Any], definition: Definition, settings: dict[str, Any], config: ApplyConfig) -> bool:
    """Whether a PASSED row guarantees |y - ref| <= max_atol + max_rtol * |ref| everywhere."""
    check = definition.check
    kind = check.kind if check else "elementwise"
    atol = check.atol if check and check.atol is not None else settings.get("atol")
    rtol = check.rtol if check and check.rtol is not None else settings.get("rtol")
    if kind == "elementwise" and atol is not None and rtol is not None and atol <= config.max_atol \
            and rtol <= config.max_rtol:
        return True
    max_abs = row.get("max_abs_error")
    # the measured worst error, if small enough, proves the bound whatever the check was
    return kind in ("elementwise", "matched_ratio") and max_abs is not None and max_abs <= config.max_atol


def build_index(
    rows: Iterable[dict[str, Any]],
    definitions: Mapping[str, Definition],
    solutions: Iterable[Solution],
    running: Environment,
    config: ApplyConfig,
) -> tuple[dict[str, DefinitionIndex], IndexReport]:
    """Rank, per definition and key, the solutions whose evaluations hold here."""
    report = IndexReport()
    by_hash = {s.hash: s for s in solutions}
    wanted = set(config.definitions) if config.definitions is not None else None
    sweeps = set(config.sweeps) if config.sweeps is not None else None
    def_json = {name: d.to_json_dict() for name, d in definitions.items()}
    latencies: dict[tuple[str, Key, str], list[float]] = defaultdict(list)
    failed: set[tuple[str, Key, str]] = set()

    for row in rows:
        report.rows += 1
        name = row["definition"]
        definition = definitions.get(name)
        solution = by_hash.get(row["solution_hash"])
        reason = None
        if definition is None or (wanted is not None and name not in wanted):
            reason = "definition_not_selected"
        elif sweeps is not None and row["sweep"] not in sweeps:
            reason = "sweep_not_selected"
        elif solution is None or solution.definition != name:
            reason = "solution_not_loaded"
        else:
            reason = incompatibility(
                row["hardware"], json.loads(row["libs"] or "{}"), running, want_hardware=config.hardware,
                match_libs=config.match_libs, version_match=config.version_match,
            )
        if reason is None:
            settings = json.loads(row["settings"])
            workload = json.loads(row["workload"])
            expected_id = content_hash(def_json[name], workload, row["solution"], solution.hash,
                                       settings_for_id(settings))
            if expected_id != row["job_id"]:
                reason = "stale"  # the definition, workload or settings changed since the evaluation
        if reason is not None:
            report.rejected[reason] += 1
            continue
        axes = json.loads(row["axes"])
        try:
            key = tuple(int(axes[a]) for a in definition.var_axes)
        except KeyError:
            report.rejected["missing_axes"] += 1
            continue
        slot = (name, key, solution.hash)
        if row["status"] != EvaluationStatus.PASSED.value:
            failed.add(slot)
            report.rejected["failed"] += 1
        elif not _tolerance_ok(row, definition, settings, config):
            report.rejected["outside_tolerance"] += 1
        elif row["latency_ms"] is None or not row["latency_ms"] > 0:
            report.rejected["no_latency"] += 1
        elif config.min_speedup is not None and not (row["speedup"] or 0.0) >= config.min_speedup:
            report.rejected["below_min_speedup"] += 1
        else:
            latencies[slot].append(float(row["latency_ms"]))
            report.used += 1

    index: dict[str, DefinitionIndex] = {}
    for name, key, sol_hash in failed:
        index.setdefault(name, DefinitionIndex(definitions[name])).failed.setdefault(key, set()).add(sol_hash)
    for (name, key, sol_hash), values in latencies.items():
        if (name, key, sol_hash) in failed:  # the solution failed at that key: never served there
            continue
        entry = index.setdefault(name, DefinitionIndex(definitions[name]))
        entry.ranked.setdefault(key, []).append(Candidate(by_hash[sol_hash], statistics.median(values), len(values)))
    for entry in index.values():
        for cands in entry.ranked.values():
            cands.sort(key=lambda c: (c.latency_ms, c.solution.name))
    return index, report
