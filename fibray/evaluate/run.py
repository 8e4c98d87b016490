"""One honest evaluation: build, materialise inputs, reference, check, time -> Evaluation.

The work is split between two roles so that they can live in different processes:
`CandidateRunner` (fibray.evaluate.candidate) runs untrusted code and reports what it produced;
`Judge` (here) holds the reference outputs and decides the verdict. `Evaluator` puts both
in one process, for tests and local use; the sweep's workers keep them apart. A
candidate's failure becomes an Evaluation with a status and a reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from fibray.compile import build_reference, prepare_triton
from fibray.evaluate.candidate import CandidateRunner, TrialOutput, normalize_outputs
from fibray.check import CheckResult, Draws, Tolerance, checker_for, wants_draws
from fibray.evaluate.inputs import BlobCache, InputError, clone_args, job_inputs, torch_dtype
from fibray.schema import (
    Correctness, Definition, Environment, EvalSettings, Evaluation, EvaluationStatus, Job, Performance,
)
from fibray.evaluate.environment import default_device, environment
from fibray.evaluate.phases import Phases, now_iso
from fibray.timing import LatencyStats, Timing, time_calls
from fibray.schema.reasons import Reason
from fibray.timing.bound import BoundBroken, Overhead, bounded_time
from fibray.timing.roofline import DeviceCaps, below_floor, device_caps

Status = EvaluationStatus


def bound_log(text: str, limit: int) -> str:
    """Keep the head and the tail of a long log (the tail holds the exception)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head - 40
    return f"{text[:head]}\n... [{len(text) - head - tail} chars cut] ...\n{text[-tail:]}"


@dataclass
class _WorkloadState:
    """Inputs and reference outputs of one workload: trials 0..n-1 and the re-check set n."""

    inputs: list[list[Any]]
    refs: list[list[torch.Tensor]]
    ref_stats: Optional[LatencyStats] = None
    ref_job: Optional[str] = None
    """The job whose evaluation timed `ref_stats`."""
    nbytes: int = 0


class Judge:
    """Holds references and decides verdicts; never runs candidate code."""

    def __init__(self, workdir: Path, device: torch.device, env: Environment, cache_bytes: int = 2 << 30) -> None:
        self.workdir, self.device, self.env = Path(workdir), device, env
        self.blobs = BlobCache()
        self._refs: dict[str, Any] = {}
        self._workloads: OrderedDict[tuple, _WorkloadState] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}
        """One lock per workload being materialised: lanes on the same workload build it once."""
        self.caps: Optional[DeviceCaps] = None
        """The device's measured bandwidth and throughput for the roofline floor (measured on first use; none on a CPU)."""

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

    def state(self, job: Job) -> _WorkloadState:
        """Inputs and reference outputs of the job's workload (cached per workload). Raises InputError."""
        s = job.settings
        key = (job.definition.name, hash(job.definition.reference), job.workload.uuid, s.seed, s.trials, job.dataset_root,
               job.input_key, s.input_distribution)  # random_inputs is part of the definition, as its reference is
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
                    while len(self._workloads) > 1 and sum(w.nbytes for w in self._workloads.values()) > self._cache_bytes:
                        self._workloads.popitem(last=False)
            with self._lock:
                self._building.pop(key, None)
        return state

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

    def check(self, job: Job, state: _WorkloadState, trial: int, out: TrialOutput) -> CheckResult:
        """Judge one call: the candidate's own failure (mutated inputs included), then the numerical checker."""
        if out.failure is not None:
            f = out.failure
            return CheckResult(status=Status(f.status), reason=f.reason, message=f.log)
        tol, kind = self.tolerance(job)
        outputs = [o.to(self.device) if isinstance(o, torch.Tensor) else o for o in out.outputs]
        checker = checker_for(kind)
        if wants_draws(checker):  # a stochastic output (sampling) is judged over many draws
            draws = Draws(job.definition, state.inputs[trial], out.draws)
            return checker(outputs, state.refs[trial], list(job.definition.outputs), tol, draws=draws)
        return checker(outputs, state.refs[trial], list(job.definition.outputs), tol)

    def reference_latency(self, job: Job, state: _WorkloadState) -> LatencyStats:
        if state.ref_stats is None:
            s = job.settings
            arg_sets = [clone_args(a) for a in state.inputs[: s.trials]]
            with torch.no_grad():
                timing = time_calls(self._reference(job.definition), arg_sets, warmup=s.warmup, iterations=s.iterations,
                                    device=self.device, flush_l2=s.flush_l2, sync_device=s.sync_device,
                                    adaptive=s.timing == "adaptive")
            state.ref_stats, state.ref_job = LatencyStats.of(timing.samples_ms), job.job_id
        return state.ref_stats

    def known_reference(self, job: Job):
        """The reference latency the store already holds for this job's environment (a KnownReference), or None."""
        from fibray.schema.job import environment_key

        if not job.settings.time_reference or not job.known_references:
            return None
        return job.known_references.get(environment_key(self.env.hardware, self.env.libs))

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
            ref_ms = self.reference_latency(job, state).median_ms if s.time_reference else 0.0
            ref_job = state.ref_job if s.time_reference else None
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


class Evaluator:
    """Candidate runner and judge in one process (tests, local use). The sweep keeps them apart."""

    def __init__(self, workdir: Path, device: Optional[torch.device] = None, cache_bytes: int = 2 << 30) -> None:
        prepare_triton()  # before anything imports triton
        self.workdir = Path(workdir)
        self.device = device or default_device()
        self.env = environment(self.device)
        self.runner = CandidateRunner(self.workdir, self.device)
        self.judge = Judge(self.workdir, self.device, self.env, cache_bytes)

    def evaluate(self, job: Job) -> Evaluation:
        """Run a job to a verdict."""
        try:
            return run_job(job, self.judge, self.runner)
        finally:
            self.runner.finish(job)


class SideFault(Exception):
    """The candidate's side broke down (its process hung, died or was poisoned) rather than the
    candidate's call failing: run_job passes it up to whoever runs that side, never judges it."""


class CandidateCallFailed(Exception):
    """The candidate's call failed and its side already classified the failure: an executor's own
    status, reason and log for an exception its candidate raised, which run_job keeps as they are."""

    def __init__(self, status: Status | str, reason: str, log: str) -> None:
        super().__init__(f"{reason}: {log[:200]}")
        self.status, self.reason, self.log = status, reason, log


class _OwnGpu:
    """The GPU lock of a process that runs one job at a time: never waits."""

    @contextmanager
    def hold(self, phase: Phases, name: str, exclusive: bool = False) -> Iterator[None]:
        with phase(name):
            yield


def run_job(job: Job, judge: Judge, calls, phases: Optional[Phases] = None, gpu=None,
            overhead: Optional[Overhead] = None) -> Evaluation:
    """The evaluation protocol, against any candidate side with build/trial/prepare_time/time/recheck
    (a CandidateRunner in this process, or a slot's channel to an executor). `gpu` (a slot's
    GpuLock) lets jobs share the GPU except while one of them is timed. `overhead` (the slot's
    calibration) bounds the reported latency from below by this process's clock around the timing.
    The candidate side's requests (build, trials, timing_prep, recheck) take no GPU lock: a slot's
    timed window stops every other executor (fibray.workers.quiesce); this process's own GPU work
    (inputs and references, checks) shares the GPU and keeps off it while a window is open."""
    s = job.settings
    phase = phases if phases is not None else Phases()  # build, inputs_reference, trials, check, timing, ...
    gpu = gpu if gpu is not None else _OwnGpu()
    with phase("build"):  # the candidate's side: no GPU lock (a timed window stops its process instead)
        err = calls.build(job)
    if err is not None:
        return judge.fail(Status.COMPILE_ERROR, getattr(err, "reason", Reason.BUILD_FAILED), str(err), s)
    try:
        with gpu.hold(phase, "inputs_reference"):
            state = judge.state(job)
    except InputError as e:
        return judge.fail(Status.RUNTIME_ERROR, Reason.BAD_WORKLOAD_INPUT, str(e), s)
    verdict = CheckResult()
    for trial in range(s.trials):
        with phase("trials"):
            out = calls.trial(job, trial)
        with gpu.hold(phase, "check"):
            verdict.merge(judge.check(job, state, trial, out))
        if not verdict.ok:
            return judge.failed(job, verdict)
    try:
        with phase("timing_prep"):
            calls.prepare_time(job)
        with gpu.hold(phase, "timing", exclusive=True):
            timing = bounded_time(lambda: calls.time(job), s, overhead, judge.device.type,
                                  prepare=lambda: calls.prepare_time(job), clock=getattr(calls, "bound_clock", None))
    except SideFault:
        raise
    except BoundBroken as e:  # the report contradicts what this process saw: a lie about latency
        return judge.fail(Status.RUNTIME_ERROR, e.reason, e.message, s)
    except CandidateCallFailed as e:  # classified where it was raised (an executor)
        return judge.fail(e.status or Status.RUNTIME_ERROR, _when_timed(e.reason), e.log, s)
    except Exception as e:  # the candidate failed when called again and again
        from fibray.evaluate.candidate import classify_exception

        status, reason = classify_exception(e)
        return judge.fail(status, _when_timed(reason), repr(e), s)
    with phase("recheck"):
        out = calls.recheck(job)
    with gpu.hold(phase, "recheck"):
        again = judge.check(job, state, s.trials, out)
    if not again.ok:
        if again.reason == Reason.TOLERANCE_EXCEEDED:
            again.reason = Reason.STALE_OUTPUT
            again.message = "a call on new values in a reused buffer returned a wrong answer: " + again.message
        return judge.failed(job, again)
    if judge.known_reference(job) is not None:  # timed before, in this environment: not again
        return judge.passed(job, state, verdict, timing)
    with gpu.hold(phase, "reference_timing", exclusive=True):
        return judge.passed(job, state, verdict, timing)


def _when_timed(reason: str) -> str:
    """A plain exception raised while timed is `failed_during_timing`; a specific reason stays."""
    return Reason.FAILED_DURING_TIMING if reason == Reason.EXCEPTION else reason
