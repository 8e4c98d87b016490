"""A GPU slot: the Ray actor that owns one GPU and supervises candidate executors on it.

The supervisor never runs candidate code. It holds the reference outputs and the checks
(`Judge`), and drives an active executor process (persistent across jobs), a warm standby
that takes over at once when the active one dies, hangs or fails its health check, and
pre-warmed single-use executors for fresh-process isolation. Every wait has a deadline;
an executor past its deadline is killed with its whole process tree.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from fibray import deadlines
from fibray.compile import prepare_triton
from fibray.evaluate.memory import HostRegion, free_device_bytes
from fibray.schema.reasons import Reason, is_fault, quarantined
from fibray.evaluate.environment import default_device, environment
from fibray.evaluate.phases import now_iso
from fibray.evaluate.run import GpuWorkLeftRunning, Judge, bound_log, run_job
from fibray.evaluate.phases import Phases
from fibray.schema import EvalSettings, Evaluation, EvaluationStatus, Job, JobResult
from fibray.timing.bound import Overhead, Stopwatch, calibrate, calibration_job
from fibray.timing.roofline import device_caps
from fibray.timing.timer import round_trips_s
from fibray.workers.cpu_clock import StepClock, cpu_stopwatch
from fibray.workers.gpu_lock import GpuLock, LaneGpu
from fibray.workers.process import sandbox
from fibray.workers.process.forkserver import ForkedProcess
from fibray.workers.remote import CalibrationSide, ExecutorFault, RemoteCalls, answer
from fibray.workers.spec import PREWARM_AHEAD, SlotSpec, distinct_shapes, slot_lanes
from fibray.workers.start import SlotStart
from fibray.workers.process.executor import LEAK_BYTES
from fibray.workers.quiesce import Quiet
from fibray.workers.process.channel import ChannelClosed, DeadlineExceeded, Health, Hello, Op, Request, expect, recv, send

Status = EvaluationStatus
log = logging.getLogger(__name__)


class NoExecutor(RuntimeError):
    """No usable executor could be had for a job (it failed to start, or died before its job)."""


_NO_CGROUP_SAID: list[bool] = []
"""Non-empty once a CPU slot said that its executors have no cgroup (said once a process)."""

_RETIRING_REASONS = frozenset({Reason.TIMING_BELOW_OBSERVED, Reason.BAD_TIMING_REPORT, Reason.WORK_LEFT_RUNNING,
                               Reason.OUT_OF_MEMORY})
"""Verdicts after which the executor serves no further job: its own code was rebound, or its memory ran out
(a process of it ended by the kernel, or a MemoryError anywhere in it): the next job finds a fresh one."""

PROBE_ROUNDS = 5
"""Empty-kernel round trips of one probe of the GPU (_gpu_shared)..."""
PROBE_FACTOR = 20.0
PROBE_MIN_S = 0.002
"""...found slower than PROBE_FACTOR times the idle GPU's probe at the slot's start, and than this: shared."""
PROBE_TRIES = 3
PROBE_PAUSE_S = 0.005
"""Probes, this far apart, that must all find the GPU shared before a window acts on it."""


def _end_now(ex: sandbox.Executor) -> None:
    """Kill an executor's tree and wait until its own process has exited (its CUDA context with it)."""
    pid = ex.executor_pid()
    sandbox.kill_executor(ex)
    sandbox.wait_exited([pid], time.monotonic() + deadlines.RETIRE_EXIT_S, poll_s=0.001)


KEEP_AHEAD_SHARE = 8
"""A readied executor's kept region is made ahead only where it is at most 1/KEEP_AHEAD_SHARE of the GPU's
free memory (GpuSlot._keep_ahead): up to _READIED of them are held at once."""

_READIED = PREWARM_AHEAD + 1
"""Executors readied ahead per slot at most: those of the groups the driver has named, and the next group's
(named earlier, its first job perhaps not yet in its lane)."""


@dataclass
class _Warm:
    """A standby readied for one solution ahead of its jobs (GpuSlot.prewarm)."""

    ex: sandbox.Executor
    limit_s: float
    """The most its warm-up may take (the job's build and run deadlines, its start and health check)."""
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


@dataclass
class _Retiring:
    """An executor being put down in the background (GpuSlot._retire_soon)."""

    uid: Optional[int]
    """The uid it ran as (None: this process's own)."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once it and its tree have ended and it is cleaned up (output drained, cgroup removed, uid released)."""


class GpuSlot:
    """Supervises executors on the GPU Ray gave this actor (or the CPU, for a logical GPU).

    `lanes` jobs may run at once (a threaded Ray actor), each on its own persistent executor;
    warm standbys (spec.standby of them) replace whichever of them is retired, and the GPU lock
    keeps timing exclusive.
    """

    def __init__(self, spec: SlotSpec, start: Optional[SlotStart] = None) -> None:
        self._lock = threading.RLock()  # executor lists, spawning and stray reaping
        self._free = threading.Condition(self._lock)
        self.device = default_device()
        self.quiet = Quiet(spec.sandbox)
        """Stops the other executors around every timed window; keeps how long each was stopped."""
        self.gpu = GpuLock((lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None,
                           self._alone)
        self.counters = {"promotions": 0, "retired": 0, "solution_changes": 0, "escalations": 0, "strays_killed": 0,
                         "prewarmed": 0, "prewarm_discarded": 0}
        self._busy = 0
        self.faults: dict[tuple[str, str], list[Status]] = {}
        """Per (sweep, solution hash), the statuses of the faults this slot saw (a job sent ahead of
        its solution's faults runs isolated, or not at all once they reach spec.quarantine_after);
        per sweep, as the driver's quarantine is (a service's slots serve many sweeps)."""
        self.lanes = slot_lanes(spec, self.device.type)
        self._lanes = threading.Semaphore(self.lanes)
        """A job (persistent or isolated) holds a lane; a job sent ahead of time waits here for one."""
        self._retiring: list[_Retiring] = []
        """Retirements under way (_retire_soon)."""
        self._dying: set[int] = set()
        """Their processes, until then."""
        self.spec = spec
        self.want_standby, self.spare_isolated = int(spec.standby), spec.spare_isolated
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        # executors first (unless the actor started them already): they warm up while this process does
        if start is None:
            start = SlotStart.begin(spec, device)
        elif start.device != device:
            start.restart_on(device)
        start.wait_first()
        self.start = start
        self.name = f"{spec.name}@{socket.gethostname()}:{os.getpid()}"
        self.base = start.base
        self.persistent = list(start.persistent)
        self.idle = list(self.persistent)
        self.standbys = list(start.standbys)
        """Warm executors, oldest first (the first has had longest to start), each to take a retired lane's place."""
        self.fresh: list[sandbox.Executor] = []
        self.in_use: list[sandbox.Executor] = []
        """Single-use executors a job has taken (off the spare list, not yet retired)."""
        self._busy_outside = False
        """The last window found the GPU busy from outside this slot (see _gpu_to_itself)."""
        self._probe_s: Optional[float] = None
        """Seconds of a GPU probe (PROBE_ROUNDS round trips) on the idle GPU, measured in info()."""
        self.warm: dict[str, _Warm] = {}
        """Per solution hash, a standby readied for its jobs ahead of them (at most _READIED: see prewarm)."""
        prepare_triton()
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)
        self.env = environment(self.device)
        regions, kind = (lambda size, _device: HostRegion.create(size)), "host"
        self.checks = "supervisor"
        """Where job memory is verified (JobResult.checks)."""
        if self.device.type == "cuda":  # the supervisor verifies on memory it allocates and shares
            from fibray.workers.process import devmem

            why = devmem.available(self.device)
            if why is None:
                regions, kind = devmem.regions_for(self.device), "cuda"
            elif spec.sandbox.executor_checks:  # explicitly allowed: recorded in every row
                kind, self.checks = "staged", "executor"
            else:
                raise RuntimeError(
                    f"slot {spec.name}: GPU memory cannot be shared with executors on {self.device} through CUDA VMM "
                    f"({why}), so the supervisor could not verify outputs, inputs and guard bytes itself; "
                    f"fibray refuses to judge candidates on this GPU. Use a driver with VMM and POSIX-fd handles, "
                    f"or set runner.executor_checks=true to verify copies the executor stages (recorded per row)")
        self.judge = Judge(self.base / "judge", self.device, self.env, regions=regions, region_kind=kind)
        self.overheads: dict[tuple, Overhead] = {}
        """The timing bound's calibration per timing mode (fibray.timing.bound), made on pristine executors."""
        self._calibrating = threading.Lock()

    @property
    def active(self) -> sandbox.Executor:
        """The first lane's persistent executor."""
        return self.persistent[0]

    # -- executors -----------------------------------------------------------------------
    def _spawn(self, single_use: bool) -> sandbox.Executor:
        with self._lock:  # a stray reap in another lane never sees it before it is listed
            return self.start.spawn(single_use)

    def _ready(self, ex: sandbox.Executor, deadline_s: float = deadlines.EXECUTOR_READY_S) -> sandbox.Executor:
        """The executor, warm and alive; RuntimeError if it could not start or has ended since it
        said it was ready (neither is the fault of the job about to use it)."""

        def unusable(what: str, how: str = "") -> NoExecutor:
            sandbox.retire(ex)
            reason, detail = ex.exit_reason()
            error = NoExecutor(f"executor {ex.pid} {what} ({how}{reason}: {detail}): {ex.output_tail()[-2000:]}")
            if not ex.ready and isinstance(ex.proc, ForkedProcess):
                self.start.fork_failed(str(error))
            return error

        if not ex.ready:
            try:
                reply = recv(ex.conn, time.monotonic() + deadline_s, ex.arena)
            except (DeadlineExceeded, ChannelClosed) as e:
                raise unusable("failed to start", f"{type(e).__name__}; ") from None
            if not isinstance(getattr(reply, "value", None), Hello):
                raise unusable("sent no hello", f"{type(getattr(reply, 'value', reply)).__name__}; ")
            ex.ready, ex.info = True, reply.value.model_dump()
        if not ex.alive():
            raise unusable("ended after it was ready")
        return ex

    def _take_persistent(self, solution: str) -> sandbox.Executor:
        """A lane's executor for a job of `solution`. An executor serves one solution: one that
        ran another is retired here and a warm standby takes its lane (nothing an earlier
        candidate patched, started or left in memory reaches this one)."""
        failures = 0
        while True:
            with self._free:
                while not self.idle:
                    self._free.wait()
                # its own solution's executor first, then an unused one; one of another solution last
                ex = min(self.idle, key=lambda e: 0 if e.solution == solution else 1 if e.solution is None else 2)
                self.idle.remove(ex)
            if ex.solution != solution and (warm := self._warm_for(solution)) is not None:
                self._succeed(ex, warm)
                return warm
            if ex.solution is not None and ex.solution != solution:
                self._discard(ex, counter="solution_changes")
                continue
            try:
                ex = self._ready(ex)
            except NoExecutor:
                self._discard(ex)
                failures += 1
                if failures >= 2:
                    raise
                continue
            ex.solution = solution
            return ex

    def _give_back(self, ex: sandbox.Executor) -> None:
        with self._free:
            if ex in self.persistent and ex not in self.idle:
                self.idle.append(ex)
                self._free.notify()

    def _take_fresh(self) -> sandbox.Executor:
        """A single-use executor: a spare that warmed up, or, if that one cannot start, new ones."""
        failures: list[str] = []
        for attempt in range(3):
            with self._lock:  # listed as in use at once: another lane's stray reap must not take it for a stray
                ex = self.fresh.pop(0) if self.fresh and not attempt else self._spawn(single_use=True)
                ex.solution = "single-use"
                self.in_use.append(ex)
                while len(self.fresh) < self.spare_isolated:
                    self.fresh.append(self._spawn(single_use=True))  # warms up while this job runs
            try:
                return self._ready(ex)
            except NoExecutor as e:
                self._discard(ex)
                failures.append(str(e))
        raise NoExecutor("no single-use executor could start:\n" + "\n".join(failures))

    def _succeed(self, ex: sandbox.Executor, warm: sandbox.Executor) -> None:
        """`warm` (readied for the job's solution) takes the lane of `ex`, which is retired if it served
        another solution, or else goes back to the standbys unused."""
        with self._free:
            self.counters["prewarmed"] += 1
            if ex.solution is not None:
                self._discard(ex, counter="solution_changes", successor=warm)
                return
            self.persistent[self.persistent.index(ex)] = warm
            self.standbys.insert(0, ex)

    def _discard(self, ex: sandbox.Executor, counter: str = "retired",
                 successor: Optional[sandbox.Executor] = None) -> None:
        """Retire an executor; if it was a persistent one, `successor` or else the oldest standby takes
        its lane at once and a new one starts."""
        with self._free:
            self._retire_soon(ex)
            self.counters[counter] += 1
            if ex in self.in_use:
                self.in_use.remove(ex)
            if ex in self.persistent:
                self.counters["promotions"] += 1
                new = successor or (self.standbys.pop(0) if self.standbys else self._spawn(single_use=False))
                self.persistent[self.persistent.index(ex)] = new
                if ex in self.idle:
                    self.idle.remove(ex)
                if successor is None:  # a successor is its caller's: another lane must not take it too
                    self.idle.append(new)
                self._refill_standbys()
                self._free.notify()

    def _retire_soon(self, ex: sandbox.Executor) -> None:
        """(Under the lock.) SIGKILL an executor and its tree now; the wait for their end, the cleanup and
        the release of its uid run in a thread of their own (~0.15 s a retirement on an H100 host, most
        of it waiting for the processes and their cgroup to go, which a change of solution paid on the
        job's path: it now overlaps the next job's attach, trials and checks). Until it is done, its
        processes count as this slot's: no stray reap takes them (those it knew of, and any running as its
        uid; without a uid of its own a reap waits for it), and no timed window opens (_alone waits)."""
        tree = sandbox.kill_executor(ex)
        pids = {ex.pid, *tree}
        self._dying |= pids
        going = _Retiring(ex.uid.uid if ex.uid is not None else None)

        def finish() -> None:
            try:
                sandbox.retire(ex, tree=tree)
            except Exception:  # noqa: BLE001  (a thread of its own: nothing else would hear of it)
                log.exception("slot %s: retiring executor %d failed", self.name, ex.pid)
            finally:
                with self._lock:
                    self._dying -= pids
                    self._retiring.remove(going)
                going.done.set()

        self._retiring.append(going)
        threading.Thread(target=finish, name="fibray-retire", daemon=True).start()

    def _retired(self, without_uid: bool = False) -> None:
        """Wait until every executor put down so far (`without_uid`: of those that ran as this process's
        uid) has ended and been cleaned up. Not under the lock."""
        with self._lock:
            pending = [r for r in self._retiring if not without_uid or r.uid is None]
        for r in pending:
            r.done.wait()

    def _refill_standbys(self) -> None:
        """Start standbys until spec.standby are warming (under the lock)."""
        while len(self.standbys) < self.want_standby:
            self.standbys.append(self._spawn(single_use=False))

    def _executors(self) -> list[sandbox.Executor]:
        """Every executor of this slot: the lanes', the standbys (readied ones too), the spares and the
        single-use ones taken."""
        return [*self.persistent, *self.standbys, *(w.ex for w in self.warm.values()), *self.fresh, *self.in_use]

    # -- executors readied ahead of their solution's jobs ----------------------------------
    def prewarm(self, jobs: Sequence[Job]) -> None:
        """Ready a standby for the solution of `jobs` (one solution's jobs, which the driver names as the
        ones a slot is likely to get next) while other jobs run: it builds the solution and calls it once
        per distinct workload shape among them (at most PREWARM_SHAPES), judged by nobody, on inputs of its
        own drawing (CandidateRunner.warm), so the first-call costs (Triton's JIT of each specialisation
        above all) fall off the jobs' path. Only an executor that comes back as it went in (no thread or
        process left, its health check passed) is kept for the jobs; any other is retired, and they then
        run as they would have without. It stays one of this slot's executors throughout, so every timed
        window stops it. Returns at once; a guess that a later one replaces is retired."""
        if not jobs or self.spec.prewarm is False or (self.spec.prewarm == "auto" and self.device.type != "cuda"):
            return
        job = jobs[0]
        if any(j.solution.hash != job.solution.hash for j in jobs):
            raise ValueError("GpuSlot.prewarm: the jobs of one solution, got several solutions")
        shapes = distinct_shapes(jobs)
        solution = job.solution.hash
        with self._lock:
            if (solution in self.warm or (job.sweep, solution) in self.faults or not self.standbys
                    or any(e.solution == solution for e in self.persistent)):
                return
            if sum(not w.done.is_set() for w in self.warm.values()) >= PREWARM_AHEAD:  # standbys stay for retired lanes
                return
            # the driver names the next group as it sends this one's first job, which may not have reached
            # its lane yet: the executor readied for it stays, and only an older guess gives way
            while len(self.warm) >= _READIED:  # the oldest guess gives way (its warm-up ends on a dead executor)
                other = next(iter(self.warm))
                self._retire_soon(self.warm.pop(other).ex)  # its end and cleanup off the lock, as a lane's are
                self.counters["prewarm_discarded"] += 1
            ex = self.standbys.pop(0)
            self._refill_standbys()
            ex.solution = solution
            s = job.settings
            limit = deadlines.EXECUTOR_READY_S + s.build_deadline_s + len(shapes) * s.run_deadline_s + deadlines.HEALTH_S
            warm = self.warm[solution] = _Warm(ex, limit)
        threading.Thread(target=self._warm_up, args=(shapes, warm), name="fibray-prewarm", daemon=True).start()

    def _warm_up(self, shapes: list[Job], warm: _Warm) -> None:
        job = shapes[0]
        try:
            ex = self._ready(warm.ex)
            calls = RemoteCalls(ex, job, Phases(), self.quiet)
            ok = calls.build(job) is None
            for one in shapes:
                calls.run_spent = 0.0  # each call has its job's run deadline
                ok = ok and calls.warm(one) and not self._left_behind(ex)
            if ok:
                self._keep_ahead(ex, calls, job)
            warm.ok = ok and self._healthy(ex, Phases())
        except (NoExecutor, ExecutorFault):
            pass  # not ok: retired below, and the job runs as it would have without
        except Exception:  # noqa: BLE001  (a thread of its own: nothing else would hear of it)
            log.exception("slot %s: readying an executor for solution %s failed", self.name, job.solution.name)
        finally:
            if not warm.ok:
                with self._lock:
                    if self.warm.get(job.solution.hash) is warm:  # else a later guess retired it already
                        del self.warm[job.solution.hash]
                        self.counters["prewarm_discarded"] += 1
                        # killed now; its end and cleanup in a thread, not under the lock (~0.15 s on a GPU
                        # host, while every lane's job waited for the lock), and before any window opens
                        self._retire_soon(warm.ex)
            warm.done.set()

    def _keep_ahead(self, ex: sandbox.Executor, calls: RemoteCalls, job: Job) -> None:
        """Give a readied executor the kept region its solution's jobs will need (as large as its definition's
        largest here so far), made here and mapped there now, off the jobs' path: on an H100, over the core gpu
        set's 133 jobs, making kept regions took 12 ms a job and attaching 14 ms, most of both in the first job
        of each new executor (benchmarks/RESULTS.md, section 36). Made under a shared hold of the GPU, as a
        job's own memory is: never inside a timed window."""
        size = self.judge.kept_size(job.definition.name)
        if not size or ex.single_use or ex.region is not None:
            return
        if self.device.type == "cuda" and size > free_device_bytes(self.device) // KEEP_AHEAD_SHARE:
            return  # the readied executors' regions would crowd the candidates' memory: made by the job, as before
        keeper = self.judge.keeper()
        try:
            with self.gpu.hold(Phases(), "keep_ahead"):
                made = keeper.prepare(size)
        except Exception as e:  # noqa: BLE001  (no region ahead: its first job makes one, as before)
            keeper.close()
            log.warning("slot %s: a kept region of %d bytes could not be made ahead: %s", self.name, size, e)
            return
        try:
            if made:
                calls.keep_ahead(keeper, self.judge.region_kind, str(self.judge.device))
        except BaseException:  # the executor could not map it: its readying fails (_warm_up)
            keeper.close()
            raise
        if made:
            ex.region = keeper

    def _warm_for(self, solution: str) -> Optional[sandbox.Executor]:
        """The executor readied for `solution` (once its warm-up ended), taken off the readied ones; None
        if there is none, or it did not come back as it went in."""
        with self._lock:
            warm = self.warm.get(solution)
        if warm is None:
            return None
        warm.done.wait(warm.limit_s)
        with self._lock:
            if not warm.ok or not warm.done.is_set() or self.warm.get(solution) is not warm or not warm.ex.alive():
                return None
            del self.warm[solution]
        return warm.ex

    def _healthy(self, ex: sandbox.Executor, phase: Phases) -> bool:
        with self.gpu.hold(phase, "health"):
            try:
                send(ex.conn, Request(Op.HEALTH))
                h = expect(recv(ex.conn, time.monotonic() + deadlines.HEALTH_S, ex.arena), Health)
            except (DeadlineExceeded, ChannelClosed):  # BadMessage included
                return False
        return h.canary_ok and h.allocated - h.baseline < LEAK_BYTES

    @contextmanager
    def _alone(self, name: str, keep: Optional[sandbox.Executor],
               own: Optional[sandbox.Executor] = None) -> Iterator[None]:
        """A timed window: every executor of this slot but `keep` (all, for the reference's timing)
        settles its device work and is stopped until the window ends. On a GPU, a stopped process's
        queued work still runs, and a candidate can undo its executor's own synchronise: the window
        then checks that the GPU is this process's alone (see _gpu_to_itself), as it starts and, for a
        candidate's window, as it ends."""
        # nothing of a retirement runs in a window: a dying executor's context may still hold the GPU, and its
        # cleanup's Python would hold up this process's clock readings (an honest stepped CPU timing on a
        # two-core host was judged a lie while one ran)
        self._retired()
        with self._lock:
            executors = self._executors()
        with self.quiet.window(name, executors, keep) as w:
            stopped = [e for e in executors if e is not keep]
            if self.device.type == "cuda":
                self._gpu_to_itself(name, stopped, own)
            yield w
            if self.device.type == "cuda" and own is not None and own is keep:
                # the job's calls of this window are over: GPU work it left running fails it here, not a
                # later window's job (there may be none: its workload's reference was timed already)
                torch.cuda.synchronize(self.device)  # this process's own checks done: the probe sees others' work
                self._gpu_to_itself(name, stopped, own)

    def _gpu_shared(self) -> bool:
        """Whether another process's work is on the GPU: PROBE_TRIES probes a few ms apart (an honest
        neighbour's last kernels drain), each PROBE_FACTOR times slower than on the idle GPU at start."""
        if self._probe_s is None:
            return False
        for attempt in range(PROBE_TRIES):
            if attempt:
                time.sleep(PROBE_PAUSE_S)
            if round_trips_s(self.device, PROBE_ROUNDS) <= max(PROBE_MIN_S, PROBE_FACTOR * self._probe_s):
                return False
        return True

    def _gpu_to_itself(self, name: str, stopped: list[sandbox.Executor], own: Optional[sandbox.Executor]) -> None:
        """If another process's work is still on the GPU in a window, end the executors that ran candidate
        code, the job's own first (it ran last), one at a time, then the processes left behind to this slot,
        until the GPU is free: a process's end ends its context and that work. Work of the job's own executor
        fails the job (`work_left_running`, raised as GpuWorkLeftRunning); another's job finds its executor
        gone and is run again isolated. A GPU still busy after all that is busy from outside the slot: it is
        said once, and no executor is ended for it again until a window finds the GPU free."""
        if not self._gpu_shared():
            self._busy_outside = False
            return
        if self._busy_outside:
            return
        suspects = [e for e in stopped if e.solution is not None and e is not own and e.alive()]
        if own is not None and own.solution is not None and own.alive():
            suspects.insert(0, own)
        for ex in suspects:
            _end_now(ex)
            if not self._gpu_shared():
                log.warning("slot %s: %s window: GPU work of executor %d (solution %s) was still running; ended it",
                            self.name, name, ex.pid, ex.solution)
                if ex is own:
                    raise GpuWorkLeftRunning(
                        f"GPU work of the candidate's process was still running after its calls had returned "
                        f"(the {name.replace('_', ' ')} window found the GPU busy until that process was ended)")
                return
        strays = self._reap_strays(True)  # a daemon a candidate left, outside every executor's tree
        sandbox.wait_exited(strays, time.monotonic() + deadlines.RETIRE_EXIT_S, poll_s=0.001)
        if strays and not self._gpu_shared():
            log.warning("slot %s: %s window: GPU work of processes left behind was still running; killed them",
                        self.name, name)
            return
        self._busy_outside = True
        log.error("slot %s: %s window: the GPU is busy with work of a process outside this slot; timings are not "
                  "its own until it is free", self.name, name)

    def _left_behind(self, ex: sandbox.Executor) -> list[int]:
        """Live processes under an executor that returned from its job (it adopts its candidates' orphans)."""
        return ex.started_processes() if ex.alive() else []

    def _reap_strays(self, job_alone: bool) -> list[int]:
        """Kill processes that re-parented to this slot (their executor is gone, or a candidate
        undid its executor's adoption of orphans). They count against the job only when it was
        the only one running; with several lanes they cannot be told apart, and are only killed."""
        self._retired(without_uid=True)  # what a retirement has still to end is not a stray
        with self._lock:
            keep = {e.pid for e in self._executors()} | self.start.own_pids() | self._dying
            dying = frozenset(r.uid for r in self._retiring if r.uid is not None)
            strays = sandbox.reap_strays(keep, self.spec.sandbox.drop_privileges, dying)
            self.counters["strays_killed"] += len(strays)
        return strays if job_alone else []

    # -- the actor's API -----------------------------------------------------------------
    def info(self) -> dict:
        """Who and where this slot is; waits for its persistent executors to be warm."""
        for ex in list(self.persistent):
            self._ready(ex)
        ex = self.active
        self._overhead_for(EvalSettings(), ex)  # on the first lane's executor, before it serves any job
        if self.judge.caps is None:
            self.judge.caps = device_caps(self.device)  # the roofline's bandwidth and throughput, before any job
        if self.device.type == "cuda" and self._probe_s is None:  # the GPU idle: no job has run on this slot
            self._probe_s = min(round_trips_s(self.device, PROBE_ROUNDS) for _ in range(5))
        return {"name": self.name, "pid": os.getpid(), "device": str(self.device), "lanes": self.lanes,
                "environment": self.env.model_dump(mode="json"),
                "network_isolated": ex.network_isolated, "privileges_dropped": ex.privileges_dropped}

    def _calibration_key(self, s: EvalSettings) -> tuple:
        return (s.flush_l2, s.sync_device) if self.device.type == "cuda" else ()

    def _stopwatch(self, ex: sandbox.Executor) -> Optional[Stopwatch]:
        """On a CPU slot the bound's window leaves out the time a loaded host keeps the executor off a
        core, or its supervisor from reading the reply (honest reports broke the plain wall's bound on a
        busy machine); on a GPU slot the timed window holds the GPU alone and the wall is read."""
        if self.device.type != "cpu":
            return None
        account = self._cpu_account(ex)
        if account is None and not _NO_CGROUP_SAID:
            _NO_CGROUP_SAID.append(True)
            log.warning("no cgroup could be made for CPU accounting (fibray runs unprivileged, or no cgroup "
                        "hierarchy is writable): a CPU slot's timing bound reads the plain wall, no timed call "
                        "is clocked on its own, and honest reports may break the bound on a loaded host")
        return cpu_stopwatch(ex.executor_pid(), account)

    def _step_clock(self, ex: sandbox.Executor) -> Optional[StepClock]:
        """On a CPU slot whose executors' CPU is accounted (a cgroup), the clock the supervisor reads
        around every timed call (fibray.timing.steps). None elsewhere: a GPU's calls are queued ahead,
        and without the account a call's reading would carry the host's waits."""
        account = self._cpu_account(ex) if self.device.type == "cpu" else None
        return StepClock(ex.executor_pid(), account) if account is not None else None

    @staticmethod
    def _cpu_account(ex: sandbox.Executor) -> Optional[Callable[[], float]]:
        """The executor cgroup's CPU seconds, where its cgroup counts them."""
        return ex.cgroup.usage_s if ex.cgroup is not None and ex.cgroup.counts_cpu else None

    def _overhead_for(self, s: EvalSettings, pristine: Optional[sandbox.Executor] = None) -> Overhead:
        """The per-slot timing overhead for this timing mode, calibrated once on an executor no
        candidate has used (`pristine`, or a single-use one retired after)."""
        key = self._calibration_key(s)
        with self._calibrating:
            if key in self.overheads:
                return self.overheads[key]
            ex = pristine if pristine is not None else self._take_fresh()
            try:
                first = calibration_job(s, 1)
                calls = CalibrationSide(RemoteCalls(ex, first, Phases(), self.quiet, self._stopwatch(ex),
                                                    self._step_clock(ex)), self.judge)

                def finish(job: Job) -> None:
                    send(ex.conn, Request(Op.FINISH, job))
                    recv(ex.conn, time.monotonic() + deadlines.HEALTH_S, ex.arena)

                with self.gpu.hold(Phases(), "calibration", exclusive=True, keep=ex):
                    self.overheads[key] = calibrate(calls, s, self.device.type, finish, calls.calls.stopwatch)
            finally:
                if pristine is None:
                    with self._lock:
                        sandbox.retire(ex)
                        if ex in self.in_use:
                            self.in_use.remove(ex)
            return self.overheads[key]

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters)

    def evaluate(self, job: Job, mode: str, started_at: str) -> JobResult:
        """Evaluate one job. mode: persistent | isolated | auto (persistent, escalated on a fault).
        `started_at` (when it was sent) is replaced by when it got a lane."""
        self._lanes.acquire()  # queueing, not the job's time: not one of its phases
        phase = Phases()
        started_at = now_iso()  # a job sent ahead of time starts when it gets its lane
        with self._lock:
            self._busy += 1
            seen = list(self.faults.get((job.sweep, job.solution.hash), ()))
        try:
            if len(seen) >= self.spec.quarantine_after:
                evaluation = self.judge.fail(*quarantined(len(seen), seen[-1]), job.settings)
                return JobResult(job_id=job.job_id, evaluation=evaluation, worker=self.name, isolation="none",
                                 attempt=job.attempt, started_at=started_at, finished_at=now_iso(), phases=phase)
            result = self._evaluate(job, "isolated" if seen else mode, started_at, phase)
            if is_fault(result.escalated, result.evaluation.reason):
                with self._lock:
                    self.faults.setdefault((job.sweep, job.solution.hash), []).append(result.evaluation.status)
            return result
        except NoExecutor as e:  # e.g. spares killed as they warmed up: a verdict, never a stopped sweep
            evaluation = self.judge.fail(Status.RUNTIME_ERROR, Reason.EXECUTOR_UNAVAILABLE,
                                         bound_log(str(e), job.settings.log_limit), job.settings)
            return JobResult(job_id=job.job_id, evaluation=evaluation, worker=self.name, isolation=mode,
                             attempt=job.attempt, started_at=started_at, finished_at=now_iso(), phases=phase)
        finally:
            with self._lock:
                self._busy -= 1
            self._lanes.release()

    def _evaluate(self, job: Job, mode: str, started_at: str, phase: Phases) -> JobResult:
        with phase("executor_wait"):
            ex = self._take_fresh() if mode == "isolated" else self._take_persistent(job.solution.hash)
        isolation = "isolated" if ex.single_use else "persistent"
        escalated = False
        evaluation, fault = self._run(ex, job, phase)
        # processes the candidate left behind are found before anything retires their parent
        with phase("strays"):
            left = self._left_behind(ex) if fault is None else []
        if fault is not None:
            with phase("retire"):
                self._discard(ex)
            # the kernel ended it for the memory bound its own solution went over: a fresh process would too
            if mode == "auto" and fault.reason != Reason.OUT_OF_MEMORY:
                with self._lock:
                    self.counters["escalations"] += 1
                escalated, isolation = True, "isolated"
                with phase("executor_wait"):
                    ex = self._take_fresh()
                evaluation, fault = self._run(ex, job, phase)
                with phase("strays"):
                    left = self._left_behind(ex) if fault is None else []
                with phase("retire"):
                    self._discard(ex)
            if fault is not None:
                evaluation = self._fault_verdict(job, fault, ex)
        else:
            # a report that lied about its latency came from a process the candidate rebound
            spoilt = evaluation.reason in _RETIRING_REASONS
            retire = ex.single_use or left or spoilt or not self._healthy(ex, phase)
            if retire:
                with phase("retire"):
                    self._discard(ex)
            else:
                self._give_back(ex)
        with phase("strays"):
            with self._lock:
                alone = self._busy == 1
            strays = self._reap_strays(alone)
        if left:
            with self._lock:
                self.counters["strays_killed"] += len(left)
        if strays or left:
            # processes that outlive the window ran beside the timed calls: they, not the report, may be
            # what broke the timing bound, so the verdict names them (a failure either way)
            if evaluation.status == Status.PASSED or evaluation.reason == Reason.TIMING_BELOW_OBSERVED:
                also = "" if evaluation.status == Status.PASSED else f"; they ran beside its timed calls: {evaluation.log}"
                evaluation = self.judge.fail(Status.RUNTIME_ERROR, Reason.LEFT_CHILD_PROCESS,
                                             f"the candidate left {len(set(strays) | set(left))} process(es) running; "
                                             f"killed{also}", job.settings)
        return JobResult(job_id=job.job_id, evaluation=evaluation, worker=self.name, isolation=isolation,
                         attempt=job.attempt, started_at=started_at, finished_at=now_iso(), escalated=escalated,
                         network_isolated=ex.network_isolated, privileges_dropped=ex.privileges_dropped, checks=self.checks,
                         phases=phase)

    def _run(self, ex: sandbox.Executor, job: Job, phase: Phases) -> tuple[Optional[Evaluation], Optional[ExecutorFault]]:
        if ex.region is None and not ex.single_use:
            ex.region = self.judge.keeper()
        calls = RemoteCalls(ex, job, phase, self.quiet, self._stopwatch(ex), self._step_clock(ex), ex.region)
        with phase("calibration"):
            overhead = self._overhead_for(job.settings)
        try:
            evaluation = run_job(job, self.judge, calls, phase, LaneGpu(self.gpu, ex), overhead)
        except ExecutorFault as f:
            sandbox.kill_executor(ex)  # hung or broken: down at once, whole tree
            return None, f
        finally:
            calls.resume()  # a job judged on its timed calls' outputs ends with its executor stopped
        try:
            with phase("finish"):
                send(ex.conn, Request(Op.FINISH, job))
                answer(ex, time.monotonic() + deadlines.HEALTH_S, self.quiet)
        except (ChannelClosed, DeadlineExceeded):
            pass  # the health check that follows retires it
        return evaluation, None

    def _fault_verdict(self, job: Job, fault: ExecutorFault, ex: sandbox.Executor) -> Evaluation:
        log, tail = fault.log, ex.output_tail()
        if tail and tail not in log:
            log = f"{log}\n--- candidate output (tail) ---\n{tail}"
        return self.judge.fail(fault.status, fault.reason, bound_log(log, job.settings.log_limit), job.settings)

    def shutdown(self) -> None:
        self._retired()
        for ex in self._executors():
            sandbox.retire(ex)
        self.start.close()
        self.quiet.close()
        sandbox.reap_strays(set(), self.spec.sandbox.drop_privileges)
