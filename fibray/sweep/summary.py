"""The summary a sweep prints at its end: per (definition, solution), then what could not run here.

Reads the store with pyarrow only. Environment-limited rows (no GPU for a CUDA candidate,
Triton too slow under the CPU interpreter) are listed apart, never counted against a
solution; speedups timed by wall clock on a CPU are shown in parentheses, as not meaningful.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from fibray.schema import EvaluationStatus
from fibray.schema.reasons import Reason
from fibray.store import TraceStore
from fibray.store.columns import describe_timing_mode

_COLUMNS = ["definition", "solution", "author", "language", "status", "reason", "speedup", "latency_ms",
            "timing_mode", "hardware", "environment_limited", "dataset_name", "split"]

CPU_SPEEDUP_NOTE = ("speedups in parentheses were timed by wall clock on a CPU{triton}: not meaningful; "
                    "time on a GPU for real speedups")


def cpu_timed(row: dict) -> bool:
    """A row timed on a CPU (wall clock), whose speedup says nothing about a GPU kernel."""
    return (row.get("hardware") or "").startswith("cpu") or (row.get("timing_mode") or "").startswith("wall_clock")


def _rows(store: TraceStore, sweep: str) -> list[dict]:
    return store.read(sweep=sweep, columns=_COLUMNS).to_pylist()


def _in_splits(row: dict, splits: Optional[tuple[str, ...]]) -> bool:
    return splits is None or (row.get("split") or "public") in splits


def summary_rows(store: TraceStore, sweep: str, splits: Optional[tuple[str, ...]] = ("public",)) -> list[dict]:
    """Per (definition, solution) of judged rows: passed/total, geomean speedup over passed workloads,
    and whether its speedups were timed on a CPU.

    This is feedback (what a sweep tells the candidates' authors), so by default it counts
    public workloads only (rows from before splits count as public); splits=None counts all.
    """
    groups: dict[tuple[str, str], dict] = {}
    for r in _rows(store, sweep):
        if r.get("environment_limited") or not _in_splits(r, splits):
            continue
        g = groups.setdefault((r["definition"], r["solution"]), {
            "definition": r["definition"], "solution": r["solution"], "author": r["author"],
            "language": r["language"], "passed": 0, "total": 0, "_logs": [], "statuses": Counter(),
            "cpu_timing": False})
        g["total"] += 1
        g["statuses"][r["status"]] += 1
        if r["status"] == EvaluationStatus.PASSED.value:
            g["passed"] += 1
            g["cpu_timing"] = g["cpu_timing"] or cpu_timed(r)
            if r["speedup"]:
                g["_logs"].append(math.log(r["speedup"]))
    out = []
    for key in sorted(groups):
        g = groups[key]
        logs = g.pop("_logs")
        g["geomean_speedup"] = math.exp(sum(logs) / len(logs)) if logs else None
        g["statuses"] = dict(g["statuses"])
        out.append(g)
    return out


def limited_rows(store: TraceStore, sweep: str) -> list[dict]:
    """Per (definition, solution) of environment-limited rows: how many, and why."""
    groups: dict[tuple[str, str], dict] = {}
    for r in _rows(store, sweep):
        if r.get("environment_limited") and _in_splits(r, ("public",)):
            g = groups.setdefault((r["definition"], r["solution"]), {
                "definition": r["definition"], "solution": r["solution"], "author": r["author"],
                "language": r["language"], "count": 0, "reasons": Counter()})
            g["count"] += 1
            g["reasons"][limited_why(r["reason"])] += 1
    return [groups[k] for k in sorted(groups)]


def limited_why(reason: str) -> str:
    """Why an environment-limited row could not run here, in words."""
    if reason == Reason.DEVICE_REQUIRED:
        return "needs a GPU, this machine has none"
    if reason == Reason.RUN_TIMEOUT:
        return "Triton interpreter on CPU slower than eval.run_deadline_s"
    return reason


def _table(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*b).rstrip() for b in body)]


def format_summary(rows: list[dict]) -> str:
    """The summary table as aligned text; CPU-timed speedups in parentheses."""
    body = []
    for r in rows:
        speed = f"{r['geomean_speedup']:.3f}x" if r["geomean_speedup"] else "-"
        if r["geomean_speedup"] and r.get("cpu_timing"):
            speed = f"({speed})"
        body.append((r["definition"], r["solution"], r["author"], r["language"], f"{r['passed']}/{r['total']}", speed,
                     ", ".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items()))))
    return "\n".join(_table(("definition", "solution", "author", "lang", "passed", "geomean_speedup", "statuses"), body))


def timing_line(store: TraceStore, sweep: str) -> str:
    """How the sweep's PASSED rows were timed: 'timing: wall clock on cpu-x86_64 (Triton interpreted)'."""
    seen: dict[tuple[str, str], set[str]] = {}
    for r in _rows(store, sweep):
        if r["status"] == EvaluationStatus.PASSED.value and r.get("timing_mode"):
            seen.setdefault((r["timing_mode"], r.get("hardware") or "unknown"), set()).add(r["language"])
    parts = []
    for (mode, hardware), languages in sorted(seen.items()):
        interpreted = " (Triton interpreted)" if hardware.startswith("cpu") and "triton" in languages else ""
        parts.append(f"{describe_timing_mode(mode)} on {hardware}{interpreted}")
    return "timing: " + ("; ".join(parts) if parts else "nothing timed")


def sweep_summary(store: TraceStore, sweep: str) -> str:
    """The whole end-of-sweep text: timing mode, the table, the note on CPU speedups, then what could not run."""
    rows = summary_rows(store, sweep)
    out = [timing_line(store, sweep), format_summary(rows)]
    cpu = [r for r in rows if r.get("cpu_timing") and r["geomean_speedup"]]
    if cpu:
        triton = " (Triton interpreted)" if any(r["language"] == "triton" for r in cpu) else ""
        out.append("note: " + CPU_SPEEDUP_NOTE.format(triton=triton))
    held_back = summary_rows(store, sweep, splits=("hidden", "replay"))
    if held_back:  # stored and reported (python -m fibray.promote --report), never fed back here
        passed, total = sum(r["passed"] for r in held_back), sum(r["total"] for r in held_back)
        out.append(f"hidden/replay workloads: {total} evaluations recorded ({passed} PASSED), not shown in this summary")
    limited = limited_rows(store, sweep)
    if limited:
        n = sum(g["count"] for g in limited)
        out += ["", f"could not run here ({n} evaluations; not charged to their authors, left out of the table above):"]
        out += _table(("definition", "solution", "author", "lang", "evaluations", "why"), [
            (g["definition"], g["solution"], g["author"], g["language"], str(g["count"]),
             ", ".join(f"{k}:{v}" for k, v in sorted(g["reasons"].items()))) for g in limited])
    return "\n".join(out)
