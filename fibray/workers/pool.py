"""GPU slots and the scheduling loop that keeps them busy, with deadlines on every wait.

One slot per GPU holds one actor. A job goes through `build` (build deadline) and `run`
(run deadline). An actor that misses a deadline is killed and replaced; an actor that
dies is replaced. Jobs are grouped by workload so a slot reuses its inputs and reference.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from fibray.schema import Environment, Evaluation, EvaluationStatus, Job, JobResult
from fibray.workers.actor import RemoteGpuWorker

log = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """No worker could be started within the deadline."""


def _now() -> str:
    from fibray.evaluate import now_iso

    return now_iso()


@dataclass
class Slot:
    """One GPU and the actor that currently owns it."""

    index: int
    actor: Any = None
    generation: int = 0
    info: Optional[dict] = None
    phase: Optional[str] = None  # start | build | run | None (idle)
    ref: Any = None
    deadline: float = 0.0
    job: Optional[Job] = None
    started_at: str = ""
    built: set[str] = field(default_factory=set)
    group: Any = None


@dataclass
class PoolOptions:
    num_slots: int
    num_gpus_per_actor: float = 1.0
    num_cpus_per_actor: float = 0.0
    torch_threads: Optional[int] = None
    workdir: Optional[str] = None
    start_deadline_s: float = 180.0
    poll_s: float = 0.5


class WorkerPool:
    """Runs jobs on GPU slots; calls on_result(job, result) for every job, exactly once per call."""

    def __init__(self, options: PoolOptions) -> None:
        self.opt = options
        self.slots = [Slot(i) for i in range(options.num_slots)]
        self.replacements = 0

    # -- actors ------------------------------------------------------------------------
    def _spawn(self, slot: Slot) -> None:
        slot.generation += 1
        slot.actor = RemoteGpuWorker.options(
            num_gpus=self.opt.num_gpus_per_actor, num_cpus=self.opt.num_cpus_per_actor, max_restarts=0,
            max_concurrency=1,
        ).remote(f"gpu{slot.index}.{slot.generation}", self.opt.workdir, self.opt.torch_threads)
        slot.phase, slot.ref, slot.job = "start", slot.actor.info.remote(), None
        slot.deadline = time.monotonic() + self.opt.start_deadline_s
        slot.built = set()

    def _retire(self, slot: Slot) -> None:
        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor = None
        self.replacements += 1
        self._spawn(slot)

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.actor is not None:
                ray.kill(slot.actor, no_restart=True)
                slot.actor = None

    # -- scheduling ----------------------------------------------------------------------
    def run(self, jobs: Iterable[Job], on_result: Callable[[Job, JobResult], None],
            group_of: Callable[[Job], Any] = lambda j: (j.definition.name, j.workload.uuid)) -> None:
        """Run every job to a result; returns when all are recorded."""
        groups: OrderedDict[Any, deque[Job]] = OrderedDict()
        for job in jobs:
            groups.setdefault(group_of(job), deque()).append(job)
        if not self.slots[0].actor:
            self.start()
        while groups or any(s.phase in ("build", "run") for s in self.slots):
            for slot in self.slots:
                if slot.phase is None and groups:
                    self._dispatch(slot, self._next_job(slot, groups))
            refs = {s.ref: s for s in self.slots if s.ref is not None}
            if not refs:
                raise WorkerStartError("no worker slot is alive")
            timeout = max(0.01, min(min(s.deadline for s in refs.values()) - time.monotonic(), self.opt.poll_s))
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
            for ref in ready:
                self._complete(refs[ref], on_result)
            now = time.monotonic()
            for slot in self.slots:
                if slot.ref is not None and now > slot.deadline:
                    self._expire(slot, on_result)

    def _next_job(self, slot: Slot, groups: OrderedDict[Any, deque[Job]]) -> Job:
        busy = {s.group for s in self.slots if s is not slot and s.phase in ("build", "run")}
        key = slot.group if slot.group in groups else next((k for k in groups if k not in busy), None)
        if key is None:
            key = max(groups, key=lambda k: len(groups[k]))
        queue = groups[key]
        job = queue.popleft()
        if not queue:
            del groups[key]
        slot.group = key
        return job

    def _dispatch(self, slot: Slot, job: Job) -> None:
        slot.job, slot.started_at = job, _now()
        if job.solution.hash in slot.built:
            self._submit_run(slot)
        else:
            slot.phase, slot.ref = "build", slot.actor.build.remote(job)
            slot.deadline = time.monotonic() + job.settings.build_deadline_s

    def _submit_run(self, slot: Slot) -> None:
        slot.phase, slot.ref = "run", slot.actor.run.remote(slot.job, slot.started_at)
        slot.deadline = time.monotonic() + slot.job.settings.run_deadline_s

    def _complete(self, slot: Slot, on_result) -> None:
        phase, job, ref = slot.phase, slot.job, slot.ref
        slot.ref = None
        try:
            value = ray.get(ref, timeout=10)
        except RayActorError as e:
            if phase == "start":
                raise WorkerStartError(f"worker gpu{slot.index} failed to start: {e}") from e
            self._finish(slot, job, self._verdict(slot, job, EvaluationStatus.RUNTIME_ERROR, "crashed",
                                                  f"worker process died during {phase}: {e}"), on_result)
            self._retire(slot)
            return
        except RayTaskError as e:  # a bug in fibray's worker code, not the candidate's
            raise RuntimeError(f"worker gpu{slot.index} raised during {phase}: {e}") from e
        except GetTimeoutError:
            slot.ref = ref
            return
        if phase == "start":
            slot.info, slot.phase = value, None
            log.info("worker %s ready on %s", value["name"], value["device"])
        elif phase == "build":
            slot.built.add(job.solution.hash)
            self._submit_run(slot)
        else:
            self._finish(slot, job, value, on_result)

    def _expire(self, slot: Slot, on_result) -> None:
        phase, job = slot.phase, slot.job
        if phase == "start":
            raise WorkerStartError(f"worker gpu{slot.index} did not start within {self.opt.start_deadline_s}s")
        limit = job.settings.build_deadline_s if phase == "build" else job.settings.run_deadline_s
        result = self._verdict(slot, job, EvaluationStatus.TIMEOUT, f"{phase}_timeout",
                               f"{phase} did not finish within its deadline of {limit}s; worker killed")
        slot.ref = None
        self._retire(slot)
        self._finish(slot, job, result, on_result, keep_phase=True)

    def _finish(self, slot: Slot, job: Job, result: JobResult, on_result, keep_phase: bool = False) -> None:
        if not keep_phase:
            slot.phase = None
        slot.job = None
        on_result(job, result)

    def _verdict(self, slot: Slot, job: Job, status: EvaluationStatus, reason: str, log_text: str) -> JobResult:
        env = Environment.model_validate(slot.info["environment"]) if slot.info else Environment(hardware="unknown")
        ev = Evaluation(status=status, reason=reason, log=log_text, environment=env, timestamp=_now())
        worker = slot.info["name"] if slot.info else f"gpu{slot.index}"
        return JobResult(job_id=job.job_id, evaluation=ev, worker=worker, attempt=job.attempt,
                         started_at=slot.started_at, finished_at=_now())
