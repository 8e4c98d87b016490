"""One honest evaluation: build, materialise inputs, reference, check, time -> Evaluation.

The work is split between two roles so that they can live in different processes:
`CandidateRunner` (fibray.evaluate.candidate) runs untrusted code and reports what it produced;
`Judge` (fibray.evaluate.judge) holds the reference outputs and decides the verdict. `Evaluator` puts both
in one process, for tests and local use; the sweep's workers keep them apart. A
candidate's failure becomes an Evaluation with a status and a reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from fibray.compile import prepare_triton
from fibray.evaluate.candidate import CandidateRunner, TimeResult
from fibray.check import CheckResult
from fibray.evaluate.memory import JobMemory
from fibray.evaluate.inputs import InputError
from fibray.evaluate.judge import Judge, _JobPlan, _WorkloadState, bound_log  # noqa: F401  (bound_log re-exported)
from fibray.schema.reasons import Reason
from fibray.schema import Evaluation, EvaluationStatus, Job
from fibray.evaluate.environment import default_device, environment
from fibray.evaluate.phases import Phases
from fibray.timing import Timing
from fibray.timing.bound import BoundBroken, Overhead, bounded_time

Status = EvaluationStatus


class Evaluator:
    """Candidate runner and judge in one process (tests, local use). The sweep keeps them apart."""

    def __init__(self, workdir: Path, device: Optional[torch.device] = None, cache_bytes: Optional[int] = None) -> None:
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


class GpuWorkLeftRunning(Exception):
    """A timed window found the GPU busy with another process's work, and the job's own executor was
    the one whose end ended it (fibray.workers.slot): its calls returned with work still running."""


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
    """The evaluation protocol, against any candidate side with build/attach/trial/prepare_time/time/
    recheck (a CandidateRunner in this process, or a slot's channel to an executor). The judge owns
    the job's memory and verifies every call in it. `gpu` (a slot's GpuLock) lets jobs share the GPU
    except while one of them is timed. `overhead` (the slot's calibration) bounds the reported
    latency from below by this process's clock around the timing. The candidate side's requests
    (build, attach, trials, timing_prep) take no GPU lock: a slot's timed window stops every other
    executor (fibray.workers.quiesce); this process's own GPU work (inputs and references, the job's
    memory, checks) shares the GPU and keeps off it while a window is open. The timed calls, their
    check and the recheck are one window, whose end finds work the job's calls left on the GPU."""
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
            mem, plan = judge.open(job, state, getattr(calls, "kept", None))
    except InputError as e:
        return judge.fail(Status.RUNTIME_ERROR, Reason.BAD_WORKLOAD_INPUT, str(e), s)
    try:
        return _protocol(job, judge, calls, phase, gpu, state, mem, plan, overhead)
    except GpuWorkLeftRunning as e:  # raised entering a timed window (the candidate's or the reference's)
        return judge.fail(Status.RUNTIME_ERROR, Reason.WORK_LEFT_RUNNING, str(e), s)
    finally:
        mem.close()


def timing_of(result: TimeResult, calls: Any) -> Timing:
    """A timing request's report, with what the candidate side's own clocks saw of it where it has them
    (a slot's RemoteCalls on a stepped CPU timing: its readings around and between the calls, and its own
    time between steps)."""
    return Timing(result.samples_ms, result.mode, result.sync_overhead_ms,
                  observed_ms=getattr(calls, "observed", None), between_ms=getattr(calls, "between", None),
                  reply_ms=getattr(calls, "reply_ms", None), supervisor_s=getattr(calls, "supervisor_s", 0.0))


class _TimedCallsFailed(Exception):
    def __init__(self, result: TimeResult) -> None:
        super().__init__(result.failure.reason if result.failure else "")
        self.result = result


def _bounded_time(job: Job, judge: Judge, calls, mem: JobMemory, sets: list[list[Any]], plan: _JobPlan,
                  overhead: Optional[Overhead], phase: Phases) -> tuple[TimeResult, int]:
    """The timed calls under the supervisor's clock (fibray.timing.bound), and the attempt whose
    report stands. A retry after a broken bound starts again from pristine input sets and freshly
    poisoned output buffers, prepared again before its clock starts, and changes its inputs with
    seeds of its own: what a doubted timing showed of its inputs is no use to the next."""
    last: list[TimeResult] = []
    walls: list[float] = []
    attempt = [0]

    def once() -> Timing:
        t0 = time.perf_counter()
        result = calls.time(job, plan.seeds[attempt[0]])
        walls.append(time.perf_counter() - t0)
        last[:] = [result]
        if result.failure is not None:
            raise _TimedCallsFailed(result)
        return timing_of(result, calls)

    def again() -> None:
        attempt[0] += 1
        for j, values in enumerate(sets):
            mem.write_inputs(j, values)
        calls.prepare_time(job, plan.timing())
        mem.prepare_outputs([mem.layout.scratch, *mem.layout.timed, *mem.layout.snapshots])
        mem.settle()

    try:
        timing = bounded_time(once, job.settings, overhead, judge.device.type, prepare=again,
                              stopwatch=getattr(calls, "stopwatch", None), busy=getattr(calls, "busy_clock", None),
                              nbytes=mem.layout.call_bytes(), returned_bytes=mem.layout.returned_bytes())
    except _TimedCallsFailed as e:
        return e.result, attempt[0]
    finally:
        if len(walls) > 1:  # attempts the bound doubted, and the preparations of their retries
            phase.add({"timing.retried": sum(walls[:-1])})
    return TimeResult(samples_ms=timing.samples_ms, mode=timing.mode, sync_overhead_ms=timing.sync_overhead_ms,
                      called=last[0].called), attempt[0]


def _protocol(job: Job, judge: Judge, calls, phase: Phases, gpu, state: _WorkloadState, mem: JobMemory,
              plan: _JobPlan, overhead: Optional[Overhead]) -> Evaluation:
    s, layout = job.settings, mem.layout
    with phase("attach"):
        calls.attach(job, layout, mem.region)
    verdict = CheckResult()
    for trial in range(s.trials):
        with phase("trials"):
            out = calls.trial(job, trial)
        with gpu.hold(phase, "check"):
            verdict.merge(judge.check_call(job, mem, trial, trial, state.inputs[trial], state.refs[trial], out))
        if not verdict.ok:
            return judge.failed(job, verdict)
    sets = [*state.inputs[: s.trials], *state.extra[: len(layout.inputs) - s.trials]]
    # the job's last candidate calls (the timed ones and the recheck) share one window, which ends only
    # once the GPU is this process's again: work a call left running fails its own job there
    with ExitStack() as window:
        try:
            with gpu.hold(phase, "check"):
                untouched = judge.unchanged_sets(job, mem, sets, "was modified before timing")
            if not untouched.ok:
                return judge.failed(job, untouched)
            with phase("timing_prep"):
                calls.prepare_time(job, plan.timing())
            with gpu.hold(phase, "check"):
                # poisoned again after the candidate's process had its views: nothing written ahead survives
                mem.prepare_outputs([layout.scratch, *layout.timed, *layout.snapshots])
                mem.settle()
            window.enter_context(gpu.hold(phase, "timing", exclusive=True))
            # a side that stops its executor once a timing's reply is in continues it before the window ends
            window.callback(getattr(calls, "resume", lambda: None))
            result, attempt = _bounded_time(job, judge, calls, mem, sets, plan, overhead, phase)
        except (SideFault, GpuWorkLeftRunning):
            raise
        except BoundBroken as e:  # the report contradicts what this process saw: a lie about latency
            return judge.fail(Status.RUNTIME_ERROR, e.reason, e.message, s)
        except CandidateCallFailed as e:  # classified where it was raised (an executor)
            return judge.fail(e.status or Status.RUNTIME_ERROR, _when_timed(e.reason), e.log, s)
        except Exception as e:  # the candidate failed when called again and again
            from fibray.evaluate.candidate import classify_exception

            status, reason = classify_exception(e)
            return judge.fail(status, _when_timed(reason), repr(e), s)
        failed = _after_timing(job, judge, calls, phase, state, mem, plan, sets, result, attempt)
        if failed is not None:
            return failed
    timing = Timing(result.samples_ms, result.mode, result.sync_overhead_ms)
    if judge.reference_ready(job):  # timed before (this workload, or the store's): no GPU time needed
        return judge.passed(job, state, verdict, timing)
    with gpu.hold(phase, "reference_timing", exclusive=True):
        return judge.passed(job, state, verdict, timing)


def _after_timing(job: Job, judge: Judge, calls, phase: Phases, state: _WorkloadState, mem: JobMemory,
                  plan: _JobPlan, sets: list[list[Any]], result: TimeResult, attempt: int) -> Optional[Evaluation]:
    """In the timing window: the timed calls' outputs judged, then one call on new values in a reused
    buffer (the recheck) judged; a failed verdict, or None."""
    s, layout = job.settings, mem.layout
    with phase("timing.check"):
        timed = judge.check_timed(job, state, mem, plan, sets, result, attempt, getattr(calls, "sampled", None),
                                   getattr(calls, "final", None))
    if not timed.ok:
        return judge.failed(job, timed)
    # the timed calls' errors decide, but are not reported: their inputs and sample are drawn at random
    with phase("timing.check"):
        mem.write_inputs(0, state.inputs[s.trials])
        mem.prepare_outputs([layout.recheck])
        mem.settle()
    with phase("timing.recheck"):
        out = calls.recheck(job)
        again = judge.check_call(job, mem, 0, layout.recheck, state.inputs[s.trials], state.refs[s.trials], out)
    if not again.ok:
        if again.reason == Reason.TOLERANCE_EXCEEDED:
            again.reason = Reason.STALE_OUTPUT
            again.message = "a call on new values in a reused buffer returned a wrong answer: " + again.message
        return judge.failed(job, again)
    return None


def _when_timed(reason: str) -> str:
    """A plain exception raised while timed is `failed_during_timing`; a specific reason stays."""
    return Reason.FAILED_DURING_TIMING if reason == Reason.EXCEPTION else reason
