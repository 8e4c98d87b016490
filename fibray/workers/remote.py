"""run_job's candidate side in a slot: requests to an executor over its channel, under deadlines.

Everything an executor says is received as typed models (fibray.workers.process.channel) and
taken only as a claim against the candidate; facts about the job's memory are the judge's, and
the executor's threads are counted from /proc here, never asked of the executor.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait
from typing import Callable, Optional

from fibray import deadlines
from fibray.compile import BuildError
from fibray.evaluate.candidate import CandidateFailure, TimeResult, TimingPlan, TrialOutput
from fibray.evaluate.memory import KeptRegion, Layout, Region, SupervisorSteps, final_copies, outputs_of
from fibray.evaluate.phases import Phases
from fibray.evaluate.run import CandidateCallFailed, Judge, SideFault, timing_of
from fibray.schema import EvaluationStatus, Job
from fibray.schema.reasons import POISONING_REASONS, Reason
from fibray.timing import Timing
from fibray.timing import steps
from fibray.timing.bound import BoundBroken, Stopwatch
from fibray.workers.cpu_clock import StepClock, process_cpu_clock
from fibray.workers.process import sandbox
from fibray.workers.quiesce import Quiet
from fibray.workers.process.channel import (
    BadMessage, ChannelClosed, DeadlineExceeded, Op, Reply, Request, checked, expect, recv, send, send_fds,
)

Status = EvaluationStatus


class ExecutorFault(SideFault):
    """The executor hung, died or was poisoned: its verdict cannot be trusted as is."""

    def __init__(self, status: Status, reason: str, log: str) -> None:
        super().__init__(f"{reason}: {log[:200]}")
        self.status, self.reason, self.log = status, reason, log


_PHASE_OF = {"trial": "trials", "time": "timing", "prepare_time": "timing_prep"}
"""run_job's phase for an executor request, where the names differ; the executor's own share goes under it."""


def _descriptor(region: Region, kind: str) -> int:
    """The file descriptor that hands `region` to an executor; RuntimeError where a region of its kind has none."""
    fd = region.share()
    if fd is None:
        raise RuntimeError(f"a {kind} region cannot be shared with an executor")
    return fd


class RemoteCalls:
    """run_job's candidate side, answered by an executor process under deadlines."""

    def __init__(self, ex: sandbox.Executor, job: Job, phase: Phases, quiet: Optional[Quiet] = None,
                 stopwatch: Optional[Stopwatch] = None, step_clock: Optional[StepClock] = None,
                 kept: Optional[KeptRegion] = None) -> None:
        self.ex, self.job, self.phase, self.quiet = ex, job, phase, quiet
        self.kept = kept
        """The executor's region kept from job to job (the judge lends it to each job; None: one per job)."""
        self.stopwatch = stopwatch
        """What the timing bound reads around a request (ExecutorStopwatch on a CPU slot; None: the wall)."""
        self.step_clock = step_clock
        """Where every timed call is to be clocked here (a CPU slot that accounts the executor's CPU:
        fibray.timing.steps); None: the request alone is."""
        self.observed: Optional[list[float]] = None
        """The last timing's reading around each timed call, ms (StepClock.reading_ms)."""
        self.between: Optional[list[float]] = None
        """The last timing's executor CPU after each timed call, until the next or the end step, ms (_Stepper)."""
        self.reply_ms: Optional[float] = None
        """The last timing's executor CPU from its end step until its reply was in, ms (_Stepper)."""
        self.sampled: Optional[dict[int, list[torch.Tensor]]] = None
        """The last timing's secret sample of timed calls' outputs, this side's copies (TimedSample)."""
        self.final: Optional[dict[int, list[torch.Tensor]]] = None
        """The last timing's copies of a secret sample of its judged buffers, taken at its end step
        (final_copies): the outputs judged, whatever the executor wrote after."""
        self.supervisor_s = 0.0
        """The last timing's seconds of this side's own work between steps, the executor blocked (_Stepper)."""
        self._mapped: Optional[tuple[Layout, Region]] = None
        """The job's region as this side maps it (attach): a stepped timing changes its inputs here."""
        self.run_spent = 0.0
        """Seconds the executor has spent on this job's run requests: the run deadline counts these
        only, not the time the job waited between them, nor the time it was stopped (other lanes' timings)."""
        self.executor_pid = ex.executor_pid()
        """The executor's host pid (below its relay in a PID namespace, where ex.pid is the relay's)."""
        self.busy_clock = process_cpu_clock(self.executor_pid)
        """The executor's CPU seconds, all threads (kernel accounting): tells a host-bound timing window
        from a lie on a GPU slot (fibray.timing.bound.HOST_BOUND_SHARE)."""
        self._held: Optional[Callable[[], None]] = None
        """What continues the executor, stopped since its last timing reply (time); None: running."""
        self.threads = threads_of(self.executor_pid)
        """The executor's threads when the job started, then once its solution is built (from /proc,
        not from the executor): a call that returns leaving another is work left running."""
        self.oom_kills = ex.cgroup.oom_kills() if ex.cgroup is not None else 0
        """Processes of the executor's memory cgroup the kernel had ended when the job started: one more
        after a call (a child the candidate started went over the bound, its executor lived on) fails it."""

    def resume(self) -> None:
        """Continue the executor if a timing's reply left it stopped (time); every request does first."""
        if self._held is not None:
            held, self._held = self._held, None
            held()

    def _ask(self, req: Request, deadline: float, phase: str, fds: Optional[list[int]] = None,
             during: Optional[Callable[[float], None]] = None) -> Reply:
        self.resume()
        try:
            send(self.ex.conn, req)
            if fds:
                send_fds(self.ex.conn, fds)
            if during is not None:
                during(deadline)
            reply = checked(answer(self.ex, deadline, self.quiet, slack=self.job.settings.run_deadline_s))
            self.phase.add(reply.spent, prefix=f"{_PHASE_OF.get(req.op, req.op)}.")
            return reply
        except DeadlineExceeded:
            limit = self.job.settings.build_deadline_s if phase == "build" else self.job.settings.run_deadline_s
            raise ExecutorFault(Status.TIMEOUT, Reason.BUILD_TIMEOUT if phase == "build" else Reason.RUN_TIMEOUT,
                                f"{phase} did not finish within its deadline of {limit}s; executor killed") from None
        except BadMessage as e:
            raise ExecutorFault(Status.RUNTIME_ERROR, Reason.BAD_MESSAGE,
                                f"the executor's reply during {phase} was not a well-formed reply ({e}); executor killed") from None
        except ChannelClosed:
            try:
                self.ex.proc.wait(timeout=deadlines.CLOSED_CHANNEL_EXIT_S)
            except Exception:  # still alive after closing its channel: it is killed by the caller
                pass
            reason, detail = self.ex.exit_reason()
            if reason is None:  # still alive
                reason, detail = Reason.CRASHED, "executor closed its channel"
            raise ExecutorFault(Status.RUNTIME_ERROR, reason, f"{detail} during {phase}\n{self.ex.output_tail()}") from None

    def _run(self, req: Request, fds: Optional[list[int]] = None, during: Optional[Callable[[float], None]] = None) -> Reply:
        t0, s0 = time.monotonic(), self._stopped()
        try:
            return self._ask(req, t0 + max(0.0, self.job.settings.run_deadline_s - self.run_spent), "run", fds, during)
        finally:
            self.run_spent += max(0.0, time.monotonic() - t0 - (self._stopped() - s0))

    def _stopped(self) -> float:
        return self.quiet.stopped_s(self.ex) if self.quiet is not None else 0.0

    def build(self, job: Job) -> Optional[BuildError]:
        reply = self._ask(Request(Op.BUILD, job), time.monotonic() + job.settings.build_deadline_s, "build")
        # threads its import started (a library's pool) are the module's; its calls may leave none
        self.threads = threads_of(self.executor_pid)
        return None if reply.ok else BuildError(reply.error, reply.reason or Reason.BUILD_FAILED)

    def warm(self, job: Job) -> bool:
        """One call on inputs the executor draws itself, judged by nobody (Op.WARM); True if it returned
        without a failure and left no thread running."""
        return self._run(Request(Op.WARM, job)).ok and self._after_call() is None

    def attach(self, job: Job, layout: Layout, region: Region) -> None:
        """The job's region mapped in the executor: sent as a descriptor, or, where it is the kept region
        the executor mapped for an earlier job, named only."""
        lent = self.kept is not None and self.kept.lent(region)
        if lent and self.kept.mapped:
            reply = self._run(Request(Op.ATTACH, job, layout=layout, region="kept"))
        else:
            reply = self._run(Request(Op.ATTACH, job, layout=layout, region="keep" if lent else "job"),
                              fds=[_descriptor(region, layout.kind)])
        if not reply.ok:
            raise ExecutorFault(Status.RUNTIME_ERROR, Reason.EXECUTOR_ERROR, f"mapping the job's region failed: {reply.error}")
        if lent:
            self.kept.mapped = True
        self._mapped = (layout, region)

    def keep_ahead(self, kept: KeptRegion, kind: str, device: str) -> None:
        """Map `kept`'s region (made already) in the executor before any job of it (Op.KEEP): its jobs'
        attach then names it only."""
        assert kept.region is not None, "keep_ahead: the region is made first (KeptRegion.prepare)"
        reply = self._run(Request(Op.KEEP, self.job, layout=Layout.bare(kept.region.size, kind, device)),
                          fds=[_descriptor(kept.region, kind)])
        if not reply.ok:
            raise ExecutorFault(Status.RUNTIME_ERROR, Reason.EXECUTOR_ERROR, f"mapping a kept region failed: {reply.error}")
        kept.mapped = True

    def _after_call(self) -> Optional[CandidateFailure]:
        """Threads of the executor beyond those it had when the job started, read from /proc after a
        request returned: work the candidate left running after its call (it counts, or fails the job);
        or a process of its cgroup ended for going over the host memory bound during the call."""
        cg = self.ex.cgroup
        if cg is not None and cg.oom_kills() > self.oom_kills:
            return CandidateFailure(status="RUNTIME_ERROR", reason=Reason.OUT_OF_MEMORY,
                                    log=f"{sandbox.over_memory_bound(cg)} during the call; the kernel ended one of them")
        new = threads_of(self.executor_pid) - self.threads
        if new:
            return CandidateFailure(status="RUNTIME_ERROR", reason=Reason.WORK_LEFT_RUNNING,
                                    log=f"the executor had {len(new)} thread(s) after the call returned that it did "
                                        f"not have when the job started")
        return None

    def _trial_like(self, op: Op, job: Job, trial: int = 0) -> TrialOutput:
        reply = self._run(Request(op, job, trial))
        if not reply.ok:
            raise ExecutorFault(Status.RUNTIME_ERROR, Reason.EXECUTOR_ERROR, reply.error)
        out = self._expect(reply, TrialOutput)
        if out.failure is not None and out.failure.reason in POISONING_REASONS:
            raise ExecutorFault(Status(out.failure.status), out.failure.reason, out.failure.log)
        left = self._after_call()
        return out if out.failure is not None or left is None else TrialOutput(failure=left)

    def _expect(self, reply: Reply, kind):
        try:
            return expect(reply, kind)
        except BadMessage as e:
            raise ExecutorFault(Status.RUNTIME_ERROR, Reason.BAD_MESSAGE, f"{e}; executor killed") from None

    def trial(self, job: Job, trial: int) -> TrialOutput:
        return self._trial_like(Op.TRIAL, job, trial)

    def recheck(self, job: Job) -> TrialOutput:
        return self._trial_like(Op.RECHECK, job)

    def prepare_time(self, job: Job, timing: TimingPlan) -> None:
        self._timing_request(Request(Op.PREPARE_TIME, job, timing=timing))

    def time(self, job: Job, seeds: list[int]) -> TimeResult:
        """The timing request; on a CPU slot that accounts the executor's CPU (step_clock), with this
        side's own reading around every timed call (`observed`, fibray.timing.steps), of the executor's
        CPU after each call (`between`) and from its end step to its reply (`reply_ms`), the input changes
        made here (SupervisorSteps: the executor gets no seeds), and the judged outputs copied at its end
        step (`final`). The executor is left stopped once its reply is in, until its next request (_hold)."""
        self.observed = self.between = self.reply_ms = self.sampled = self.final = None
        self.supervisor_s = 0.0
        if self._mapped is None:
            raise RuntimeError("a timing needs the job's region attached first")
        if self.step_clock is None:
            layout, region = self._mapped
            pipes = _EndStep(self.ex.conn, [outputs_of(region, layout.outputs[k]) for k in layout.timed], len(seeds),
                             self._stop_now)
            req = Request(Op.TIME, job, seeds=seeds, end_step=True)
        else:
            pipes = _Stepper(self.ex.conn, self.step_clock, SupervisorSteps(*self._mapped, seeds))
            req = Request(Op.TIME, job, seeds=[], step=True)
        try:
            reply = self._timing_request(req, fds=pipes.theirs, during=pipes.run)
            self._hold()
            pipes.reply_read()
        except CandidateCallFailed:
            if pipes.out_of_order is None:
                raise
        finally:
            pipes.close()
        if pipes.out_of_order is not None:
            raise BoundBroken(Reason.BAD_TIMING_REPORT, f"the executor's steps around its timed calls were out of "
                                                        f"order: {pipes.out_of_order}")
        self.final, self.supervisor_s = pipes.final, pipes.own_s
        if isinstance(pipes, _Stepper):
            self.observed, self.between = pipes.readings, pipes.between
            self.reply_ms, self.sampled = pipes.reply_ms, pipes.work.sample.kept
        result = self._expect(reply, TimeResult)
        if result.failure is None and self.final is None:
            raise BoundBroken(Reason.BAD_TIMING_REPORT, "the executor's timing reply came without its end step after "
                                                        "its last timed call's hand-over")
        left = self._after_call()
        return result if result.failure is not None or left is None else TimeResult(failure=left)

    def _stop_now(self) -> Callable[[], None]:
        """Stop the executor (Quiet.hold) and return what continues it; without a Quiet, nothing."""
        return self.quiet.hold(self.ex) if self.quiet is not None else (lambda: None)

    def _hold(self) -> None:
        """Stop the executor once its timing reply is in, until its next request (resume): the supervisor
        then reads what else the timing left (guards, input sets) with nothing of the candidate's running,
        and, on a stepped timing, its CPU clock after the reply."""
        self._held = self._stop_now()

    def _timing_request(self, req: Request, fds: Optional[list[int]] = None,
                        during: Optional[Callable[[float], None]] = None) -> Reply:
        reply = self._run(req, fds, during)
        if not reply.ok:
            if reply.reason in POISONING_REASONS:
                raise ExecutorFault(Status(reply.status or "RUNTIME_ERROR"), reply.reason, reply.error)
            raise CandidateCallFailed(reply.status or Status.RUNTIME_ERROR, reply.reason or Reason.EXCEPTION, reply.error)
        return reply


class _StepPipes:
    """This side of a timing's step pipes (fibray.timing.steps). `theirs` are the executor's ends of the
    two pipes, sent with the request and closed here once sent (so that an executor gone shows as the
    end of its pipe)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        to_ex, from_ex = os.pipe(), os.pipe()
        self.to_ex: Optional[int] = to_ex[1]
        self.from_ex: Optional[int] = from_ex[0]
        self.theirs = [to_ex[0], from_ex[1]]
        self.own_s = 0.0
        """Seconds of this side's own work between steps, the executor blocked all along: not the
        candidate's, and slow on a loaded host."""
        self.out_of_order: Optional[str] = None

    def _say(self, byte: bytes) -> bool:
        if self.to_ex is None:
            return False
        try:
            os.write(self.to_ex, byte)
            return True
        except OSError:  # the executor closed its end: its reply, or its exit, is on the channel
            return False

    def _next(self, deadline: float) -> Optional[bytes]:
        """The executor's next step byte; None once its reply (or its end) is there instead: the timing
        ended, or a call failed, and the reply says how."""
        ready = wait([self.from_ex, self.conn], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise DeadlineExceeded()
        if self.from_ex not in ready:
            return None
        got = os.read(self.from_ex, 1)
        return got or None

    def _bad(self, what: str) -> None:
        self.out_of_order = what
        os.close(self.to_ex)  # its next step fails, and so its timing
        self.to_ex = None

    def _close_theirs(self) -> None:
        while self.theirs:
            os.close(self.theirs.pop())

    def close(self) -> None:
        self._close_theirs()
        for name in ("to_ex", "from_ex"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


class _EndStep(_StepPipes):
    """This side of a timing not stepped call by call (a GPU slot, or a CPU slot that cannot account
    its executor's CPU): its one end step, once the executor's calls are over, handed over and (on a
    GPU) synchronised. There the executor is stopped (`stop`, Quiet.hold: none of its threads launches
    or writes anything meanwhile) while a secret sample of the timed buffers is copied (final_copies),
    the outputs judged: what it writes into its buffers once it runs on to its reply is never judged."""

    def __init__(self, conn, outs: list[list[torch.Tensor]], calls: int, stop: Callable[[], Callable[[], None]]) -> None:
        super().__init__(conn)
        self.outs, self.calls, self.stop = outs, calls, stop
        self.final: Optional[dict[int, list[torch.Tensor]]] = None

    def reply_read(self) -> None:
        """Nothing is clocked here once the reply is in."""

    def run(self, deadline: float) -> None:
        self._close_theirs()
        if not self._say(steps.BOOKKEEP):
            return
        got = self._next(deadline)
        if got is None:  # its reply, or its end: a call failed (the reply says how)
            return
        if got != steps.END:
            return self._bad(f"{got!r} where {steps.END!r} was due")
        t0 = time.perf_counter()
        resume = self.stop()
        try:
            self.final = final_copies(self.outs, self.calls)
        finally:
            resume()
        self.own_s += time.perf_counter() - t0
        self._say(steps.BOOKKEEP)


class _Stepper(_StepPipes):
    """This side of a stepped timing (fibray.timing.steps): its clocks read around every timed call,
    the executor blocked at both ends, and its own work between calls (`work`: the input change before
    a call, a DPS call's snapshot after it; the judged outputs' copies at the end step) done while the
    executor waits."""

    def __init__(self, conn, clock: StepClock, work: SupervisorSteps) -> None:
        super().__init__(conn)
        self.clock, self.work = clock, work
        self.readings: list[float] = []
        """Per timed call, ms (StepClock.reading_ms)."""
        self.between: list[float] = []
        """Per timed call, the executor's CPU (its cgroup's), ms, from the reading after the call to the
        one before the next call, or, after the last, to its end step: the call's hand-over (the copy of a
        value-returning result), and whatever else runs then."""
        self.ended: Optional[tuple] = None
        """The reading at the executor's end step (None: it made none)."""
        self.reply_ms: Optional[float] = None
        """The executor's CPU from its end step until its reply was in, ms."""

    def run(self, deadline: float) -> None:
        """Step the executor through its timed calls and its end step, until its reply is on the channel."""
        self._close_theirs()
        after = None
        while True:
            if not self._say(steps.BOOKKEEP):
                return
            got = self._next(deadline)
            if got is None:  # its reply, or its end: a call or a hand-over failed (the reply says how)
                return
            if got == steps.END and after is not None:
                t0 = time.perf_counter()
                self.ended = self.clock.read()
                self.between.append(StepClock.cpu_ms(after, self.ended))
                self.work.end()
                self.own_s += time.perf_counter() - t0
                self._say(steps.BOOKKEEP)  # its reply follows; read again once it is in (reply_read)
                return
            if got != steps.READY:
                return self._bad(f"{got!r} where {steps.READY!r} was due")
            i = len(self.readings)
            if i >= self.work.calls():
                return self._bad(f"a timed call past the {self.work.calls()} planned")
            t0 = time.perf_counter()
            self.work.before(i)
            before = self.clock.read()
            if after is not None:
                self.between.append(StepClock.cpu_ms(after, before))
            self.own_s += time.perf_counter() - t0
            if not self._say(steps.GO):
                return
            got = self._next(deadline)
            if got is None:  # the call failed: its reply says how
                return
            if got != steps.DONE:
                return self._bad(f"{got!r} where {steps.DONE!r} was due")
            t0 = time.perf_counter()
            after = self.clock.read()
            self.readings.append(self.clock.reading_ms(before, after))
            self.work.after(i)
            self.own_s += time.perf_counter() - t0

    @property
    def final(self) -> Optional[dict[int, list[torch.Tensor]]]:
        return self.work.final

    def reply_read(self) -> None:
        """The reply is in: the executor's CPU since its end step (reply_ms)."""
        if self.ended is not None:
            self.reply_ms = StepClock.cpu_ms(self.ended, self.clock.read())


def answer(ex: sandbox.Executor, deadline: float, quiet: Optional[Quiet], slack: float = 0.0) -> Reply:
    """The executor's reply before `deadline`, moved back by every second the executor spends stopped
    (another lane's timed window) meanwhile. `slack`: more time for the rest of a reply whose first
    bytes came in time (its sender may be stopped in the middle of it)."""
    credited = quiet.stopped_s(ex) if quiet is not None else 0.0
    while not ex.conn.poll(max(0.0, deadline - time.monotonic())):
        if quiet is None:
            raise DeadlineExceeded()
        stopped = quiet.stopped_s(ex)
        if stopped <= credited and not quiet.is_stopped(ex):
            raise DeadlineExceeded()
        deadline = max(deadline + stopped - credited, time.monotonic() + 0.05)
        credited = stopped
    return recv(ex.conn, deadline + slack, ex.arena)


def threads_of(pid: int) -> frozenset[int]:
    """The ids of a process's threads, as /proc lists them (none once it is gone). Ids, not a count:
    a candidate that ends one of the executor's own threads may not start one of its own in its place."""
    try:
        return frozenset(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return frozenset()


class CalibrationSide:
    """The timing calibration's candidate side (fibray.timing.bound.TimingSide): an executor's calls
    on a job region the judge allocates, as for any job."""

    def __init__(self, calls: RemoteCalls, judge: Judge) -> None:
        self.calls, self.judge = calls, judge
        self._memory: dict[str, object] = {}

    def build(self, job: Job) -> Optional[BuildError]:
        return self.calls.build(job)

    def prepare_time(self, job: Job) -> None:
        mem, plan = self.judge.open(job, self.judge.state(job), self.calls.kept)
        self._memory[job.job_id] = (mem, plan)
        self.calls.attach(job, mem.layout, mem.region)
        self.calls.prepare_time(job, plan.timing())

    def time(self, job: Job) -> Timing:
        mem, plan = self._memory.pop(job.job_id)
        try:
            result = self.calls.time(job, plan.seeds[0])
        finally:
            self.calls.resume()
            mem.close()
        if result.failure is not None:
            raise RuntimeError(f"the timing calibration kernel failed: {result.failure.reason}: {result.failure.log}")
        return timing_of(result, self.calls)
