"""The agent loop's records: what each round's generator proposed (round files) and what the store says of it.

A round file, `<store>/_evolve/<run_id>/<definition>/round-NNNN.json`, is written (atomically) before
the round's candidates are evaluated, so a loop killed mid-round re-evaluates the same candidates
instead of asking the generator again; the evaluations themselves live only in the trace store.
Feedback is computed from public rows only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import quote

from pydantic import Field

from fibray.schema import Solution
from fibray.schema._base import Model

__all__ = ["Candidate", "Ledger", "RoundRecord", "candidate_feedback", "geomean"]

LEDGER_DIR = "_evolve"
"""Folder under the store root holding every run's round files."""


class Candidate(Model):
    """One solution a round proposed, and the one it was derived from."""

    solution: Solution
    """The candidate as evaluated (a raw KernelBench ModelNew already wrapped)."""
    parent: Optional[str] = None
    """Name of the solution it was derived from (the generator's say, else the best so far)."""


class RoundRecord(Model):
    """What one round of one definition produced, before evaluation."""

    round: int = Field(ge=1)
    """The round (1..R)."""
    generator: str
    """The generator's name (the store's `generator` column)."""
    status: str = "ok"
    """ok, or the GeneratorReason that cost the round."""
    error: Optional[str] = None
    """One line saying what went wrong with the generator."""
    stderr: str = ""
    """The generator's stderr or traceback, bounded."""
    seconds: float = 0.0
    """Wall time of the generation, seconds."""
    candidates: list[Candidate] = Field(default_factory=list)
    """What is evaluated."""
    rejected: list[dict[str, Any]] = Field(default_factory=list)
    """Items that were not valid solutions of the definition, or over budget: {index, reason, error}."""


class Ledger:
    """The round files of one run."""

    def __init__(self, store_root: str | Path, run_id: str) -> None:
        self.root = Path(store_root) / LEDGER_DIR / quote(run_id, safe="")

    def _folder(self, definition: str) -> Path:
        return self.root / quote(definition, safe="")

    def rounds(self, definition: str) -> list[RoundRecord]:
        """Every recorded round of a definition, in order."""
        folder = self._folder(definition)
        files = sorted(folder.glob("round-*.json")) if folder.is_dir() else []
        return [RoundRecord.model_validate_json(p.read_text(encoding="utf-8")) for p in files]

    def write(self, definition: str, record: RoundRecord) -> Path:
        folder = self._folder(definition)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"round-{record.round:04d}.json"
        tmp = folder / f".{path.name}.tmp"
        tmp.write_text(json.dumps(record.model_dump(mode="json"), indent=1) + "\n", encoding="utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def meta(self) -> dict[str, Any]:
        """The run's description as first written, or {} for a new run."""
        path = self.root / "run.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        """The run's description (config, split): written once, kept as first written."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "run.json"
        if not path.exists():
            tmp = self.root / ".run.json.tmp"
            tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, path)


def geomean(values: list[float]) -> Optional[float]:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and all(v > 0 for v in values) else None


def _excerpt(text: Optional[str], limit: int) -> Optional[str]:
    if not text:
        return text
    return text if len(text) <= limit else text[: limit // 2] + f"\n[... {len(text) - limit} characters cut ...]\n" + text[-limit // 2:]


def candidate_feedback(candidate: Candidate, rows: list[dict[str, Any]], n_public: int, log_chars: int) -> dict[str, Any]:
    """What the generator learns of one candidate: overall status, reason, a bounded log, per-workload
    latency and speedup, and the geomean speedup when it passed every public workload."""
    rows = sorted((r for r in rows if (r.get("split") or "public") == "public"), key=lambda r: r["workload_uuid"])
    failed = [r for r in rows if r["status"] != "PASSED"]
    passed_all = len(rows) == n_public and not failed
    speedups = [r["speedup"] for r in rows if r["speedup"]]
    return {
        "solution": candidate.solution.name, "parent": candidate.parent, "description": candidate.solution.description,
        "status": "PASSED" if passed_all else (failed[0]["status"] if failed else "PENDING"),
        "reason": failed[0]["reason"] if failed else None,
        "log": _excerpt(failed[0]["log"], log_chars) if failed else None,
        "speedup": geomean(speedups) if passed_all and len(speedups) == len(rows) else None,
        "workloads": [{"uuid": r["workload_uuid"], "axes": json.loads(r["axes"]), "status": r["status"],
                       "reason": r["reason"], "latency_ms": r["latency_ms"],
                       "reference_latency_ms": r["reference_latency_ms"], "speedup": r["speedup"]} for r in rows],
    }
