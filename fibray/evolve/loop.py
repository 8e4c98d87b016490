"""The agent loop: per definition, rounds of generate -> evaluate (public workloads) -> feedback, within
budgets; then the best solution per definition is scored on the hidden workloads.

The trace store is the ledger (with the round files of fibray.evolve.ledger): a killed loop resumes at
the round it was in, re-evaluating only what was not recorded. Hidden workloads never reach a
generator. A generator's failure costs its round, is recorded, and the loop goes on.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from fibray.dataset import Dataset, load_dataset
from fibray.evolve.backend import EvalBackend, PoolBackend
from fibray.evolve.config import EvolveConfig
from fibray.evolve.generators import CallableGenerator, Generator, GeneratorOutput, ShellGenerator
from fibray.evolve.ledger import Candidate, Ledger, RoundRecord, candidate_feedback, geomean
from fibray.evolve.search import SearchGenerator
from fibray.evolve.split import WorkloadSplit, split_workloads
from fibray.interop.kernelbench_entry import BINDING, is_kernelbench, wrap_model_new
from fibray.schema import Definition, Job, Split, Solution
from fibray.schema.reasons import GeneratorReason
from fibray.store import StoreError, TraceStore, to_row

__all__ = ["DefinitionSummary", "EvolveReport", "build_task", "make_generator", "run_evolve"]

log = logging.getLogger(__name__)


def make_generator(cfg: EvolveConfig) -> Generator:
    """The generator the config names."""
    g = cfg.evolve.generator
    if g.kind == "shell":
        return ShellGenerator(g.command, g.deadline_s, g.max_output_bytes)
    if g.kind == "callable":
        return CallableGenerator(g.callable, g.deadline_s)
    return SearchGenerator(g.templates, seed=g.seed, explore=g.explore)


@dataclass
class DefinitionSummary:
    """How the loop went for one definition."""

    definition: str
    rounds: int = 0
    candidates: int = 0
    best: Optional[str] = None
    best_round: Optional[int] = None
    public_speedup: Optional[float] = None
    hidden_speedup: Optional[float] = None
    hidden_status: Optional[str] = None
    """PASSED when the best passed every hidden workload, else the first failing status; None: no hidden workloads."""
    stop: str = ""
    """Why its rounds ended: max_rounds, max_candidates, patience, wall_time."""
    best_per_round: list[Optional[float]] = field(default_factory=list)
    """Best public geomean speedup so far after each round (None until one candidate passed)."""

    @property
    def gap(self) -> Optional[float]:
        """hidden / public - 1: how much worse (negative) the best does on workloads it never saw."""
        if self.public_speedup and self.hidden_speedup:
            return self.hidden_speedup / self.public_speedup - 1.0
        return None


@dataclass
class EvolveReport:
    run_id: str
    definitions: dict[str, DefinitionSummary]
    evaluated: int = 0
    wall_s: float = 0.0

    def text(self) -> str:
        head = ("definition", "rounds", "cands", "best", "round", "public", "hidden", "gap", "hidden_status", "stop")
        fmt = lambda v: "-" if v is None else f"{v:.3g}x" if isinstance(v, float) else str(v)  # noqa: E731
        body = [(s.definition, str(s.rounds), str(s.candidates), s.best or "-", fmt(s.best_round), fmt(s.public_speedup),
                 fmt(s.hidden_speedup), "-" if s.gap is None else f"{100 * s.gap:+.1f}%", s.hidden_status or "-", s.stop)
                for s in self.definitions.values()]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([line.format(*head), line.format(*("-" * w for w in widths)), *(line.format(*b) for b in body)])


@dataclass
class _State:
    """One definition's loop state, rebuilt from the round files and the store at start."""

    definition: Definition
    split: WorkloadSplit
    rounds: list[RoundRecord]
    rows: dict[str, list[dict]] = field(default_factory=dict)  # solution name -> its store rows
    stop: str = ""

    def feedback(self, log_chars: int) -> list[dict[str, Any]]:
        n = len(self.split.public)
        return [{"round": r.round, "generator": r.generator, "status": r.status, "error": r.error,
                 "candidates": [candidate_feedback(c, self.rows.get(c.solution.name, []), n, log_chars) for c in r.candidates]}
                for r in self.rounds]

    def speedup(self, c: Candidate) -> Optional[float]:
        """Geomean public speedup of a candidate that passed every public workload, else None."""
        return candidate_feedback(c, self.rows.get(c.solution.name, []), len(self.split.public), 100)["speedup"]

    def best(self) -> Optional[tuple[Candidate, float, RoundRecord]]:
        """The fastest candidate that passed every public workload: (candidate, speedup, its round)."""
        found = None
        for r in self.rounds:
            for c in r.candidates:
                s = self.speedup(c)
                if s and (found is None or s > found[1]):
                    found = (c, s, r)
        return found

    def best_per_round(self, min_improvement: float) -> tuple[list[Optional[float]], int]:
        """Best speedup so far after each round, and the rounds in a row (at the end) without improvement."""
        out: list[Optional[float]] = []
        best, stale = None, 0
        for r in self.rounds:
            top = max((s for s in map(self.speedup, r.candidates) if s), default=None)
            if top is not None and (best is None or top > best * (1 + min_improvement)):
                best, stale = top, 0
            else:
                stale += 1
            out.append(best)
        return out, stale


def build_task(cfg: EvolveConfig, state: _State, round_: int, n: int) -> dict[str, Any]:
    """The task a generator gets: the definition, PUBLIC workloads only, the feedback of earlier rounds,
    and the best solution so far with its source."""
    best = state.best()
    return {
        "run_id": cfg.evolve.run_id, "round": round_, "max_rounds": cfg.evolve.budget.max_rounds, "candidates": n,
        "definition": state.definition.to_json_dict(),
        "kernelbench": is_kernelbench(state.definition),
        "workloads": [{"uuid": w.uuid, "axes": w.axes} for w in state.split.public],
        "feedback": state.feedback(cfg.evolve.feedback_log_chars),
        "best": None if best is None else {"solution": best[0].solution.to_json_dict(), "round": best[2].round,
                                           "speedup": best[1]},
    }


def _candidates(out: GeneratorOutput, state: _State, round_: int, limit: int) -> tuple[list[Candidate], list[dict]]:
    """Valid solutions of the definition from the generator's items (renamed where a name is taken)."""
    d = state.definition
    taken = {c.solution.name for r in state.rounds for c in r.candidates}
    best = state.best()
    kept, rejected = [], []
    for i, raw in enumerate(out.items):
        item = dict(raw)
        parent = item.pop("parent", None)
        item.setdefault("definition", d.name)
        if item["definition"] != d.name:
            rejected.append({"index": i, "reason": GeneratorReason.INVALID_SOLUTION.value,
                             "error": f"definition: {item['definition']!r}, but the task is {d.name!r}"})
            continue
        try:
            sol = Solution.model_validate(item)
        except ValidationError as e:
            err = e.errors()[0]
            rejected.append({"index": i, "reason": GeneratorReason.INVALID_SOLUTION.value,
                             "error": f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"})
            continue
        if sol.spec.binding == BINDING and not is_kernelbench(d):
            rejected.append({"index": i, "reason": GeneratorReason.INVALID_SOLUTION.value,
                             "error": f"spec.binding: {BINDING!r} needs a KernelBench definition"})
            continue
        if len(kept) >= limit:
            rejected.append({"index": i, "reason": GeneratorReason.OVER_BUDGET.value,
                             "error": f"more than the round's {limit} candidates"})
            continue
        sol = wrap_model_new(d, sol) if is_kernelbench(d) else sol
        if sol.name in taken:
            sol = Solution.model_validate({**sol.to_json_dict(), "name": f"{sol.name}_r{round_}_{i}"})
        taken.add(sol.name)
        kept.append(Candidate(solution=sol, parent=parent if isinstance(parent, str) else
                              (best[0].solution.name if best else None)))
    return kept, rejected


class _Progress:
    """One stderr line per definition and finished round (flushed: a parent reading the pipe sees it at once)."""

    def __init__(self, cfg: EvolveConfig) -> None:
        self.enabled, self.max_rounds = cfg.evolve.progress, cfg.evolve.budget.max_rounds
        self.t0, self.rounds = time.monotonic(), 0

    def round(self, name: str, record: RoundRecord, state: _State, best: Optional[float], last: int) -> None:
        if not self.enabled:
            return
        counts = Counter(candidate_feedback(c, state.rows.get(c.solution.name, []), len(state.split.public), 10)["status"]
                         for c in record.candidates)
        elapsed = time.monotonic() - self.t0
        per = elapsed / max(1, self.rounds)
        left = max(0, last - record.round)
        what = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or f"none ({record.status})"
        print(f"[{name}] round {record.round}/{self.max_rounds}: {len(record.candidates)} candidates {what} | best "
              f"{'-' if best is None else f'{best:.3g}x'} | {elapsed:.0f}s elapsed, {per:.1f}s/round, "
              f"ETA {left * per:.0f}s", file=sys.stderr, flush=True)


def _load_states(cfg: EvolveConfig, ds: Dataset, store: TraceStore, ledger: Ledger) -> dict[str, _State]:
    rows = store.read(sweep=cfg.evolve.run_id).to_pylist()
    states = {}
    for name, d in ds.definitions.items():
        sp = split_workloads(ds, name, hidden_fraction=cfg.evolve.split.hidden_fraction, seed=cfg.evolve.split.seed)
        if not sp.public:
            log.warning("definition %s has no public workloads; skipped", name)
            continue
        st = _State(d, sp, ledger.rounds(name))
        for r in rows:
            if r["definition"] == name:
                st.rows.setdefault(r["solution"], []).append(r)
        states[name] = st
    return states


def _jobs(cfg: EvolveConfig, ds: Dataset, st: _State, record: RoundRecord, workloads, split: Split,
          done: set[str], salt: bytes) -> list[tuple[Job, dict]]:
    """The round's jobs not yet recorded, salted like a sweep's (inputs no candidate can predict)."""
    out = []
    for c in record.candidates:
        for w in workloads:
            job = Job(job_id=Job.make_id(st.definition, w, c.solution, cfg.eval), sweep=cfg.evolve.run_id,
                      definition=st.definition, workload=w, solution=c.solution, settings=cfg.eval,
                      dataset_root=str(ds.root.resolve()), split=split)
            if job.job_id not in done:
                loop = {"round": record.round, "parent": c.parent, "generator": record.generator,
                        "run_id": cfg.evolve.run_id}
                out.append((job.salted(salt), loop))
    return out


def _record(store: TraceStore, states: dict[str, _State], batch: list[tuple[Job, dict]], backend: EvalBackend,
            done: set[str], ds: Dataset) -> int:
    results = backend.evaluate([j for j, _ in batch])
    rows = [to_row(job, results[job.job_id], loop, dataset_name=ds.name, dataset_hash=ds.hash)
            for job, loop in batch if job.job_id in results]
    if rows:
        store.append(rows)
    for row in rows:
        done.add(row["job_id"])
        states[row["definition"]].rows.setdefault(row["solution"], []).append(row)
    return len(rows)


def run_evolve(cfg: EvolveConfig, *, generator: Optional[Generator] = None,
               backend: Optional[EvalBackend] = None) -> EvolveReport:
    """Run (or resume) the loop of every selected definition, then score the best ones on hidden workloads."""
    t0 = time.monotonic()
    ev, budget = cfg.evolve, cfg.evolve.budget
    ds = load_dataset(cfg.dataset.root, definitions=cfg.dataset.definitions, workload_set=cfg.dataset.workload_set,
                      max_workloads_per_definition=cfg.dataset.max_workloads_per_definition, split=cfg.dataset.split)
    store, ledger = TraceStore(cfg.store.root), Ledger(cfg.store.root, ev.run_id)
    generator = generator or make_generator(cfg)
    if isinstance(generator, SearchGenerator):
        for name in ds.definitions:
            generator.template_for(name)  # a missing or knob-less template is a config error, before any work
    own_backend = backend is None
    backend = backend or PoolBackend(cfg)
    report = EvolveReport(ev.run_id, {})
    with store.lock(ev.run_id):
        states = _load_states(cfg, ds, store, ledger)
        held = ledger.meta().get("dataset_hash")
        if held and held != ds.hash:
            raise StoreError(f"evolve.run_id: run {ev.run_id!r} in {store.root} was started on another dataset "
                             f"({held[:12]}), not {ds.name!r} ({ds.hash[:12]}) at {ds.root}; choose another run_id")
        salt = store.sweep_salt(ev.run_id)  # the run's secret input salt, the same on a resume
        ledger.write_meta({"run_id": ev.run_id, "dataset": str(ds.root.resolve()), "dataset_name": ds.name,
                           "dataset_hash": ds.hash, "generator": generator.name,
                           "split": {n: {"source": s.split.source, "public": [w.uuid for w in s.split.public],
                                         "hidden": [w.uuid for w in s.split.hidden]} for n, s in states.items()}})
        done = store.job_ids(ev.run_id)
        progress = _Progress(cfg)
        try:
            active = dict(states)
            tried: set[tuple[str, int]] = set()  # rounds whose jobs this invocation sent (each is sent once)
            while active:
                batch: list[tuple[Job, dict]] = []
                this_round: dict[str, RoundRecord] = {}
                for name, st in list(active.items()):
                    last = st.rounds[-1] if st.rounds else None
                    pending = last is not None and _jobs(cfg, ds, st, last, st.split.public, Split.PUBLIC, done, salt)
                    if pending and (name, last.round) not in tried:  # killed mid-round: evaluate what was not
                        tried.add((name, last.round))                 # recorded, never ask the generator again
                        batch += pending
                        this_round[name] = last
                        continue
                    n_cands = sum(len(r.candidates) for r in st.rounds)
                    _, stale = st.best_per_round(budget.min_improvement)
                    r = len(st.rounds) + 1
                    stop = ("max_rounds" if r > budget.max_rounds else
                            "max_candidates" if budget.max_candidates and n_cands >= budget.max_candidates else
                            "patience" if budget.patience and stale >= budget.patience else
                            "wall_time" if budget.wall_time_s and time.monotonic() - t0 > budget.wall_time_s else "")
                    if stop:
                        st.stop = stop
                        del active[name]
                        continue
                    n = min(budget.candidates, budget.max_candidates - n_cands if budget.max_candidates else budget.candidates)
                    try:
                        out = generator.generate(build_task(cfg, st, r, n))
                    except Exception as e:  # a generator object's own bug costs its round, like a crashed command
                        out = GeneratorOutput(reason=GeneratorReason.GENERATOR_CRASHED, error=f"{type(e).__name__}: {e}")
                    cands, rejected = _candidates(out, st, r, n)
                    status = out.reason.value if out.reason else ("ok" if cands else (
                        GeneratorReason.INVALID_SOLUTION.value if rejected else GeneratorReason.NO_CANDIDATES.value))
                    record = RoundRecord(round=r, generator=generator.name, status=status, error=out.error,
                                         stderr=out.stderr, seconds=out.seconds, candidates=cands, rejected=rejected)
                    if status != "ok":
                        log.warning("[%s] round %d: %s: %s", name, r, status, out.error or rejected[:1])
                    ledger.write(name, record)
                    st.rounds.append(record)
                    tried.add((name, r))
                    this_round[name] = record
                    batch += _jobs(cfg, ds, st, record, st.split.public, Split.PUBLIC, done, salt)
                report.evaluated += _record(store, states, batch, backend, done, ds)
                progress.rounds += 1 if this_round else 0
                for name, record in this_round.items():
                    st = states[name]
                    best = st.best_per_round(budget.min_improvement)[0]
                    progress.round(name, record, st, best[-1] if best else None, budget.max_rounds)
            hidden: list[tuple[Job, dict]] = []
            for name, st in states.items():
                found = st.best()
                if found and st.split.hidden:
                    one = RoundRecord(round=found[2].round, generator=found[2].generator, candidates=[found[0]])
                    hidden += _jobs(cfg, ds, st, one, st.split.hidden, Split.HIDDEN, done, salt)
            report.evaluated += _record(store, states, hidden, backend, done, ds)
        finally:
            if own_backend:
                backend.close()
    for name, st in states.items():
        report.definitions[name] = _summary(st, budget.min_improvement)
    report.wall_s = time.monotonic() - t0
    return report


def _summary(st: _State, min_improvement: float) -> DefinitionSummary:
    s = DefinitionSummary(st.definition.name, rounds=len(st.rounds), candidates=sum(len(r.candidates) for r in st.rounds),
                          stop=st.stop, best_per_round=st.best_per_round(min_improvement)[0])
    found = st.best()
    if found is None:
        return s
    cand, s.public_speedup, rec = found
    s.best, s.best_round = cand.solution.name, rec.round
    rows = [r for r in st.rows.get(cand.solution.name, []) if r.get("split") == "hidden"]
    if st.split.hidden and rows:
        failed = [r for r in rows if r["status"] != "PASSED"]
        s.hidden_status = failed[0]["status"] if failed else "PASSED"
        if not failed and len(rows) == len(st.split.hidden) and all(r["speedup"] for r in rows):
            s.hidden_speedup = geomean([r["speedup"] for r in rows])
    return s
