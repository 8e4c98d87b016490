"""The judge of one evaluation: it holds the inputs and reference outputs of a workload, the
memory a job's calls run on, and decides verdicts on memory it owns. It never runs candidate code.
"""

from __future__ import annotations

import math
import secrets
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fibray.compile import bound_log, build_reference
from fibray.evaluate.candidate import TimeResult, TimingPlan, TrialOutput, normalize_outputs
from fibray.check import CheckResult, Draws, Tolerance, checker_for, judge_calls, wants_draws
from fibray.check.base import structural
from fibray.check.fused import warm as warm_checks
from fibray.evaluate.memory import (
    KEEP_REGION_BYTES, KEEP_REGION_BYTES_GPU, TIMED_REFS_CACHE_BYTES, TIMING_BUDGET_BYTES, TIMING_MAX_SETS, GUARD_BYTES,
    JobMemory, KeptRegion, LocalRegion, Region,
    InputChanges, args_of, draw_seeds, inputs_copy, judged_calls, own_buffer_calls, plan_layout, sample_size,
    timed_output_bytes, workload_cache_bytes,
)
from fibray.evaluate.inputs import BlobCache, clone_args, job_inputs, torch_dtype
from fibray.schema.reasons import Reason
from fibray.schema import (
    Correctness, Definition, Environment, EvalSettings, Evaluation, EvaluationStatus, Job, Performance,
)
from fibray.evaluate.phases import now_iso
from fibray.timing import LatencyStats, Timing, time_calls
from fibray.timing.bound import BOUND_ATTEMPTS
from fibray.timing.roofline import DeviceCaps, below_floor, device_caps
from fibray.timing.timer import calls_after_warmup

Status = EvaluationStatus

REFERENCE_LATENCIES_KEPT = 1 << 16
"""Reference latencies a judge remembers (Judge.reference_latency), the first timed out first."""


@dataclass
class _Timed:
    """What a workload's timed calls made must have produced: the reference outputs of the calls the
    supervisor judges, and every input set as it must be after the last call."""

    refs: dict[int, list[torch.Tensor]]
    final: list[list[Any]]


@dataclass
class _WorkloadState:
    """Inputs and reference outputs of one workload: trials 0..n-1 and the re-check set n."""

    inputs: list[list[Any]]
    refs: list[list[torch.Tensor]]
    nbytes: int = 0
    extra: list[list[Any]] = field(default_factory=list)
    """Further input sets for timing (trial indices past the re-check set)."""
    seeds: list[list[int]] = field(default_factory=list)
    """Per timing attempt (a retry after a broken bound is the next), the secret seed of each timed
    call's input change: drawn once per workload, here, never by an executor."""
    timed: dict[tuple, _Timed] = field(default_factory=dict)
    masks: dict[tuple, Optional[torch.Tensor]] = field(default_factory=dict)
    """The flip masks of the input sets' changes (InputChanges), made once per workload for _timed's copies."""
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _JobPlan:
    """How one job's timing is laid out: input sets, calls per set, timed calls (both passes)."""

    sets: int
    iterations: int
    calls: int
    """Timed calls planned (both passes); an adaptive timing makes fewer."""
    seeds: list[list[int]]
    """Per attempt (BOUND_ATTEMPTS), one per planned call: sent with that attempt's timing request."""

    def timing(self) -> TimingPlan:
        return TimingPlan(iterations=self.iterations, calls=self.calls)


def _nbytes(args: list[Any]) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _local(size: int, device: torch.device) -> Region:
    return LocalRegion(size, device)


def _timed_verdicts(checker, outs: list[list[torch.Tensor]], refs: list[list[torch.Tensor]], names: list[str],
                    tol: Tolerance) -> list[CheckResult]:
    """Timed calls' outputs against their references: random outputs (judged over draws in the trials)
    by their shape and kind; the rest all at once (a call at a time, the same verdicts:
    tests/test_check_batch.py)."""
    if not outs:
        return []
    if wants_draws(checker):
        return [next((r for r in map(structural, o, ref, names) if r), None) or CheckResult() for o, ref in zip(outs, refs)]
    return judge_calls(checker, outs, refs, names, tol)


def _warm_checks(device: torch.device) -> None:
    """fibray.check.fused.warm, where a failure only leaves the compile to the first check that needs it."""
    try:
        warm_checks(device)
    except Exception as e:  # noqa: BLE001  (the first check compiles, or takes the torch path, and says why there)
        print(f"fibray: the output checks' kernels were not compiled ahead on {device}: {e!r}", file=sys.stderr)


class Judge:
    """Holds references and decides verdicts; never runs candidate code."""

    def __init__(self, workdir: Path, device: torch.device, env: Environment, cache_bytes: Optional[int] = None,
                 regions: Optional[Callable[[int, torch.device], Region]] = None, region_kind: Optional[str] = None) -> None:
        self.workdir, self.device, self.env = Path(workdir), device, env
        self.regions = regions or _local
        """Allocates a job's region: plain memory in this process by default; a slot passes host shared
        memory (CPU) or CUDA VMM (GPU), which its executors map."""
        self.region_kind = region_kind or "local"
        self.blobs = BlobCache()
        self._refs: dict[str, Any] = {}
        self._workloads: OrderedDict[tuple, _WorkloadState] = OrderedDict()
        self._ref_latencies: OrderedDict[tuple, tuple[LatencyStats, str]] = OrderedDict()
        """The reference's latency per workload and timing settings, and the job that timed it: kept apart from
        the workloads' states, which the cache lets go, so that a slot times a reference once (its jobs all
        report that one measurement), up to REFERENCE_LATENCIES_KEPT of them."""
        self._cache_bytes = workload_cache_bytes(device) if cache_bytes is None else cache_bytes
        """What the workloads' states may hold (their nbytes) before the least recently used goes."""
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}
        """One lock per workload being materialised: lanes on the same workload build it once."""
        self.own_buffers = device.type == "cuda"
        """Every timed call writes output buffers of its own (fewer calls where they would not fit:
        own_buffer_calls); False: calls beyond TIMED_OUTPUT_BYTES share them, judged where each is final
        by a supervisor that steps every call (a CPU slot's TimedSample). A GPU slot has no such steps."""
        self._kept_sizes: dict[str, int] = {}
        """The largest job region each definition needed here that an executor may keep: an executor's kept region
        is made that large at once, so its solution's workloads, which come smallest first every other group
        (fibray.sweep.pool), need no larger one job after job."""
        self.caps: Optional[DeviceCaps] = None
        """The device's measured bandwidth and throughput for the roofline floor (measured on first use; none on a CPU)."""
        if device.type == "cuda":  # the checks' kernels compiled beside whatever starts with this judge, launching nothing
            threading.Thread(target=_warm_checks, args=(device,), name="fibray-warm-checks", daemon=True).start()

    # -- verdict helpers -------------------------------------------------------------------
    def fail(self, status: Status | str, reason: str, log: str, s: EvalSettings, metrics: Optional[CheckResult] = None) -> Evaluation:
        status = Status(status)
        corr = None
        if status == Status.INCORRECT_NUMERICAL:
            m = metrics or CheckResult(max_abs=float("nan"), max_rel=float("nan"))
            corr = Correctness(max_absolute_error=m.max_abs, max_relative_error=m.max_rel, extra=m.extra or None)
        return Evaluation(status=status, reason=reason, log=bound_log(log, s.log_limit), correctness=corr,
                          environment=self.env, timestamp=now_iso())

    # -- reference side --------------------------------------------------------------------
    def _reference(self, definition: Definition):
        key = definition.name + ":" + str(hash(definition.reference))
        with self._lock:  # lanes ask for it from several threads
            if key not in self._refs:
                self._refs[key] = build_reference(definition.reference, definition.name, self.workdir / "references")
            return self._refs[key]

    @staticmethod
    def _workload_key(job: Job) -> tuple:
        """What a workload's inputs and references depend on (random_inputs is part of the definition, as its reference is)."""
        s = job.settings
        return (job.definition.name, hash(job.definition.reference), job.workload.uuid, s.seed, s.trials, job.dataset_root,
                job.input_key, s.input_distribution)

    def state(self, job: Job) -> _WorkloadState:
        """Inputs and reference outputs of the job's workload (cached per workload). Raises InputError."""
        key = self._workload_key(job)
        with self._lock:
            state = self._workloads.get(key)
            if state is not None:
                self._workloads.move_to_end(key)
                return state
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                state = self._workloads.get(key)
            if state is None:
                state = self._materialise(job)
                with self._lock:
                    self._workloads[key] = state
                self._trim()
            with self._lock:
                self._building.pop(key, None)
        return state

    def _trim(self) -> None:
        """The least recently used workloads out while what they all hold is over the cache's bytes (the
        newest stays): after a workload is made, and after one grows (its timing sets, its replayed sets)."""
        with self._lock:
            while len(self._workloads) > 1 and sum(w.nbytes for w in self._workloads.values()) > self._cache_bytes:
                self._workloads.popitem(last=False)

    def _materialise(self, job: Job) -> _WorkloadState:
        s = job.settings
        ref = self._reference(job.definition)
        inputs, refs = [], []
        for trial in range(s.trials + 1):
            args = job_inputs(job, trial, self.device, self.blobs)
            with torch.no_grad():
                out = normalize_outputs(ref(*clone_args(args)), job.definition)
            refs.append([torch.as_tensor(o).to(self.device, torch_dtype(spec.dtype))
                         for o, spec in zip(out, job.definition.outputs.values())])
            inputs.append(args)
        nbytes = sum(t.numel() * t.element_size() for g in (*inputs, *refs) for t in g if isinstance(t, torch.Tensor))
        return _WorkloadState(inputs=inputs, refs=refs, nbytes=nbytes)

    def tolerance(self, job: Job) -> tuple[Tolerance, str]:
        c, s = job.definition.check, job.settings
        tol = Tolerance(
            atol=c.atol if c and c.atol is not None else s.atol,
            rtol=c.rtol if c and c.rtol is not None else s.rtol,
            matched_ratio=c.matched_ratio if c and c.matched_ratio is not None else s.matched_ratio,
        )
        return tol, (c.kind if c else "elementwise")

    # -- the job's memory and what the supervisor verifies in it ----------------------------
    def keeper(self) -> KeptRegion:
        """A region for one executor to keep from job to job (pass it to open)."""
        return KeptRegion(lambda size: self.regions(size, self.device),
                          KEEP_REGION_BYTES_GPU if self.device.type == "cuda" else KEEP_REGION_BYTES)

    def kept_size(self, definition: str) -> int:
        """The largest kept region a job of `definition` has needed here so far (0: none yet)."""
        with self._lock:
            return self._kept_sizes.get(definition, 0)

    def open(self, job: Job, state: _WorkloadState, keep: Optional[KeptRegion] = None) -> tuple[JobMemory, _JobPlan]:
        """Allocate the job's region (or lend `keep`'s), write every input set into it and poison every output buffer.
        Timing uses the trials' sets and further ones (at most TIMING_MAX_SETS, TIMING_BUDGET_BYTES);
        each timed call writes its own output buffers while they fit in timed_output_bytes (own_buffers: fewer
        calls where they would not)."""
        s, d = job.settings, job.definition
        trials = state.inputs[: s.trials]
        per_set = _nbytes(trials[0]) or 1
        extra = max(0, min(s.iterations * s.trials, TIMING_MAX_SETS, TIMING_BUDGET_BYTES // per_set) - s.trials)
        with state.lock:
            while len(state.extra) < extra:  # trial indices past the checked ones and the re-check
                state.extra.append(self._materialise_set(job, s.trials + 1 + len(state.extra)))
                state.nbytes += _nbytes(state.extra[-1])
        self._trim()
        sets = [*trials, *state.extra[:extra]]
        iterations = max(1, -(-s.iterations * len(trials) // len(sets)))
        calls = calls_after_warmup(iterations, len(sets), self.device, s.sync_device)
        specs = [(torch_dtype(o.dtype), tuple(d.shape_of(o, job.workload.axes) or ())) for o in d.outputs.values()]
        out_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() + 2 * GUARD_BYTES for dt, shape in specs)
        dps = job.solution.spec.destination_passing_style
        snapshots = dps and self.device.type == "cpu"
        fit = max(1, timed_output_bytes(self.device) // (out_bytes * (2 if snapshots else 1)))
        if self.own_buffers and fit < calls:  # fewer calls, each with buffers of its own
            fitted = own_buffer_calls(fit, iterations, len(sets), s.trials,
                                      lambda i, n: calls_after_warmup(i, n, self.device, s.sync_device))
            if fitted is not None:
                iterations, n_sets = fitted
                sets = sets[:n_sets]
                calls = calls_after_warmup(iterations, n_sets, self.device, s.sync_device)
        buffers = min(calls, fit)
        layout = plan_layout(self.region_kind, str(self.device), sets, specs, s.trials, dps, buffers, snapshots)
        if keep is not None:
            with self._lock:
                at_least = self._kept_sizes.get(d.name, 0)
                if layout.size <= keep.keep_bytes:
                    self._kept_sizes[d.name] = max(at_least, layout.size)
            region = keep.lend(layout.size, at_least)
        else:
            region = self.regions(layout.size, self.device)
        if region.size != layout.size:  # a kept region larger than this job needs: the executor maps all of it
            layout = layout.model_copy(update={"size": region.size})
        mem = JobMemory(region, layout, self.device)
        try:
            for i, values in enumerate(sets):
                mem.write_inputs(i, values)
            mem.prepare_outputs(list(range(len(layout.outputs))))
            mem.settle()
        except BaseException:
            mem.close()
            raise
        with state.lock:
            while len(state.seeds) < BOUND_ATTEMPTS:
                state.seeds.append([])
            for drawn in state.seeds:
                drawn.extend(draw_seeds(calls - len(drawn)))
            seeds = [drawn[:calls] for drawn in state.seeds]
        return mem, _JobPlan(sets=len(sets), iterations=iterations, calls=calls, seeds=seeds)

    def _materialise_set(self, job: Job, trial: int) -> list[Any]:
        return job_inputs(job, trial, self.device, self.blobs)

    def _timed(self, job: Job, state: _WorkloadState, mem: JobMemory, sets: list[list[Any]], called: list[int],
               attempt: int, want: set[int]) -> _Timed:
        """The reference of every timed call in `want` (the judged sample, and the kept ones), computed here
        on this side's own copy of the input sets changed exactly as the calls made under `attempt`'s seeds
        must have changed them, and the input sets as the last call left them. What jobs of the same calls
        share is kept per workload: the final sets, and references while they fit TIMED_REFS_CACHE_BYTES."""
        key = (len(sets), len(mem.layout.timed), tuple(called), attempt)
        with state.lock:
            cached = state.timed.get(key)
            if cached is not None and want <= cached.refs.keys():
                return _Timed(refs={i: cached.refs[i] for i in want}, final=cached.final)
            missing = want - (cached.refs.keys() if cached is not None else set())
            ref = self._reference(job.definition)
            copy = inputs_copy(mem.layout, sets, self.device)
            work = [args_of(copy, row) for row in mem.layout.inputs]
            known = len(state.masks)
            changes = InputChanges.of_layout(mem.layout, copy, state.masks)
            state.nbytes += _nbytes(list(state.masks.values())[known:])  # the masks made now (None: a set without floats)
            refs: dict[int, list[torch.Tensor]] = {}
            for i in called:
                if cached is not None and not missing - refs.keys():
                    break  # the final sets are cached already: a replay stops at its last reference
                args = work[i % len(work)]
                changes[i % len(work)].apply(state.seeds[attempt][i])
                if i in missing:
                    with torch.no_grad():
                        out = normalize_outputs(ref(*clone_args(args)), job.definition)
                    refs[i] = [torch.as_tensor(o).to(self.device, torch_dtype(spec.dtype))
                               for o, spec in zip(out, job.definition.outputs.values())]
            if cached is None:
                cached = state.timed[key] = _Timed(refs={}, final=work)
                state.nbytes += copy.size
            held = sum(map(_nbytes, cached.refs.values()))
            for i, r in refs.items():  # kept for the next job's sample while they fit
                size = _nbytes(r)
                if held + size <= TIMED_REFS_CACHE_BYTES:
                    cached.refs[i], held, state.nbytes = r, held + size, state.nbytes + size
            timed = _Timed(refs={i: refs[i] if i in refs else cached.refs[i] for i in want}, final=cached.final)
        self._trim()
        return timed

    def check_call(self, job: Job, mem: JobMemory, s_index: int, k: int, inputs: list[Any], refs: list[torch.Tensor],
                   out: TrialOutput) -> CheckResult:
        """Judge one call on the supervisor's own mapping: what the executor said against itself,
        guard bytes, inputs byte for byte, then the outputs with the numerical checker."""
        if out.failure is not None:
            f = out.failure
            return CheckResult(status=Status(f.status), reason=f.reason, message=f.log)
        if not mem.guards_intact(k):
            return CheckResult(Status.INCORRECT_NUMERICAL, Reason.OUT_OF_BOUNDS_WRITE, "bytes around an output buffer were overwritten")
        changed = mem.changed_input(s_index, inputs)
        if changed is not None:
            name = list(job.definition.inputs)[changed]
            return CheckResult(Status.INCORRECT_NUMERICAL, Reason.MUTATED_INPUTS, f"input {name!r} was modified by the call")
        tol, kind = self.tolerance(job)
        checker = checker_for(kind)
        if wants_draws(checker):  # a stochastic output (sampling) is judged over many draws
            return checker(mem.outputs(k), refs, list(job.definition.outputs), tol, draws=Draws(job.definition, inputs, out.draws))
        return checker(mem.outputs(k), refs, list(job.definition.outputs), tol)

    def unchanged_sets(self, job: Job, mem: JobMemory, expected: list[list[Any]], what: str) -> CheckResult:
        """Every input set of the region against what it must hold."""
        changed = mem.changed_inputs(dict(enumerate(expected)))
        if changed is not None:
            j, i = changed
            name = list(job.definition.inputs)[i]
            return CheckResult(Status.INCORRECT_NUMERICAL, Reason.MUTATED_INPUTS, f"input {name!r} of set {j} {what}")
        return CheckResult()

    def check_timed(self, job: Job, state: _WorkloadState, mem: JobMemory, plan: _JobPlan, sets: list[list[Any]],
                    result: TimeResult, attempt: int = 0,
                    kept: Optional[dict[int, list[torch.Tensor]]] = None,
                    final: Optional[dict[int, list[torch.Tensor]]] = None) -> CheckResult:
        """After timing attempt `attempt` (its seeds): every input set as the changes of the calls made
        left it, and the outputs of a sample of the timed calls (sample_size of them, drawn after the
        calls) against their references, guard bytes and (CPU, DPS) the copy taken as each call
        returned; then `kept`, this side's own copies of a secret sample of the calls' outputs taken as
        they were final (fibray.evaluate.memory.TimedSample: where calls outnumber their buffers).
        `final` (buffer -> its outputs copied at the timing's end step, fibray.evaluate.memory.final_copies):
        the sample is those buffers, judged from the copies; without it the sample is drawn now and read
        from the buffers. Where the executor made fewer calls than planned (an adaptive timing), buffers
        the copies leave out are drawn to make up the sample, read from the buffers."""
        if result.failure is not None:
            f = result.failure
            return CheckResult(status=Status(f.status), reason=f.reason, message=f"in a timed call: {f.log}")
        called = result.called
        if not called or any(b <= a for a, b in zip(called, called[1:])) or called[-1] >= plan.calls or called[0] < 0:
            return CheckResult(Status.RUNTIME_ERROR, Reason.BAD_TIMING_REPORT,
                               f"the executor's list of timed calls made is not increasing indices below {plan.calls}")
        layout = mem.layout
        kept = kept or {}
        missing = sorted(set(kept) - set(called))
        if missing:
            return CheckResult(Status.RUNTIME_ERROR, Reason.BAD_TIMING_REPORT,
                               f"the executor's list of timed calls made leaves out call {missing[0]}, which the "
                               f"supervisor stepped")
        judged = judged_calls(called, len(layout.timed))
        final = final or {}
        copied = [b for b in sorted(final) if b in judged]
        rest = [b for b in sorted(judged) if b not in final]
        more = min(len(rest), max(0, sample_size(len(judged)) - len(copied)))
        sample = sorted(copied + secrets.SystemRandom().sample(rest, more))
        timed = self._timed(job, state, mem, sets, called, attempt, {judged[b] for b in sample} | set(kept))
        bad = self.unchanged_sets(job, mem, timed.final, "differs from what the changes between timed calls leave")
        if not bad.ok:
            return bad
        tol, kind = self.tolerance(job)
        checker, names = checker_for(kind), list(job.definition.outputs)
        intact = mem.guards_intact_many([layout.timed[b] for b in sample])
        outs = [final[b] if b in final else mem.outputs(layout.timed[b]) for b in sample]
        verdicts = _timed_verdicts(checker, outs, [timed.refs[judged[b]] for b in sample], names, tol)
        verdict = CheckResult()
        for b, guarded, out, one in zip(sample, intact, outs, verdicts):  # the first call to fail decides
            call = judged[b]
            if not guarded:
                return CheckResult(Status.INCORRECT_NUMERICAL, Reason.OUT_OF_BOUNDS_WRITE,
                                   f"bytes around an output buffer of timed call {call} were overwritten")
            if layout.snapshots:
                snap = mem.outputs(layout.snapshots[b])
                if not all(torch.equal(a.reshape(-1).view(torch.uint8), c.reshape(-1).view(torch.uint8)) for a, c in zip(out, snap)):
                    return CheckResult(Status.INCORRECT_NUMERICAL, Reason.OUTPUT_CHANGED_AFTER_RETURN,
                                       f"the outputs of timed call {call} changed after the call returned")
            if not one.ok:
                return CheckResult(one.status, Reason.WRONG_WHILE_TIMED, f"timed call {call} ({one.reason}): {one.message}",
                                   max_abs=one.max_abs, max_rel=one.max_rel)
            verdict.merge(one)
        rest = [c for c in sorted(kept) if c not in {judged[b] for b in sample}]  # not judged from its buffer above
        verdicts = _timed_verdicts(checker, [kept[c] for c in rest], [timed.refs[c] for c in rest], names, tol)
        for call, one in zip(rest, verdicts):
            if not one.ok:
                return CheckResult(one.status, Reason.WRONG_WHILE_TIMED,
                                   f"timed call {call} ({one.reason}; its outputs as the supervisor copied them when "
                                   f"they were final, in its secret sample of the timed calls): {one.message}",
                                   max_abs=one.max_abs, max_rel=one.max_rel)
            verdict.merge(one)
        return verdict

    @classmethod
    def _reference_key(cls, job: Job) -> tuple:
        s = job.settings
        return (*cls._workload_key(job), s.warmup, s.iterations, s.flush_l2, s.sync_device, s.timing)

    def reference_latency(self, job: Job, state: _WorkloadState) -> tuple[LatencyStats, str]:
        """The reference's latency on the job's workload at its timing settings, and the job that timed it:
        timed on `state`'s trial inputs the first time a slot needs it, then the same for every job."""
        key = self._reference_key(job)
        with self._lock:
            known = self._ref_latencies.get(key)
        if known is None:
            s = job.settings
            arg_sets = [clone_args(a) for a in state.inputs[: s.trials]]
            with torch.no_grad():
                timing = time_calls(self._reference(job.definition), arg_sets, warmup=s.warmup, iterations=s.iterations,
                                    device=self.device, flush_l2=s.flush_l2, sync_device=s.sync_device,
                                    adaptive=s.timing == "adaptive")
            known = (LatencyStats.of(timing.samples_ms), job.job_id)
            with self._lock:
                known = self._ref_latencies.setdefault(key, known)  # a lane that timed it first wins
                while len(self._ref_latencies) > REFERENCE_LATENCIES_KEPT:
                    self._ref_latencies.popitem(last=False)
        return known

    def known_reference(self, job: Job):
        """The reference latency the store already holds for this job's environment (a KnownReference), or None."""
        from fibray.schema.job import environment_key

        if not job.settings.time_reference or not job.known_references:
            return None
        return job.known_references.get(environment_key(self.env.hardware, self.env.libs))

    def reference_ready(self, job: Job) -> bool:
        """Whether `passed` needs no time on the GPU: the device's limits are measured and the reference's
        latency is known (timed for this workload already, in the store, or not asked for)."""
        if self.known_reference(job) is not None:
            return True
        measured = self.caps is not None or self.device.type != "cuda"  # a CPU has no roofline to measure
        if not measured or not job.settings.time_reference:
            return measured
        with self._lock:
            return self._reference_key(job) in self._ref_latencies

    def passed(self, job: Job, state: _WorkloadState, verdict: CheckResult, timing: Timing) -> Evaluation:
        s = job.settings
        stats = LatencyStats.of(timing.samples_ms)
        if self.caps is None:
            self.caps = device_caps(self.device)  # under the exclusive GPU (reference timing's hold)
        too_fast = below_floor(stats.median_ms, job.definition, job.workload.axes, self.caps)
        if too_fast is not None:  # skipped work or a fooled timer, not a fast kernel
            return self.fail(Status.RUNTIME_ERROR, Reason.BELOW_ROOFLINE, too_fast, s)
        known = self.known_reference(job)
        source, ref_job = (None, None) if not s.time_reference else ("reused", known.job_id) if known else ("measured", None)
        if known is not None:
            ref_ms = known.latency_ms
        else:
            ref_stats, ref_job = self.reference_latency(job, state) if s.time_reference else (None, None)
            ref_ms = ref_stats.median_ms if ref_stats is not None else 0.0
        perf = Performance(
            latency_ms=stats.median_ms, reference_latency_ms=ref_ms,
            speedup_factor=ref_ms / stats.median_ms if stats.median_ms > 0 and ref_ms > 0 else 0.0,
            latency_p95_ms=stats.p95_ms, latency_mean_ms=stats.mean_ms, latency_cv=stats.cv, n_samples=stats.n,
            timing_mode=timing.mode, reference_latency_source=source, reference_job_id=ref_job,
        )
        corr = Correctness(max_absolute_error=verdict.max_abs, max_relative_error=verdict.max_rel, extra=verdict.extra or None)
        return Evaluation(status=Status.PASSED, correctness=corr, performance=perf, environment=self.env, timestamp=now_iso())

    def failed(self, job: Job, verdict: CheckResult) -> Evaluation:
        return self.fail(verdict.status, verdict.reason or Reason.FAILED, verdict.message, job.settings, metrics=verdict)


