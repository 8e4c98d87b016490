"""Where the agent loop's candidates are evaluated: a small Protocol and the warm worker pool behind it.

The loop submits jobs (solutions x workloads) and gets one JobResult per job. `PoolBackend` keeps
ONE WorkerPool with warm slots for the whole loop instead of a sweep per round; the service client
(fibray.client) can be plugged in behind the same Protocol. A backend never writes the store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

from fibray import deadlines
from fibray.schema import Job, JobResult

if TYPE_CHECKING:
    from fibray.evolve.config import EvolveConfig
    from fibray.sweep.config import SweepConfig

__all__ = ["EvalBackend", "PoolBackend"]

log = logging.getLogger(__name__)
HEARTBEAT_S = 30.0
"""A batch running longer than this logs how far it is, and then each job that ends."""


class EvalBackend(Protocol):
    """Evaluates jobs; every job submitted gets exactly one result."""

    def evaluate(self, jobs: Sequence[Job]) -> dict[str, JobResult]:
        """Run the jobs to results, keyed by job id."""
        ...

    def close(self) -> None:
        """Give back what the backend holds (slots, a Ray it started)."""
        ...


class PoolBackend:
    """A WorkerPool on local or joined Ray, started on first use and kept warm between rounds."""

    def __init__(self, cfg: Union[EvolveConfig, SweepConfig]) -> None:
        self.cfg = cfg  # its cluster, runner, store and eval sections
        self._pool = None
        self._started_ray = False
        self._build_cache: Optional[str] = None
        self.slots = 0

    def _start(self) -> None:
        import ray

        from fibray.sweep.driver import init_ray, pool_options
        from fibray.sweep.pool import WorkerPool
        from fibray.workers.process.sandbox import world_executable

        self.slots, self._started_ray = init_ray(self.cfg, verbose=False)
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        cache = Path(self.cfg.store.root).resolve() / "_builds"
        cache.mkdir(parents=True, exist_ok=True)
        self._build_cache = str(cache) if world_executable(str(cache.parent)) else None
        self._pool = WorkerPool(pool_options(self.cfg, self.slots, cpus, self._build_cache))

    def _compile_ahead(self, jobs: Sequence[Job]) -> None:
        """CUDA/C++ candidates compile in CPU Ray tasks into the shared cache before a GPU sees them."""
        import ray

        from fibray.compile.cache import compile_ahead
        from fibray.workers.process.compile_jail import compile_jail

        solutions = {j.solution.hash: j.solution for j in jobs if j.solution.spec.language.value in ("cuda", "cpp")}
        if not solutions or self._build_cache is None:
            return
        deadline = self.cfg.eval.build_deadline_s
        task = ray.remote(num_cpus=1)(compile_ahead)
        jail = compile_jail(self.cfg.runner.drop_privileges, self.cfg.runner.uid_range)
        refs = [task.remote(s, self._build_cache, deadline, jail) for s in solutions.values()]
        ray.wait(refs, num_returns=len(refs), timeout=deadline + deadlines.COMPILE_AHEAD_GRACE_S)

    def evaluate(self, jobs: Sequence[Job]) -> dict[str, JobResult]:
        if not jobs:
            return {}
        if self._pool is None:
            self._start()
        self._compile_ahead(jobs)
        results: dict[str, JobResult] = {}
        t0 = time.monotonic()

        def on_result(job: Job, result: JobResult) -> None:
            results.setdefault(job.job_id, result)
            if time.monotonic() - t0 > HEARTBEAT_S:  # a slow batch: say what ends, and how long it took
                ev = result.evaluation
                log.info("%d/%d jobs: %s on %s: %s %s, %s (%.0fs into the batch)", len(results), len(jobs),
                         job.solution.name, job.workload.uuid[:8], ev.status.value, ev.reason or "", result.isolation,
                         time.monotonic() - t0)

        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(HEARTBEAT_S):
                log.info("%d/%d jobs of this batch done after %.0fs", len(results), len(jobs), time.monotonic() - t0)

        beat = threading.Thread(target=heartbeat, name="fibray-evolve-heartbeat", daemon=True)
        beat.start()
        try:
            self._pool.run(list(jobs), on_result)
        finally:
            done.set()
        return results

    def close(self) -> None:
        if self._pool is not None:
            try:
                self._pool.shutdown()
            finally:
                self._pool = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
