"""The service's scheduling: a bounded queue served round-robin between clients, and the sweep's
WorkerPool (lanes, standby, escalation, quarantine, lost slots re-run) driven as a loop that never
ends over named, detached slots it restores; isolation and quarantine are kept per sweep name."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Any, Callable, Optional

import ray

from fibray.schema import EvaluationStatus, Job, JobResult
from fibray.schema.reasons import is_fault, quarantined
from fibray.sweep.pool import PoolOptions, Slot, WorkerPool

log = logging.getLogger(__name__)

OnResult = Callable[[Job, JobResult], None]


class FairQueue:
    """Jobs waiting for a slot, one FIFO per client, taken round-robin between clients.

    Bounded in total and per client; a retry (a lost slot's job) goes to the front of its
    client's line and is never refused. Thread-safe."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total, self.max_per_client = max_total, max_per_client
        self._lines: OrderedDict[str, deque[Job]] = OrderedDict()
        self._lock = threading.Lock()
        self._n = 0

    def room(self, client: str) -> int:
        """How many more jobs `client` may queue now."""
        with self._lock:
            mine = len(self._lines.get(client, ()))
            return max(0, min(self.max_total - self._n, self.max_per_client - mine))

    def push(self, client: str, jobs: list[Job]) -> None:
        """Queue a batch, its jobs grouped by solution (in the order solutions first appear): an
        executor serves one solution, so a slot pays a fresh executor at each change."""
        groups: dict[tuple[str, str], list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.definition.name, job.solution.hash), []).append(job)
        with self._lock:
            self._lines.setdefault(client, deque()).extend(j for group in groups.values() for j in group)
            self._n += len(jobs)

    def push_front(self, client: str, job: Job) -> None:
        with self._lock:
            self._lines.setdefault(client, deque()).appendleft(job)
            self._lines.move_to_end(client, last=False)  # a retry goes first: it has waited once already
            self._n += 1

    def pop(self) -> Optional[tuple[str, Job]]:
        """The next job: the head of the next client's line in rotation."""
        with self._lock:
            for client in list(self._lines):
                line = self._lines[client]
                if line:
                    self._n -= 1
                    job = line.popleft()
                    self._lines.move_to_end(client)
                    if not line:
                        del self._lines[client]
                    return client, job
            return None

    def depth(self) -> dict[str, int]:
        with self._lock:
            return {c: len(q) for c, q in self._lines.items() if q}

    def __len__(self) -> int:
        return self._n


class ServicePool(WorkerPool):
    """The WorkerPool's slots and fault handling, fed from a FairQueue for as long as the service runs."""

    def __init__(self, options: PoolOptions, queue: FairQueue, client_of: Callable[[Job], str],
                 restore_interval_s: float = 5.0) -> None:
        super().__init__(options)
        self.queue, self.client_of = queue, client_of
        self.restore_interval_s = restore_interval_s
        self._last_restore = 0.0
        self.names: dict[str, str] = {}
        """solution hash -> name, for the status of quarantined solutions."""
        self.sweep_faults: Counter[tuple[str, str]] = Counter()

    # -- per-sweep isolation and quarantine ---------------------------------------------------
    def _mode(self, job: Job) -> str:
        if self.opt.isolation == "isolated" or (job.sweep, job.solution.hash) in self.isolated:
            return "isolated"
        return self.opt.isolation

    def _account(self, job: Job, result: JobResult) -> None:
        ev = result.evaluation
        if is_fault(result.escalated, ev.reason):
            key = (job.sweep, job.solution.hash)
            self.names[job.solution.hash] = job.solution.name
            self.isolated.add(key)
            self.sweep_faults[key] += 1
            if self.sweep_faults[key] >= self.opt.quarantine_after and key not in self.quarantined:
                self.quarantined[key] = quarantined(self.sweep_faults[key], ev.status)
                log.warning("solution %s quarantined in sweep %s after %d faults", job.solution.name, job.sweep,
                            self.sweep_faults[key])

    def _quarantine_verdict(self, slot: Slot, job: Job) -> JobResult:
        return self._verdict(slot, job, *self.quarantined[(job.sweep, job.solution.hash)])

    # -- a lost slot's jobs go back to the front of their client's line ----------------------
    def _requeue(self, job: Job, groups: Any, why: str, slot: Slot, on_result: Optional[OnResult] = None) -> None:
        if job.attempt >= self.opt.max_attempts:
            assert on_result is not None  # the service loop always passes it: no job is dropped
            on_result(job, self._verdict(slot, job, EvaluationStatus.RUNTIME_ERROR, "worker_lost",
                                         f"worker lost {job.attempt} times ({why}); giving up"))
            return
        self.queue.push_front(self.client_of(job), job.model_copy(update={"attempt": job.attempt + 1}))
        self.counters["requeued"] += 1
        log.warning("slot gpu%d lost (%s); job %s requeued (attempt %d)", slot.index, why, job.job_id[:12], job.attempt + 1)

    def _complete(self, slot: Slot, ref: Any, on_result: OnResult, groups: Any) -> None:
        try:
            super()._complete(slot, ref, on_result, groups)
        except RuntimeError as e:  # the slot raised (a fibray bug): a service keeps going, on a new slot
            log.error("%s", e)
            self._lose(slot, groups, "the slot raised during a job", on_result)

    # -- the loop -----------------------------------------------------------------------------
    def step(self, on_result: OnResult, timeout_s: float) -> bool:
        """Dispatch what fits, wait up to `timeout_s` for one slot event and handle what came;
        returns whether anything is in flight or starting (False: the caller may sleep)."""
        for slot in self.slots:
            while slot.phase == "ready" and len(slot.inflight) < slot.lanes(self.opt.lanes) + 1:
                item = self.queue.pop()
                if item is None:
                    break
                job = item[1]
                if (job.sweep, job.solution.hash) in self.quarantined:
                    on_result(job, self._quarantine_verdict(slot, job))
                    continue
                self._dispatch(slot, job)
        waits = {s.start_ref: (s, None) for s in self.slots if s.phase == "start"}
        waits.update({ref: (s, ref) for s in self.slots for ref in s.inflight})
        self.restore()
        if not waits:
            return False
        deadlines = [s.start_deadline for s in self.slots if s.phase == "start"]
        deadlines += [f.deadline for s in self.slots for f in s.inflight.values()]
        timeout = max(0.0, min(min(deadlines) - time.monotonic(), timeout_s))
        ready, _ = ray.wait(list(waits), num_returns=1, timeout=timeout)
        if ready:  # whatever else finished meanwhile, at once
            rest = [r for r in waits if r not in ready]
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else []
        for ref in ready:
            slot, flight_ref = waits[ref]
            if flight_ref is None:
                if slot.start_ref is ref:
                    self._started(slot)
            elif flight_ref in slot.inflight:  # not already requeued with the rest of a lost slot
                self._complete(slot, flight_ref, on_result, None)
        now = time.monotonic()
        for slot in self.slots:
            if slot.phase == "start" and now > slot.start_deadline:
                self._start_failed(slot, f"not ready within {self.opt.start_deadline_s}s")
            elif any(now > f.deadline for f in slot.inflight.values()):
                self._lose(slot, None, "supervisor did not answer within its deadline", on_result)
        return True

    def restore(self) -> None:
        """Start a slot that could not start (its node was lost) again once a GPU is free for it."""
        now = time.monotonic()
        dead = [s for s in self.slots if s.phase == "dead"]
        if not dead or now - self._last_restore < self.restore_interval_s:
            return
        self._last_restore = now
        free = ray.available_resources().get("GPU", 0.0)
        for slot in dead:
            if free < self.opt.num_gpus_per_slot:
                break
            free -= self.opt.num_gpus_per_slot
            log.warning("restoring slot gpu%d: the cluster has a free GPU again", slot.index)
            self.counters["slot_restores"] += 1
            self._spawn(slot)

    def wait_started(self, deadline_s: float) -> None:
        """Block until every slot is ready or has failed to start (used before the first request)."""
        end = time.monotonic() + deadline_s
        while any(s.phase == "start" for s in self.slots) and time.monotonic() < end:
            refs = {s.start_ref: s for s in self.slots if s.phase == "start"}
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=min(1.0, max(0.0, end - time.monotonic())))
            for ref in ready:
                self._started(refs[ref])
            now = time.monotonic()
            for slot in self.slots:
                if slot.phase == "start" and now > slot.start_deadline:
                    self._start_failed(slot, f"not ready within {self.opt.start_deadline_s}s")

    def describe(self) -> list[dict]:
        """Each slot: where it is, its phase, its jobs in flight."""
        out = []
        for s in self.slots:
            info = (s.info or {}) if s.phase == "ready" else {}
            out.append({"index": s.index, "phase": s.phase, "generation": s.generation, "name": info.get("name"),
                        "pid": info.get("pid"), "device": info.get("device"), "lanes": info.get("lanes"),
                        "inflight": len(s.inflight)})
        return out

