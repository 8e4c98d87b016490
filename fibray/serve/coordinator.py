"""The service's coordinator: a detached Ray actor that owns the queue, dispatches jobs to the
service's slots and answers each submitted job once; it writes client sweeps' records (one writer
per sweep), never runs candidate code, and never blocks its event loop on a slot."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import ray

from fibray.schema import Job, JobResult
from fibray.serve.config import ServeConfig
from fibray.sweep.service import NAMESPACE
from fibray.serve.scheduler import FairQueue, ServicePool
from fibray.serve.writer import SweepWriter
from fibray.store import StoreError
from fibray.sweep.driver import pool_options

log = logging.getLogger(__name__)

_BUSY_POLL_S = 0.02
"""While jobs are in flight the dispatch loop looks for new submissions this often (round latency)."""
_IDLE_WAIT_S = 0.5
"""With nothing in flight it sleeps until a submission wakes it, or this long."""
_THROUGHPUT_WINDOW_S = 60.0


class ServiceStopped(RuntimeError):
    """The service was stopped before this job's verdict came."""


@dataclass
class _Pending:
    """A job queued or running, and the tickets waiting for it."""

    job: Job
    client: str
    writer: Optional[SweepWriter]
    tickets: list[int] = field(default_factory=list)


@dataclass
class _Ticket:
    key: tuple[str, str]
    client: str
    result: Optional[JobResult] = None
    done_at: float = 0.0
    waiters: list[asyncio.Future] = field(default_factory=list)


class Coordinator:
    """The `service` actor: queue, dispatch, answers, client sweeps' writers."""

    def __init__(self, raw: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.cfg = cfg = ServeConfig.model_validate(raw)
        s = cfg.service
        self._kill_stale_slots(f"{s.name}-gpu")
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < 1:
            raise RuntimeError("cluster: the Ray cluster has no GPU resources (declare cluster.num_gpus)")
        slots = min(gpus, cfg.cluster.num_gpus) if cfg.cluster.num_gpus else gpus
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        self.queue = FairQueue(s.max_queue, s.max_queue_per_client)
        self._lock = threading.RLock()  # pending, tickets, writers, counters: the loop thread and the event loop
        self.pending: dict[tuple[str, str], _Pending] = {}
        self.tickets: dict[int, _Ticket] = {}
        self.writers: dict[tuple[str, str], SweepWriter] = {}
        self.counters = {"submitted": 0, "answered": 0, "deduplicated": 0, "from_store": 0, "refused": 0,
                         "late_answers": 0, "loop_errors": 0}
        self.clients: dict[str, float] = {}
        self._done: deque[float] = deque()
        self._ids = itertools.count(1)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.started = time.time()
        options = replace(pool_options(cfg, slots, cpus, None),  # the runner section means what it means for sweeps
                          actor_prefix=f"{s.name}-", namespace=NAMESPACE)
        self.pool = ServicePool(options, self.queue, self._client_of, s.restore_interval_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.pool.start()
        self._thread = threading.Thread(target=self._serve, name="fibray-dispatch", daemon=True)
        self._thread.start()

    @staticmethod
    def _kill_stale_slots(prefix: str) -> None:
        """Slots of an earlier coordinator of this name (it died): their jobs died with it."""
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == NAMESPACE and a["name"].startswith(prefix):
                try:
                    ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)
                except ValueError:
                    pass

    # -- the dispatch loop (its own thread) -------------------------------------------------
    def _serve(self) -> None:
        last_chores = 0.0
        while not self._stop.is_set():
            try:
                busy = self.pool.step(self._on_result, _BUSY_POLL_S)
                if not busy and not len(self.queue):
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                elif not busy:
                    time.sleep(_BUSY_POLL_S)  # jobs queued but no slot ready yet
                now = time.monotonic()
                if now - last_chores > 0.25:
                    last_chores = now
                    self._chores(now)
            except Exception:  # noqa: BLE001 - the service outlives one bad iteration; it is logged and counted
                log.exception("dispatch loop error")
                with self._lock:
                    self.counters["loop_errors"] += 1
                time.sleep(0.5)

    def _client_of(self, job: Job) -> str:
        with self._lock:
            p = self.pending.get((job.sweep, job.job_id))
            return p.client if p is not None else "?"

    def _on_result(self, job: Job, result: JobResult) -> None:
        with self._lock:
            p = self.pending.pop((job.sweep, job.job_id), None)
            if p is None:  # already answered: a job is answered once
                self.counters["late_answers"] += 1
                return
            if p.writer is not None:
                p.writer.add(job, result)
                p.writer.pending -= 1
            self.counters["answered"] += 1
            now = time.monotonic()
            self._done.append(now)
            for tid in p.tickets:
                t = self.tickets.get(tid)
                if t is not None:
                    self._resolve(t, result, now)

    def _resolve(self, t: _Ticket, result: JobResult, now: float) -> None:
        t.result, t.done_at = result, now
        waiters, t.waiters = t.waiters, []
        for f in waiters:
            f.get_loop().call_soon_threadsafe(_settle, f, result)

    def _chores(self, now: float) -> None:
        s = self.cfg.service
        with self._lock:
            for key, w in list(self.writers.items()):
                if w.due(now):
                    w.flush()
                if w.pending == 0 and not w.buffer and now - w.last_used > s.writer_idle_s:
                    w.close()  # releases the sweep's store lock: a sweep driver may take it now
                    del self.writers[key]
            for tid, t in list(self.tickets.items()):
                if t.result is not None and now - t.done_at > s.result_ttl_s:
                    del self.tickets[tid]
            while self._done and now - self._done[0] > _THROUGHPUT_WINDOW_S:
                self._done.popleft()

    def _writer(self, root: str, sweep: str) -> SweepWriter:
        from pathlib import Path

        key = (str(Path(root).resolve()), sweep)
        if key not in self.writers:
            s = self.cfg.service
            self.writers[key] = SweepWriter(root, sweep, s.flush_rows, s.flush_interval_s)
        return self.writers[key]

    # -- the actor's API ----------------------------------------------------------------------
    async def submit(self, client: str, jobs: list[Job], store_root: Optional[str] = None,
                     all_or_nothing: bool = False) -> dict[str, Any]:
        """Queue jobs for `client`; returns {"tickets": [...], "refused": why or None}. Tickets come
        for a prefix of `jobs` (all of them unless the queue is full: back-pressure, submit the
        rest later). With `store_root`, the service records the verdicts under each job's sweep."""
        with self._lock:
            self.clients[client] = time.monotonic()
            try:
                writers = {sw: self._writer(store_root, sw) for sw in {j.sweep for j in jobs}} if store_root else {}
            except StoreError as e:
                self.counters["refused"] += len(jobs)
                return {"tickets": [], "refused": f"store: {e}"}
            new = {(j.sweep, j.job_id) for j in jobs} - set(self.pending)
            new = {k for k in new if not (k[0] in writers and k[1] in writers[k[0]].ledger)}
            room = self.queue.room(client)
            if all_or_nothing and len(new) > room:
                self.counters["refused"] += len(jobs)
                return {"tickets": [], "refused": self._full(client, len(new), room)}
            tickets, queued, now = [], [], time.monotonic()
            for job in jobs:
                key, w = (job.sweep, job.job_id), writers.get(job.sweep)
                recorded = w.recorded(job.job_id) if w is not None else None
                fresh = recorded is None and key not in self.pending
                if fresh:
                    if len(queued) >= room:
                        break
                    if w is not None:
                        job = job.salted(w.salt)
                    self.pending[key] = _Pending(job, client, w)
                    queued.append(job)
                    if w is not None:
                        w.pending += 1
                tid = next(self._ids)
                t = self.tickets[tid] = _Ticket(key, client)
                if recorded is not None:
                    self.counters["from_store"] += 1
                    self._resolve(t, recorded, now)
                else:
                    self.counters["deduplicated"] += not fresh
                    self.pending[key].tickets.append(tid)
                tickets.append(tid)
            self.queue.push(client, queued)
            self.counters["submitted"] += len(tickets)
            refused = None if len(tickets) == len(jobs) else self._full(client, len(new), room)
        if queued:
            self._wake.set()
        return {"tickets": tickets, "refused": refused}

    def _full(self, client: str, wanted: int, room: int) -> str:
        return (f"queue full: {len(self.queue)} jobs queued (service.max_queue {self.queue.max_total}), "
                f"{self.queue.depth().get(client, 0)} of them this client's (service.max_queue_per_client "
                f"{self.queue.max_per_client}); {wanted} new job(s) asked, room for {room}")

    async def result(self, ticket: int) -> JobResult:
        """The verdict of a submitted job (waits for it)."""
        with self._lock:
            t = self.tickets.get(ticket)
            if t is None:
                raise KeyError(f"ticket {ticket}: unknown (never issued, or its answer expired after "
                               f"service.result_ttl_s {self.cfg.service.result_ttl_s:g}s)")
            if t.result is not None:
                return t.result
            f = asyncio.get_running_loop().create_future()
            t.waiters.append(f)
        return await f

    async def flush(self) -> int:
        """Publish every buffered record of the client sweeps; returns the rows written so far."""
        with self._lock:
            for w in self.writers.values():
                w.flush()
            return sum(w.rows_written for w in self.writers.values())

    async def ready(self, timeout_s: float) -> dict:
        """Wait until no slot is still starting (or the deadline); returns the status."""
        end = time.monotonic() + timeout_s
        while any(s.phase == "start" for s in self.pool.slots) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        return self.status()

    async def slot_stats(self) -> list[dict]:
        live = [s.actor for s in self.pool.slots if s.actor is not None and s.phase == "ready"]
        return list(await asyncio.gather(*(a.stats.remote() for a in live)))

    def status(self) -> dict:
        """Slots, queue depth, throughput, quarantines, uptime."""
        now = time.monotonic()
        with self._lock:
            window = [t for t in self._done if now - t <= _THROUGHPUT_WINDOW_S]
            span = min(_THROUGHPUT_WINDOW_S, time.time() - self.started)
            quarantined = sorted({(sw, self.pool.names.get(h, h[:12])) for sw, h in self.pool.quarantined})
            return {
                "name": self.cfg.service.name, "uptime_s": time.time() - self.started, "pid": os.getpid(),
                "slots": self.pool.describe(), "lanes": self.pool.lanes(), "isolation": self.cfg.runner.isolation,
                "queue_depth": len(self.queue), "queue_by_client": self.queue.depth(),
                "in_flight": sum(len(s.inflight) for s in self.pool.slots), "pending": len(self.pending),
                "max_queue": self.queue.max_total, "max_queue_per_client": self.queue.max_per_client,
                "throughput_eval_s": len(window) / span if span > 0 else 0.0,
                "quarantined": [{"sweep": sw, "solution": n} for sw, n in quarantined],
                "slot_restarts": self.pool.counters["slot_restarts"], "slot_restores": self.pool.counters["slot_restores"],
                "requeued": self.pool.counters["requeued"], "clients": len(self.clients),
                "writers": sorted(sw for _, sw in self.writers), **self.counters,
            }

    async def stop(self) -> dict:
        """Stop dispatching, end the slots, publish every record; the caller then kills this actor."""
        self._stop.set()
        self._wake.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join, 30)
        await loop.run_in_executor(None, self.pool.shutdown)
        with self._lock:
            for w in self.writers.values():
                w.close()
            self.writers.clear()
            for t in self.tickets.values():
                for f in t.waiters:
                    if not f.done():
                        f.set_exception(ServiceStopped(f"service {self.cfg.service.name!r} stopped before this job's verdict"))
            return self.status()


def _settle(f: asyncio.Future, result: JobResult) -> None:
    if not f.done():
        f.set_result(result)
