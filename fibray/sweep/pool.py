"""GPU slots and the scheduling loop that keeps them busy, with deadlines on every wait.

One slot (a Ray actor owning one GPU) runs up to `lanes` jobs at a time (timing stays
exclusive on its GPU), with one more waiting in it so that no lane waits for the driver's
round trip between jobs; its supervisor escalates faulty jobs to fresh processes itself. Here, on the driver: a solution that faulted runs
isolated for the rest of the sweep and is quarantined after K faults (each remaining job
still gets a record); a slot that dies or stops answering is replaced and its job re-run
(the store, not this loop, guarantees a job is recorded once). Jobs are grouped by
solution so an executor (which serves one solution) serves all of its jobs before it retires;
the slot remembers the faults it saw, so jobs of a faulty solution already sent ahead of them
run isolated, or are quarantined there.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from fibray import deadlines
from fibray.schema.reasons import Reason, is_fault, quarantined
from fibray.schema import Environment, Evaluation, EvaluationStatus, Job, JobResult
from fibray.evaluate.phases import now_iso
from fibray.sweep.config import RunnerConfig, auto_lanes, standby_count
from fibray.workers.actor import SlotActor
from fibray.workers.spec import PREWARM_AHEAD, SandboxPolicy, SlotSpec, distinct_shapes

log = logging.getLogger(__name__)

RemoteSlot = ray.remote(SlotActor)


class WorkerStartError(RuntimeError):
    """No worker slot could be started within the deadline."""


_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w*(?:Error|Exception|Available|Exit|Interrupt))(?:: (.*))?$")


def start_error(e: BaseException) -> str:
    """One line for why a slot's actor could not start: the exception its __init__ raised (Ray wraps
    it in a traceback of the actor process), not the wrapping."""
    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e)
    for line in reversed(text.strip().splitlines()):
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    return (text.strip().splitlines() or [type(e).__name__])[0]


def job_groups(jobs: Iterable[Job], group_of: Callable[[Job], Any] = lambda j: (j.definition.name, j.solution.hash)
               ) -> OrderedDict[Any, deque[Job]]:
    """The jobs as a pool runs them: grouped by solution, since an executor serves one solution and is then
    retired, so a slot that moves to another solution pays a fresh executor (grouped by workload, nearly
    every job did: 61 of 63 on the smoke sweep). Every other group of a definition runs its workloads in
    reverse, so the slot's cache of inputs and reference outputs (least recently used first out) still
    holds the workloads it ends on."""
    groups: OrderedDict[Any, deque[Job]] = OrderedDict()
    for job in jobs:
        groups.setdefault(group_of(job), deque()).append(job)
    seen: Counter[str] = Counter()
    for queue in groups.values():
        definition = queue[0].definition.name
        if seen[definition] % 2:
            queue.reverse()
        seen[definition] += 1
    return groups


@dataclass
class PoolOptions:
    """How many slots, and how they treat candidates (the runner config, as the pool reads it)."""

    num_slots: int
    num_gpus_per_slot: float = 1.0
    num_cpus_per_slot: float = 0.0
    torch_threads: Optional[int] = None
    workdir: Optional[str] = None
    start_deadline_s: float = deadlines.SLOT_START_S
    poll_s: float = deadlines.POOL_POLL_S
    isolation: str = "auto"          # auto | persistent | isolated
    quarantine_after: int = 3        # faults before a solution is quarantined
    max_attempts: int = 3            # re-runs of a job whose slot was lost
    standby: int = 1                 # warm standby executors per slot
    spare_isolated: int = 1
    lanes: int = 1                   # jobs in flight per slot
    lanes_auto: bool = False         # lanes came from runner.lanes=auto: a GPU slot takes its own (slot_lanes)
    prewarm: Union[bool, str] = "auto"  # ready an executor for the solution a slot likely takes next (auto: on GPUs)
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    actor_prefix: Optional[str] = None
    """Name slot actors `<prefix>gpu<i>.<generation>` as detached actors (the service's slots outlive their caller)."""
    namespace: Optional[str] = None
    """Ray namespace of named slot actors."""

    @classmethod
    def from_runner(cls, r: RunnerConfig, *, num_slots: int, torch_threads: Optional[int] = None,
                    start_deadline_s: float = deadlines.SLOT_START_S, build_cache: Optional[str] = None,
                    workdir: Optional[str] = None) -> "PoolOptions":
        """The sweep's `runner` section (and what the driver knows: slots, threads, the build cache);
        `workdir` overrides runner.workdir."""
        policy = SandboxPolicy(
            isolate_network=r.isolate_network, drop_privileges=r.drop_privileges,
            uid_range=tuple(r.uid_range) if r.uid_range else None,
            memory_limit_bytes=int(r.memory_limit_gb * (1 << 30)) if r.memory_limit_gb else None,
            max_open_files=r.max_open_files, max_processes=r.max_processes, build_cache=build_cache,
            executor_checks=r.executor_checks, fork_server=r.fork_server,
            scratch_bytes=int(r.scratch_gb * (1 << 30)) if r.scratch_gb else None)
        cpus = torch_threads or os.cpu_count() or 1
        lanes = auto_lanes(r.lanes, cpus)
        return cls(num_slots=num_slots, torch_threads=torch_threads, start_deadline_s=start_deadline_s,
                   isolation=r.isolation, quarantine_after=r.quarantine_after, max_attempts=r.max_attempts,
                   standby=standby_count(r.standby, lanes, cpus), spare_isolated=r.spare_isolated, lanes=lanes,
                   lanes_auto=r.lanes == "auto",
                   prewarm=r.prewarm, workdir=workdir or r.workdir, sandbox=policy)

    def slot_spec(self, name: str) -> SlotSpec:
        """What one slot actor is asked to be (no spares where nothing is ever isolated)."""
        return SlotSpec(name=name, sandbox=self.sandbox, workdir=self.workdir, torch_threads=self.torch_threads,
                        standby=self.standby, spare_isolated=self.spare_isolated if self.isolation != "persistent" else 0,
                        lanes=self.lanes, lanes_auto=self.lanes_auto, quarantine_after=self.quarantine_after,
                        prewarm=self.prewarm)


@dataclass
class Flight:
    """A job sent to a slot and not yet answered."""

    job: Job
    started_at: str
    deadline: float


@dataclass
class Slot:
    """One GPU and the actor that currently owns it."""

    index: int
    actor: Any = None
    generation: int = 0
    info: Optional[dict] = None
    phase: Optional[str] = None  # start | ready | dead
    start_ref: Any = None
    start_deadline: float = 0.0
    inflight: dict = field(default_factory=dict)  # ObjectRef -> Flight
    group: Any = None
    why: str = ""  # why it could not start, when it could not

    def lanes(self, configured: int) -> int:
        """The lanes its actor runs (fibray.workers.spec.slot_lanes; `configured` until it said)."""
        return int(self.info.get("lanes", configured)) if self.info else configured


class WorkerPool:
    """Runs jobs on GPU slots; calls on_result(job, result) once per finished job."""

    def __init__(self, options: PoolOptions) -> None:
        self.opt = options
        self.slots = [Slot(i) for i in range(options.num_slots)]
        self.faults: Counter[str] = Counter()
        self.isolated: set[str] = set()
        self.quarantined: dict[Any, tuple[EvaluationStatus, str, str]] = {}
        """solution hash (a service: (sweep, hash)) -> the verdict its remaining jobs get."""
        self.counters: Counter[str] = Counter()
        self.first_dispatch: Optional[float] = None
        """time.monotonic() of the first job sent to a slot (slot start-up ends there)."""

    # -- slots -----------------------------------------------------------------------------
    def _spawn(self, slot: Slot) -> None:
        slot.generation += 1
        named = ({"name": f"{self.opt.actor_prefix}gpu{slot.index}.{slot.generation}", "namespace": self.opt.namespace,
                  "lifetime": "detached"} if self.opt.actor_prefix else {})
        slot.actor = RemoteSlot.options(
            num_gpus=self.opt.num_gpus_per_slot, num_cpus=self.opt.num_cpus_per_slot, max_restarts=0,
            max_concurrency=self.opt.lanes + 3,  # its lanes' jobs, the one waiting, a prewarm, a stats or shutdown call
            **named,
        ).remote(self.opt.slot_spec(f"gpu{slot.index}.{slot.generation}"))
        slot.phase, slot.start_ref, slot.inflight = "start", slot.actor.info.remote(), {}
        slot.start_deadline = time.monotonic() + self.opt.start_deadline_s

    def _replace(self, slot: Slot) -> None:
        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor = None
        self.counters["slot_restarts"] += 1
        self._spawn(slot)

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def shutdown(self) -> None:
        # a slot still starting is only killed: its shutdown would queue behind a start that may never
        # come (no node can place it), and its executors end with it (they watch their parent)
        refs = [s.actor.shutdown.remote() for s in self.slots if s.actor is not None and s.phase == "ready"]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=deadlines.POOL_SHUTDOWN_S)
        finally:
            for slot in self.slots:
                if slot.actor is not None:
                    ray.kill(slot.actor, no_restart=True)
                    slot.actor = None

    def lanes(self) -> int:
        """The most lanes a slot runs (each slot says once it is ready; runner.lanes until then)."""
        return max((s.lanes(self.opt.lanes) for s in self.slots if s.info), default=self.opt.lanes)

    def slot_stats(self) -> list[dict]:
        live = [s for s in self.slots if s.actor is not None and s.phase == "ready"]
        return ray.get([s.actor.stats.remote() for s in live], timeout=deadlines.SLOT_STATS_S) if live else []

    # -- scheduling ------------------------------------------------------------------------
    def run(self, jobs: Iterable[Job], on_result: Callable[[Job, JobResult], None],
            group_of: Callable[[Job], Any] = lambda j: (j.definition.name, j.solution.hash)) -> None:
        """Run every job to a result; returns when all are recorded, in the groups of job_groups."""
        groups = job_groups(jobs, group_of)
        if not any(s.actor for s in self.slots):
            self.start()
        while groups or any(s.inflight for s in self.slots):
            for slot in self.slots:
                while slot.phase == "ready" and len(slot.inflight) < slot.lanes(self.opt.lanes) + 1 and groups:
                    job = self._next_job(slot, groups)
                    if job.solution.hash in self.quarantined:
                        on_result(job, self._quarantine_verdict(slot, job))
                        continue
                    self._dispatch(slot, job)
            waits = {s.start_ref: (s, None) for s in self.slots if s.phase == "start"}
            waits.update({ref: (s, ref) for s in self.slots for ref in s.inflight})
            if not waits:
                if groups and all(s.phase == "dead" for s in self.slots):
                    whys = list(dict.fromkeys(s.why for s in self.slots if s.why))
                    raise WorkerStartError("no worker slot could be started: " + "; ".join(whys or ["see the log"]))
                continue
            deadlines = [s.start_deadline for s in self.slots if s.phase == "start"]
            deadlines += [f.deadline for s in self.slots for f in s.inflight.values()]
            timeout = max(0.01, min(min(deadlines) - time.monotonic(), self.opt.poll_s))
            ready, _ = ray.wait(list(waits), num_returns=1, timeout=timeout)
            for ref in ready:
                slot, flight_ref = waits[ref]
                if flight_ref is None:
                    self._started(slot)
                elif flight_ref in slot.inflight:  # not already requeued with the rest of a lost slot
                    self._complete(slot, flight_ref, on_result, groups)
            now = time.monotonic()
            for slot in self.slots:
                if slot.phase == "start" and now > slot.start_deadline:
                    self._start_failed(slot, f"not ready within {self.opt.start_deadline_s}s")
                elif any(now > f.deadline for f in slot.inflight.values()):
                    self._lose(slot, groups, "supervisor did not answer within its deadline")

    def _next_job(self, slot: Slot, groups: OrderedDict[Any, deque[Job]]) -> Job:
        busy = {s.group for s in self.slots if s is not slot and s.inflight}
        key = slot.group if slot.group in groups else next((k for k in groups if k not in busy), None)
        if key is None:
            key = max(groups, key=lambda k: len(groups[k]))
        queue = groups[key]
        job = queue.popleft()
        if not queue:
            del groups[key]
        if self.opt.prewarm is not False and key != slot.group and slot.actor is not None:
            # the groups this slot likely takes after this one: executors of their own get ready meanwhile
            for after in itertools.islice((k for k in groups if k != key and k not in busy), PREWARM_AHEAD):
                slot.actor.prewarm.remote(distinct_shapes(groups[after]))  # nothing to wait for: a guess, never a job
        slot.group = key
        return job

    def _mode(self, job: Job) -> str:
        if self.opt.isolation == "isolated" or job.solution.hash in self.isolated:
            return "isolated"
        return self.opt.isolation

    def _dispatch(self, slot: Slot, job: Job) -> None:
        mode = self._mode(job)
        s = job.settings
        budget = s.build_deadline_s + s.run_deadline_s
        if self.first_dispatch is None:
            self.first_dispatch = time.monotonic()
        started_at = now_iso()
        ref = slot.actor.evaluate.remote(job, mode, started_at)
        # the supervisor enforces the real deadlines; this one only catches a supervisor that hangs
        # (a job may first wait for a lane to free up, and for the other lanes' timings)
        wait = budget * (slot.lanes(self.opt.lanes) + 1)
        slot.inflight[ref] = Flight(job, started_at, time.monotonic() + (2 * budget if mode == "auto" else budget)
                                    + wait + self.opt.start_deadline_s)

    def _requeue(self, job: Job, groups, why: str, slot: Slot, on_result=None) -> None:
        if job.attempt >= self.opt.max_attempts:
            if on_result is not None:
                on_result(job, self._verdict(slot, job, EvaluationStatus.RUNTIME_ERROR, Reason.WORKER_LOST,
                                             f"worker lost {job.attempt} times ({why}); giving up"))
            return
        retry = job.model_copy(update={"attempt": job.attempt + 1})
        groups.setdefault(("retry", job.job_id), deque()).appendleft(retry)
        groups.move_to_end(("retry", job.job_id), last=False)
        self.counters["requeued"] += 1
        log.warning("slot gpu%d lost (%s); job %s requeued (attempt %d)", slot.index, why, job.job_id[:12], retry.attempt)

    def _lose(self, slot: Slot, groups, why: str, on_result=None) -> None:
        """The slot's actor died or hangs: every job in flight on it runs again elsewhere; a new actor takes the GPU."""
        flights, slot.inflight = list(slot.inflight.values()), {}
        for f in flights:
            self._requeue(f.job, groups, why, slot, on_result)
        self._replace(slot)

    def _started(self, slot: Slot) -> None:
        ref, slot.start_ref = slot.start_ref, None
        try:
            value = ray.get(ref, timeout=deadlines.READY_REF_S)
        except GetTimeoutError:
            slot.start_ref = ref
            return
        except (RayActorError, RayTaskError) as e:
            log.debug("slot gpu%d: its actor's start raised: %s", slot.index, e)
            self._start_failed(slot, start_error(e))
            return
        slot.info, slot.phase = value, "ready"
        log.info("slot %s ready on %s (network isolated: %s, unprivileged: %s)", value["name"], value["device"],
                 value["network_isolated"], value["privileges_dropped"])

    def _complete(self, slot: Slot, ref: Any, on_result, groups) -> None:
        try:
            value = ray.get(ref, timeout=deadlines.READY_REF_S)
        except GetTimeoutError:
            return
        except RayActorError as e:
            self._lose(slot, groups, f"actor died: {type(e).__name__}", on_result)
            return
        except RayTaskError as e:
            # nothing a job does may stop the sweep: it gets a verdict, the others go on
            job = slot.inflight.pop(ref).job
            log.error("slot gpu%d raised during job %s: %s", slot.index, job.job_id[:12], e)
            result = self._verdict(slot, job, EvaluationStatus.RUNTIME_ERROR, Reason.SUPERVISOR_ERROR,
                                   f"the slot's supervisor raised during this job: {str(e)[-4000:]}")
            self._account(job, result)
            on_result(job, result)
            return
        job = slot.inflight.pop(ref).job
        self._account(job, value)
        on_result(job, value)

    def _account(self, job: Job, result: JobResult) -> None:
        ev = result.evaluation
        if is_fault(result.escalated, ev.reason):
            h = job.solution.hash
            self.isolated.add(h)
            self.faults[h] += 1
            if self.faults[h] >= self.opt.quarantine_after and h not in self.quarantined:
                self.quarantined[h] = quarantined(self.faults[h], ev.status)
                log.warning("solution %s quarantined after %d faults", job.solution.name, self.faults[h])

    def _start_failed(self, slot: Slot, why: str) -> None:
        log.error("slot gpu%d could not start: %s", slot.index, why)
        slot.why = why
        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor, slot.phase, slot.start_ref = None, "dead", None

    def _quarantine_verdict(self, slot: Slot, job: Job) -> JobResult:
        return self._verdict(slot, job, *self.quarantined[job.solution.hash])

    def _verdict(self, slot: Slot, job: Job, status: EvaluationStatus, reason: str, log_text: str) -> JobResult:
        env = Environment.model_validate(slot.info["environment"]) if slot.info else Environment(hardware="unknown")
        ev = Evaluation(status=status, reason=reason, log=log_text, environment=env, timestamp=now_iso())
        worker = slot.info["name"] if slot.info else f"gpu{slot.index}"
        now = now_iso()
        return JobResult(job_id=job.job_id, evaluation=ev, worker=worker, isolation="none", attempt=job.attempt,
                         started_at=now, finished_at=now)
