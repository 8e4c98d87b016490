"""ApplyRuntime: the dispatch index built from a trace store, its builds, breakers and counters.

Everything slow happens here, once, when apply is enabled: reading the store, ranking,
building the winners (a build that fails drops that candidate). The per-call work is in
`fibray.apply.dispatch`. A runtime never touches the store after it is built.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from collections import Counter
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from fibray.apply.compat import running_environment
from fibray.apply.config import DISABLE_ENV, ApplyConfig, disabled_by_env
from fibray.apply.dispatch import Dispatcher, SolutionState
from fibray.apply.hooks import HOOKS, set_runtime
from fibray.apply.index import DefinitionIndex, IndexReport, build_index, read_rows
from fibray.apply.stages import CANARY, SHADOW, StageCounters, StageMonitor
from fibray.compile import BuildCache, BuildError
from fibray.dataset import Dataset, load_dataset
from fibray.schema import Environment, Solution
from fibray.store import TraceStore
from fibray.store.promotions import SERVING_STAGES, Gate, Outcome, PromotionLog, PromotionRecord, Stage
from fibray.store.writer import StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DefinitionStats:
    """Counters of one definition."""

    hits: int = 0
    """Calls served by the winner of their exact key."""
    bucketed: int = 0
    """Calls with unseen var-axis values served by the nearest measured key's winner."""
    misses: int = 0
    """Calls that went to the fallback without trying a solution (no key, guard failed, unknown)."""
    fallbacks: int = 0
    """Calls whose substituted solution failed (exception, NaN/Inf) and that the fallback answered."""
    keys: int = 0
    """Measured keys with at least one verified, built solution."""


@dataclass(frozen=True)
class ArtifactStats:
    """Counters of one promoted artifact (when apply requires promotion)."""

    artifact_id: str
    solution: str
    definition: str
    stage: str
    """Its stage when apply was enabled (shadow, canary, default)."""
    calls: int
    """Calls its result answered."""
    demoted: str | None
    """Why it was demoted in this process; None while it serves."""
    demotion_recorded: bool | None
    """Whether the demotion was written to the promotions table (None: not demoted, or not asked to)."""
    counters: StageCounters | None
    """Shadow/canary counters (served, shadow_calls, compared, mismatches, P99s); None for default."""


@dataclass(frozen=True)
class ApplyStats:
    """A snapshot of what apply did in this process."""

    enabled: bool
    """Whether this runtime is the active one."""
    hits: int
    bucketed: int
    misses: int
    fallbacks: int
    definitions: dict[str, DefinitionStats]
    """Definition name -> its counters."""
    solution_calls: dict[str, int]
    """Solution name -> substituted calls it answered."""
    switched_off: dict[str, str]
    """Solution name -> why its circuit breaker tripped."""
    dropped_builds: dict[str, str]
    """Solution name -> why it could not be built when apply was enabled."""
    index: IndexReport
    """How the store rows were used."""
    disabled_reason: str | None = None
    """Why nothing is substituted at all (e.g. the FIBRAY_APPLY_DISABLE switch)."""
    artifacts: dict[str, ArtifactStats] = field(default_factory=dict)
    """Artifact id -> its counters (when apply requires promotion)."""
    not_promoted: dict[str, str] = field(default_factory=dict)
    """Solution name -> why it is not eligible (its stage here, or no promotion record for this environment)."""


def _private_workdir() -> Path:
    """A build directory of this process's own, removed when the process exits (not before: a
    Triton winner compiles from its files at its first call, which may come at any time)."""
    path = Path(tempfile.mkdtemp(prefix="fibray-apply-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class ApplyRuntime:
    """Dispatchers for every definition with verified solutions, ready to be activated."""

    def __init__(
        self,
        index: dict[str, DefinitionIndex],
        report: IndexReport,
        config: ApplyConfig,
        running: Environment | None = None,
        *,
        disabled_reason: str | None = None,
        promotions: dict[str, PromotionRecord] | None = None,
        promotion_log: PromotionLog | None = None,
    ) -> None:
        self.config = config
        self.running = running
        self.report = report
        self.disabled_reason = disabled_reason
        self.dispatchers: dict[str, Dispatcher] = {}
        self.dropped_builds: dict[str, str] = {}
        self.promotions = promotions
        """Artifact id -> latest promotions row, when apply requires promotion; None otherwise."""
        self.not_promoted: dict[str, str] = {}
        self._promotion_log = promotion_log
        self._demotions: dict[str, bool | None] = {}
        self._states: dict[str, SolutionState] = {}
        self._unknown: Counter[str] = Counter()
        self._builds = BuildCache(Path(config.workdir) if config.workdir else _private_workdir())
        cuda = running is not None and running.hardware is not None and not running.hardware.startswith("cpu")
        self._cuda = cuda
        for name, entry in sorted(index.items()):
            ranked = {key: self._built(cands) for key, cands in entry.ranked.items()}
            ranked = {key: states for key, states in ranked.items() if states}
            try:
                self.dispatchers[name] = Dispatcher(
                    entry.definition, ranked, entry.failed, on_failure=self._switch_off,
                    nearest=config.on_miss == "nearest", cuda=cuda, cache_size=config.bucket_cache_size,
                    compiled=config.compiled_dispatch,
                )
            except ValueError as e:
                log.warning("apply: %s; its calls will use the fallback", e)
        self.dispatch_functions = {name: d.dispatch for name, d in self.dispatchers.items()}
        """Definition name -> generated dispatch function (what decorated functions call)."""

    def _built(self, candidates: list) -> list[SolutionState]:
        """The first `candidates_per_key` candidates that build, fastest first."""
        states = []
        for cand in candidates:
            state = self._state(cand.solution)
            if state is not None:
                states.append(state)
                if len(states) == self.config.candidates_per_key:
                    break
        return states

    def _promoted(self, solution: Solution) -> PromotionRecord | None:
        """The solution's latest promotions row here if it may serve, else None (and why, in not_promoted)."""
        from fibray.promote.artifact import artifact_of

        art = artifact_of(solution)
        row = self.promotions.get(art.artifact_id) if self.promotions is not None else None
        if row is None or row.stage not in SERVING_STAGES:
            self.not_promoted[solution.name] = (f"artifact {art.artifact_id[:12]} is {row.stage.value}" if row else
                                                f"no promotion record for artifact {art.artifact_id[:12]} here")
            return None
        return row

    def _monitor(self, row: PromotionRecord) -> StageMonitor | None:
        if row.stage not in (Stage.SHADOW, Stage.CANARY):
            return None
        c = self.config
        return StageMonitor(SHADOW if row.stage is Stage.SHADOW else CANARY, row.artifact_id,
                            canary_fraction=c.canary_fraction, compare_fraction=c.canary_compare_fraction,
                            compare_first=c.canary_compare_first, shadow_fraction=c.shadow_fraction, atol=c.max_atol,
                            rtol=c.max_rtol, window=c.latency_window, margin=c.latency_margin, cuda=self._cuda)

    def _state(self, solution: Solution) -> SolutionState | None:
        if solution.hash in self._states:
            return self._states[solution.hash]
        if solution.name in self.dropped_builds or solution.name in self.not_promoted:
            return None
        row = self._promoted(solution) if self.promotions is not None else None
        if self.promotions is not None and row is None:
            return None
        try:
            runnable = self._builds.get(solution)
        except Exception as e:  # noqa: BLE001 - BuildError, or the host itself failing (disk, permissions): drop it
            reason = e.reason if isinstance(e, BuildError) else type(e).__name__
            last_line = (str(e).strip().splitlines() or [""])[-1]
            self.dropped_builds[solution.name] = f"{reason}: {last_line}"
            log.warning("apply: dropped %s, its build failed (%s)", solution.name, self.dropped_builds[solution.name])
            return None
        state = SolutionState(solution.name, solution.hash, runnable.fn, runnable.destination_passing_style,
                              self.config.finite_check_calls, monitor=self._monitor(row) if row else None,
                              artifact=row.artifact_id if row else None, stage=row.stage.value if row else None)
        self._states[solution.hash] = state
        return state

    # -- circuit breaker -----------------------------------------------------------------
    def _switch_off(self, state: SolutionState, why: str) -> None:
        """Switch a solution off for the rest of the process; its keys go to runner-ups or fall back."""
        if state.disabled is not None:
            return
        state.disabled = why
        log.warning("apply: switched off %s for the rest of the process: %s", state.name, why)
        for d in self.dispatchers.values():
            if any(state in states for states in d.ranked.values()):
                d.compile()
        if state.artifact is not None:
            self._record_demotion(state, why)

    def _record_demotion(self, state: SolutionState, why: str) -> None:
        """A promoted artifact failed while serving: a `demoted` promotions row, if the store takes it."""
        self._demotions[state.artifact] = None
        row = self.promotions.get(state.artifact) if self.promotions else None
        if row is None or self._promotion_log is None or not self.config.record_demotions:
            return
        counters = state.monitor.counters.__dict__ if state.monitor is not None else {}
        demoted = row.model_copy(update={
            "stage": Stage.DEMOTED, "gate": Gate.RUNTIME, "outcome": Outcome.FAILED, "reason": why,
            "evidence": {"stage": row.stage.value, "calls": state.calls, **counters},
            "actor": f"apply@{socket.gethostname()}:{os.getpid()}",
            "recorded_at": PromotionRecord.model_fields["recorded_at"].default_factory()})
        try:
            self._promotion_log.append([demoted])
            self._demotions[state.artifact] = True
        except (StoreError, OSError) as e:  # a read-only store: the counters still say it
            self._demotions[state.artifact] = False
            log.warning("apply: could not record the demotion of %s: %s", state.name, e)

    def switch_off(self, solution_name: str, why: str = "switched off by the user") -> None:
        """Switch one solution off by hand (its calls go to runner-ups or the fallback)."""
        for state in self._states.values():
            if state.name == solution_name:
                self._switch_off(state, why)
                return
        raise KeyError(f"apply: no built solution named {solution_name!r}")

    # -- activation ----------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether decorated functions currently dispatch through this runtime."""
        return HOOKS.runtime is self

    def activate(self) -> ApplyRuntime:
        """Make this the process's apply runtime (replacing any other); a no-op if disabled."""
        if self.disabled_reason is None:
            set_runtime(self)
        return self

    def deactivate(self) -> None:
        """Stop dispatching through this runtime: every call goes to its fallback."""
        if HOOKS.runtime is self:
            set_runtime(None)

    def __enter__(self) -> Self:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    def count_unknown(self, name: str) -> None:
        """A call named a definition this runtime has no dispatcher for."""
        self._unknown[name] += 1

    # -- counters ------------------------------------------------------------------------
    def stats(self) -> ApplyStats:
        """A snapshot of the counters."""
        for d in self.dispatchers.values():
            d.sync_counters()  # before reading the solutions' call counts, which it adds to
        per = {
            name: DefinitionStats(d.hits, d.bucketed, d.misses, d.fallbacks, len(d.ranked))
            for name, d in self.dispatchers.items()
        }
        for name, n in self._unknown.items():
            old = per.get(name, DefinitionStats())
            per[name] = DefinitionStats(old.hits, old.bucketed, old.misses + n, old.fallbacks, old.keys)
        return ApplyStats(
            enabled=self.active,
            hits=sum(s.hits for s in per.values()),
            bucketed=sum(s.bucketed for s in per.values()),
            misses=sum(s.misses for s in per.values()),
            fallbacks=sum(s.fallbacks for s in per.values()),
            definitions=per,
            solution_calls={s.name: s.calls for s in self._states.values()},
            switched_off={s.name: s.disabled for s in self._states.values() if s.disabled is not None},
            dropped_builds=dict(self.dropped_builds),
            index=self.report,
            disabled_reason=self.disabled_reason,
            artifacts={s.artifact: ArtifactStats(
                s.artifact, s.name, self.promotions[s.artifact].definition, s.stage, s.calls, s.disabled,
                self._demotions.get(s.artifact), StageCounters(**s.monitor.counters.__dict__) if s.monitor else None)
                for s in self._states.values() if s.artifact is not None},
            not_promoted=dict(self.not_promoted),
        )


def build_runtime(
    store: str | Path | TraceStore,
    dataset: str | Path | Dataset,
    *,
    solution_roots: Sequence[str | Path] = (),
    config: ApplyConfig | None = None,
) -> ApplyRuntime:
    """Read the store, rank, and build the winners; the runtime is returned inactive."""
    config = config or ApplyConfig()
    if disabled_by_env():
        log.warning("apply: %s is set; every call will use its fallback", DISABLE_ENV)
        return ApplyRuntime({}, IndexReport(), config, disabled_reason=f"{DISABLE_ENV} is set")
    if not isinstance(dataset, Dataset):
        dataset = load_dataset(dataset, definitions=config.definitions, solution_roots=solution_roots,
                               require_blobs=False)
    running = running_environment()
    index, report = build_index(read_rows(store, config.sweeps), dataset.definitions, dataset.solutions.values(),
                                running, config)
    log.info("apply: %d store rows, %d used, rejected %s", report.rows, report.used, dict(report.rejected))
    promotions, plog = None, None
    if config.require_promotion:
        plog = PromotionLog(store.root if isinstance(store, TraceStore) else store)
        promotions = plog.latest()
        if not promotions:
            log.warning("apply: require_promotion is set and %s has no promotion records; every call uses its fallback",
                        plog.folder)
    return ApplyRuntime(index, report, config, running, promotions=promotions, promotion_log=plog)


def enable_apply(
    store: str | Path | TraceStore,
    dataset: str | Path | Dataset,
    *,
    solution_roots: Sequence[str | Path] = (),
    config: ApplyConfig | None = None,
) -> ApplyRuntime:
    """Build a runtime from a trace store and a dataset (definitions + solutions) and activate it.

    Honours the FIBRAY_APPLY_DISABLE switch: then nothing is read or built and every call
    goes to its fallback. Use the result as a context manager to deactivate it on exit.
    """
    return build_runtime(store, dataset, solution_roots=solution_roots, config=config).activate()


def disable_apply() -> None:
    """The switch-off for everything: from now on every decorated call goes to its fallback."""
    set_runtime(None)


def current_runtime() -> ApplyRuntime | None:
    """The active runtime, or None."""
    return HOOKS.runtime


def stats() -> ApplyStats | None:
    """Counters of the active runtime, or None when apply is not enabled."""
    return HOOKS.runtime.stats() if HOOKS.runtime is not None else None
