"""The automated gates of `python -m fibray.promote`: hidden, sanitizers, shared-memory poison, re-benchmark.

For the PASSED candidates of a sweep (every public workload PASSED), each gate writes one
promotions row per artifact as soon as it has a verdict; a failed gate rejects the artifact
and the later gates are skipped for it. The hidden and re-benchmark gates are sweeps through
fibray.sweep.run_sweep, recorded in the store like any other (`<sweep>.hidden`, `<sweep>.rebench`).

Re-benchmark rule: a workload passes when the fresh-process median m' lies within
m +- max(k * 1.2533 * s / sqrt(n), floor * m), where m, s = cv * mean and n are the sweep's
median, standard deviation and sample count (1.2533 s / sqrt(n) is the standard error of a
median of n roughly normal samples); the floor admits the drift seen between processes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fibray.dataset import Dataset, load_dataset
from fibray.promote.artifact import Artifact, artifact_of
from fibray.promote.sanitize_runner import SanitizeJob
from fibray.promote.sanitizer import DEADLINE_S, GateResult, sanitizer_gates, unavailable
from fibray.promote.smem_poison import smem_poison_gate
from fibray.schema import EvalSettings, Solution
from fibray.store import TraceStore
from fibray.workers.process.sandbox import SandboxPolicy
from fibray.store.promotions import (
    AUTOMATED_GATES, SANITIZER_GATES, Gate, Outcome, PromotionLog, PromotionRecord, Stage,
)

log = logging.getLogger(__name__)

SE_MEDIAN = 1.2533
"""sqrt(pi/2): standard error of a median over that of a mean, for roughly normal samples."""
GATE_STAGES = frozenset({None, Stage.CANDIDATE, Stage.REJECTED, Stage.DEMOTED})
"""Stages from which gates run without --revalidate (re-running them takes a serving artifact back)."""


class PromoteOptions(BaseModel):
    """What one run of the gates works on."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    store: str
    """Trace store root (the promotions table is <store>/_promotions)."""
    dataset: str
    """Dataset root (definitions, workloads, splits/)."""
    sweep: str
    """The sweep whose PASSED candidates are gated."""
    workload_set: str | None = None
    """workloads/<set>/ only, as the sweep used."""
    solution_roots: list[str] = Field(default_factory=list)
    """Extra solution folders, as the sweep used."""
    definitions: list[str] | None = None
    """Only these definitions."""
    solutions: list[str] | None = None
    """Only these solutions."""
    gates: list[Gate] = Field(default_factory=lambda: list(AUTOMATED_GATES))
    """Which automated gates to run (the others stay unrecorded, so the artifact cannot be validated)."""
    num_gpus: int | None = None
    """cluster.num_gpus of the gate sweeps."""
    max_workloads: int | None = None
    """dataset.max_workloads_per_definition of the gate sweeps and the sanitizer."""
    ci_k: float = Field(default=3.0, gt=0)
    """Re-benchmark: standard errors of the sweep's median the fresh-process median may lie from it."""
    ci_floor: float = Field(default=0.10, ge=0)
    """Re-benchmark: the interval is at least +- this fraction of the sweep's median."""
    sanitizer_deadline_s: float = Field(default=DEADLINE_S, gt=0)
    """Deadline of one (tool, workload) sanitizer run, and of one workload's smem_poison run."""
    sanitizer_parallel: int = Field(default=2, ge=1)
    """Sanitizer (and smem_poison) runs at once."""
    drop_privileges: bool = True
    """Sanitizer and smem_poison runs as uids of their own (fibray as root); False runs them with fibray's
    own privileges."""
    memory_limit_gb: float | None = Field(default=16.0, gt=0)
    """Host memory bound of each sanitizer and smem_poison run and all it starts (a memory cgroup, as the
    sweep's runner.memory_limit_gb); None runs them unbounded (refused when privileges are dropped and
    no memory cgroup can be made, unless None)."""
    revalidate: bool = False
    """Also gate artifacts that are validated or serving (takes them back to candidate)."""
    tag: str = Field(default="", pattern=r"^[A-Za-z0-9_.-]{0,32}$")
    """Suffix of the gate sweeps' names: <sweep>.hidden[.tag]; the same name resumes (reuses) its rows,
    a new tag measures again (a re-validation)."""
    actor: str
    """Who runs the gates (user@host)."""


@dataclass
class GateCandidate:
    """A solution all of whose public workloads PASSED in the sweep."""

    solution: Solution
    artifact: Artifact
    rows: list[dict[str, Any]]
    """Its public rows of the sweep."""
    stage: Stage | None = None
    """Its artifact's stage before this run."""
    prior: dict[Gate, GateResult] = field(default_factory=dict)
    """Its latest earlier verdict per automated gate (since it was last demoted), for runs that split the gates."""
    results: list[GateResult] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(r.outcome is Outcome.FAILED for r in self.results)


_COLUMNS = ["definition", "sweep", "workload_uuid", "solution", "solution_hash", "status", "reason", "split",
            "latency_ms", "latency_mean_ms", "latency_cv", "n_samples", "settings", "isolation"]


def load(opts: PromoteOptions) -> Dataset:
    """The dataset with the solutions the sweep used."""
    return load_dataset(opts.dataset, definitions=opts.definitions, solution_roots=opts.solution_roots,
                        workload_set=opts.workload_set, require_blobs=False)


def candidates(opts: PromoteOptions, ds: Dataset, log_: PromotionLog) -> tuple[list[GateCandidate], list[str]]:
    """(the sweep's PASSED candidates that may be gated, notes on those left out)."""
    rows = TraceStore(opts.store).read(sweep=opts.sweep, columns=_COLUMNS).to_pylist()
    if not rows:
        raise ValueError(f"--sweep: no rows for sweep {opts.sweep!r} in {opts.store}")
    by_hash = {s.hash: s for s in ds.solutions.values()}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if (r["split"] or "public") == "public" and r["definition"] in ds.definitions:
            groups.setdefault(r["solution_hash"], []).append(r)
    history: dict[str, list[PromotionRecord]] = {}
    for r in log_.read():
        history.setdefault(r.artifact_id, []).append(r)
    out, notes = [], []
    for sol_hash, group in sorted(groups.items(), key=lambda kv: kv[1][0]["solution"]):
        name = group[0]["solution"]
        if opts.solutions is not None and name not in opts.solutions:
            continue
        if sol_hash not in by_hash:
            notes.append(f"{name}: not among the loaded solutions (or its source changed since the sweep); skipped")
            continue
        failed = [r for r in group if r["status"] != "PASSED"]
        if failed:
            notes.append(f"{name}: {len(failed)}/{len(group)} public workloads did not pass in {opts.sweep}; not a candidate")
            continue
        art = artifact_of(by_hash[sol_hash])
        rows_before = history.get(art.artifact_id, [])
        stage = rows_before[-1].stage if rows_before else None
        if stage not in GATE_STAGES and not opts.revalidate:
            notes.append(f"{name}: artifact {art.artifact_id[:12]} is {stage}; gates not re-run (--revalidate to)")
            continue
        prior: dict[Gate, GateResult] = {}
        for r in rows_before:
            if r.stage is Stage.DEMOTED:
                prior = {}
            elif r.gate in AUTOMATED_GATES:
                prior[r.gate] = GateResult(r.gate, r.outcome, r.reason, r.evidence)
        out.append(GateCandidate(by_hash[sol_hash], art, group, stage, prior))
    return out, notes


def settings_of(cands: Sequence[GateCandidate]) -> EvalSettings:
    """The evaluation settings of the sweep (one set; a mixed sweep is refused)."""
    found = {r["settings"] for c in cands for r in c.rows}
    if len(found) != 1:
        raise ValueError(f"--sweep: its rows use {len(found)} different evaluation settings; gate one setting at a time")
    return EvalSettings.model_validate(json.loads(found.pop()))


def _sweep(opts: PromoteOptions, cands: Sequence[GateCandidate], name: str, split: str, runner: dict) -> list[dict]:
    """Run a gate sweep of the candidates; its rows."""
    from fibray.sweep import run_sweep, validate_config

    cfg = validate_config({
        "dataset": {"root": opts.dataset, "workload_set": opts.workload_set, "split": split,
                    "definitions": sorted({c.solution.definition for c in cands}),
                    "max_workloads_per_definition": opts.max_workloads},
        "solutions": {"roots": opts.solution_roots, "names": sorted(c.solution.name for c in cands)},
        "store": {"root": opts.store}, "sweep": {"name": name, "progress": False},
        "cluster": {"num_gpus": opts.num_gpus}, "eval": settings_of(cands).model_dump(mode="json"), "runner": runner,
    })
    report = run_sweep(cfg)
    log.info("promote: sweep %s: %d jobs, %d evaluated", name, report.total_jobs, report.recorded)
    return TraceStore(opts.store).read(sweep=name, columns=_COLUMNS).to_pylist()


def gate_sweep(opts: PromoteOptions, gate: str) -> str:
    """The name of a gate's sweep in the store."""
    return f"{opts.sweep}.{gate}" + (f".{opts.tag}" if opts.tag else "")


def hidden_gate(opts: PromoteOptions, ds: Dataset, cands: Sequence[GateCandidate]) -> dict[str, GateResult]:
    """Every hidden workload of the candidate's definition PASSED (solution hash -> result)."""
    hidden = {d: [w for w in ws if ds.split_of(w.uuid) == "hidden"] for d, ws in ds.workloads.items()}
    results: dict[str, GateResult] = {}
    runnable = [c for c in cands if hidden.get(c.solution.definition)]
    for c in cands:
        if c not in runnable:
            results[c.solution.hash] = GateResult(Gate.HIDDEN, Outcome.NOT_RUN,
                                                  f"not_run: no hidden workloads of {c.solution.definition} in {opts.dataset}")
    if not runnable:
        return results
    name = gate_sweep(opts, "hidden")
    rows = _sweep(opts, runnable, name, "hidden", {})
    for c in runnable:
        mine = [r for r in rows if r["solution_hash"] == c.solution.hash]
        bad = [r for r in mine if r["status"] != "PASSED"]
        evidence = {"sweep": name, "workloads": len(mine), "passed": len(mine) - len(bad),
                    "failures": [{"workload": r["workload_uuid"], "status": r["status"], "reason": r["reason"]} for r in bad]}
        if not mine:
            results[c.solution.hash] = GateResult(Gate.HIDDEN, Outcome.FAILED, f"no rows in {name}", evidence)
        elif bad:
            first = bad[0]
            results[c.solution.hash] = GateResult(
                Gate.HIDDEN, Outcome.FAILED, f"{len(bad)}/{len(mine)} hidden workloads failed; {first['workload_uuid']}: "
                f"{first['status']}{' ' + first['reason'] if first['reason'] else ''}", evidence)
        else:
            results[c.solution.hash] = GateResult(Gate.HIDDEN, Outcome.PASSED,
                                                  f"{len(mine)}/{len(mine)} hidden workloads PASSED", evidence)
    return results


def interval(row: dict[str, Any], k: float, floor: float) -> tuple[float, float] | None:
    """The sweep's confidence interval of a row's median latency (see the module docstring), or None."""
    m, mean, cv, n = row["latency_ms"], row["latency_mean_ms"], row["latency_cv"], row["n_samples"]
    if m is None or not m > 0:
        return None
    se = SE_MEDIAN * (cv or 0.0) * (mean or m) / math.sqrt(n) if n else math.inf
    half = max(k * se, floor * m)
    return m - half, m + half


def rebench_gate(opts: PromoteOptions, cands: Sequence[GateCandidate]) -> dict[str, GateResult]:
    """Fresh-process re-benchmark (runner.isolation=isolated) of the sweep's public workloads."""
    if not cands:
        return {}
    name = gate_sweep(opts, "rebench")
    rows = _sweep(opts, cands, name, "public", {"isolation": "isolated"})
    results: dict[str, GateResult] = {}
    for c in cands:
        again = {r["workload_uuid"]: r for r in rows if r["solution_hash"] == c.solution.hash}
        per, bad = {}, []
        for r in c.rows:
            ci = interval(r, opts.ci_k, opts.ci_floor)
            new = again.get(r["workload_uuid"])
            entry = {"sweep_median_ms": r["latency_ms"], "ci_ms": ci, "n": r["n_samples"], "cv": r["latency_cv"],
                     "rebench_median_ms": new["latency_ms"] if new else None,
                     "rebench_status": new["status"] if new else None,
                     "rebench_isolation": new["isolation"] if new else None}
            if new is None or new["status"] != "PASSED" or ci is None or new["latency_ms"] is None:
                entry["verdict"] = "not re-measured" if new is None else f"re-benchmark {new['status']}"
            else:
                entry["verdict"] = "within" if ci[0] <= new["latency_ms"] <= ci[1] else "outside"
            per[r["workload_uuid"]] = entry
            if entry["verdict"] != "within":
                bad.append((r["workload_uuid"], entry))
        evidence = {"sweep": name, "k": opts.ci_k, "floor": opts.ci_floor, "workloads": per}
        if bad:
            uuid, e = bad[0]
            detail = (f"median {e['rebench_median_ms']:.4g} ms outside [{e['ci_ms'][0]:.4g}, {e['ci_ms'][1]:.4g}] ms"
                      if e["verdict"] == "outside" else e["verdict"])
            results[c.solution.hash] = GateResult(
                Gate.REBENCH, Outcome.FAILED, f"{len(bad)}/{len(per)} workloads off the sweep's interval; {uuid}: {detail}",
                evidence)
        else:
            results[c.solution.hash] = GateResult(Gate.REBENCH, Outcome.PASSED,
                                                  f"{len(per)}/{len(per)} fresh-process medians within the interval", evidence)
    return results


def sanitizer_jobs(opts: PromoteOptions, ds: Dataset, c: GateCandidate, seed: int) -> list[SanitizeJob]:
    """One sanitizer (and smem_poison) job per workload (public and hidden) of the candidate's definition."""
    d = ds.definitions[c.solution.definition]
    workloads = ds.workloads.get(d.name, [])[: opts.max_workloads]
    return [SanitizeJob(definition=d, workload=w, solution=c.solution, dataset_root=str(Path(opts.dataset).resolve()),
                        seed=seed) for w in workloads]


def record(c: GateCandidate, result: GateResult, actor: str, stage: Stage | None = None) -> PromotionRecord:
    """The promotions row of one gate's result."""
    a = c.artifact
    if stage is None:
        stage = Stage.REJECTED if c.failed or result.outcome is Outcome.FAILED else Stage.CANDIDATE
    return PromotionRecord(artifact_id=a.artifact_id, definition=a.definition, solution=a.solution,
                           solution_hash=a.solution_hash, recipe_hash=a.recipe_hash, environment_key=a.environment_key,
                           environment=a.environment, stage=stage, gate=result.gate, outcome=result.outcome,
                           reason=result.reason, evidence=result.evidence, actor=actor)


def summary(c: GateCandidate) -> GateResult:
    """The automated summary: passed only when every automated gate's latest verdict is a pass."""
    by_gate = {**c.prior, **{r.gate: r for r in c.results}}
    failed = [g.value for g in AUTOMATED_GATES if g in by_gate and by_gate[g].outcome is Outcome.FAILED]
    missing = [g.value for g in AUTOMATED_GATES if g not in by_gate]
    not_run = [g.value for g in AUTOMATED_GATES if g in by_gate and by_gate[g].outcome is Outcome.NOT_RUN]
    evidence = {"failed": failed, "not_run": not_run, "not_recorded": missing}
    if failed:
        return GateResult(Gate.AUTOMATED, Outcome.FAILED, f"failed: {', '.join(failed)}"
                          + (f"; skipped: {', '.join(missing)}" if missing else ""), evidence)
    if not_run or missing:
        parts = ([f"not run: {', '.join(not_run)}"] if not_run else []) + (
            [f"not recorded: {', '.join(missing)}"] if missing else [])
        return GateResult(Gate.AUTOMATED, Outcome.NOT_RUN, "; ".join(parts) + " (a review may waive what did not run)",
                          evidence)
    return GateResult(Gate.AUTOMATED, Outcome.PASSED, "every automated gate passed", evidence)


def run_gates(opts: PromoteOptions, echo: Callable[[str], None] = print) -> list[GateCandidate]:
    """Run the chosen gates for the sweep's candidates, recording each verdict as it comes."""
    ds = load(opts)
    plog = PromotionLog(opts.store)
    cands, notes = candidates(opts, ds, plog)
    for note in notes:
        echo(f"  {note}")
    if not cands:
        echo(f"no candidates to gate in sweep {opts.sweep!r}")
        return []
    echo(f"gating {len(cands)} candidate(s) of sweep {opts.sweep!r}: {', '.join(c.solution.name for c in cands)}")

    def publish(results: dict[str, GateResult]) -> None:
        rows = []
        for c in cands:
            res = results.get(c.solution.hash)
            if res is not None:
                rows.append(record(c, res, opts.actor))
                c.results.append(res)
                echo(f"  {c.solution.name}: {res.gate.value}: {res.outcome.value} ({res.reason})")
        plog.append(rows)

    live = lambda: [c for c in cands if not c.failed]  # noqa: E731 - a failed gate stops the rest for that artifact
    if Gate.HIDDEN in opts.gates:
        publish(hidden_gate(opts, ds, live()))
    sanitizers = [g for g in SANITIZER_GATES if g in opts.gates]
    if sanitizers or Gate.SMEM_POISON in opts.gates:
        exe, why_not = unavailable() if sanitizers else (None, None)
        seed = settings_of(cands).seed
        bound = int(opts.memory_limit_gb * (1 << 30)) if opts.memory_limit_gb else None
        policy = SandboxPolicy(drop_privileges=opts.drop_privileges, memory_limit_bytes=bound)
        for c in live():
            jobs = sanitizer_jobs(opts, ds, c, seed)
            if sanitizers:
                res = sanitizer_gates(jobs, deadline_s=opts.sanitizer_deadline_s, parallel=opts.sanitizer_parallel,
                                      executable=exe, why_not=why_not, policy=policy)
                for gate in sanitizers:
                    publish({c.solution.hash: res[gate]})
            if Gate.SMEM_POISON in opts.gates and not c.failed:
                publish({c.solution.hash: smem_poison_gate(jobs, deadline_s=opts.sanitizer_deadline_s,
                                                           parallel=opts.sanitizer_parallel, policy=policy)})
    if Gate.REBENCH in opts.gates:
        publish(rebench_gate(opts, live()))
    rows = []
    for c in cands:
        res = summary(c)
        stage = {Outcome.PASSED: Stage.VALIDATED, Outcome.FAILED: Stage.REJECTED}.get(res.outcome, Stage.CANDIDATE)
        rows.append(record(c, res, opts.actor, stage))
        echo(f"  {c.solution.name}: artifact {c.artifact.artifact_id[:12]} -> {stage.value} ({res.reason})")
    plog.append(rows)
    return cands
