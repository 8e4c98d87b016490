"""`fibray.client.Client`: submit solutions to a running service and get concurrent.futures (or asyncio)
futures of their Evaluations; submission blocks while the queue is full, and the service, not this
process, records them under the client's sweep, so a client that leaves still has its jobs recorded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from fibray.client.request import resolve_jobs
from fibray.dataset import Dataset, load_dataset
from fibray.schema import Definition, EvalSettings, Evaluation, Job, JobResult, Solution, Workload
from fibray.sweep.service import ServiceError, find_coordinator

CALL_DEADLINE_S = 60.0
"""Deadline of one submission call to the coordinator."""
_BATCH = 256
"""Most jobs sent in one submission call (the rest follow as the queue makes room)."""


class QueueFull(ServiceError):
    """The service's queue stayed full past the client's submit deadline (jobs admitted before still run)."""


class Client:
    """A connection to the service `service`; records go to `store` under sweep `sweep`."""

    def __init__(self, sweep: str = "client", *, store: str | Path = "fibray-store", service: str = "fibray",
                 address: Optional[str] = None, state_dir: Optional[str] = None,
                 dataset: Optional[str | Path] = None, workload_set: Optional[str] = None,
                 record: bool = True, submit_deadline_s: float = 600.0) -> None:
        self.sweep, self.service = sweep, service
        self.store_root = str(Path(store).resolve()) if record else None
        self.submit_deadline_s = submit_deadline_s
        self._dataset_args = (dataset, workload_set)
        self._dataset: Optional[Dataset] = None
        self.coordinator = find_coordinator(service, address, state_dir)
        if self.coordinator is None:
            raise ServiceError(f"no service named {service!r} is running (python -m fibray.serve service.name={service})")
        self.client_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    @property
    def dataset(self) -> Optional[Dataset]:
        root, workload_set = self._dataset_args
        if self._dataset is None and root is not None:
            self._dataset = load_dataset(root, workload_set=workload_set)
        return self._dataset

    def jobs(self, solution: Solution | dict | str, definition: str | Definition | dict,
             workloads: Optional[Sequence[str | Workload | dict]] = None,
             settings: Optional[EvalSettings | dict] = None, max_workloads: Optional[int] = None) -> list[Job]:
        """The jobs of one solution on the selected workloads (all of the definition's by default)."""
        body: dict[str, Any] = {"solution": solution, "definition": definition, "sweep": self.sweep}
        if workloads is not None:
            body["workloads"] = list(workloads)
        if settings is not None:
            body["settings"] = settings.model_dump(mode="json") if isinstance(settings, EvalSettings) else settings
        if max_workloads is not None:
            body["max_workloads"] = max_workloads
        root = self._dataset_args[0]
        return resolve_jobs(body, sweep=self.sweep, dataset=self.dataset, dataset_root=str(root) if root else None)

    def submit(self, solution: Solution | dict | str, definition: str | Definition | dict,
               workloads: Optional[Sequence[str | Workload | dict]] = None,
               settings: Optional[EvalSettings | dict] = None,
               max_workloads: Optional[int] = None) -> list[concurrent.futures.Future]:
        """Futures of the Evaluation of each selected workload, in order (`future.job_id`,
        `future.workload` say which)."""
        jobs = self.jobs(solution, definition, workloads, settings, max_workloads)
        return [_evaluation_of(f, job) for f, job in zip(self.submit_jobs(jobs), jobs)]

    async def submit_async(self, *args: Any, **kwargs: Any) -> list[asyncio.Future]:
        """`submit` for asyncio code: waits for queue room without blocking the event loop."""
        loop = asyncio.get_running_loop()
        futures = await loop.run_in_executor(None, lambda: self.submit(*args, **kwargs))
        return [asyncio.wrap_future(f, loop=loop) for f in futures]

    def submit_jobs(self, jobs: Sequence[Job]) -> list[concurrent.futures.Future]:
        """Futures of the JobResult of each job; blocks while the service's queue is full."""
        import ray

        futures: list[concurrent.futures.Future] = []
        rest, pause = list(jobs), 0.02
        deadline = time.monotonic() + self.submit_deadline_s
        while rest:
            answer = ray.get(self.coordinator.submit.remote(self.client_id, rest[:_BATCH], self.store_root), timeout=CALL_DEADLINE_S)
            refused = answer["refused"]
            if refused and refused.startswith("store:"):
                raise ServiceError(refused)
            futures += [self.coordinator.result.remote(t).future() for t in answer["tickets"]]
            rest = rest[len(answer["tickets"]):]
            if rest:
                if time.monotonic() > deadline:
                    raise QueueFull(f"{refused}; {len(futures)} job(s) admitted before the client's submit deadline "
                                    f"of {self.submit_deadline_s:g}s, {len(rest)} not")
                time.sleep(pause)
                pause = 0.02 if answer["tickets"] else min(0.5, pause * 2)
        return futures

    def status(self) -> dict:
        import ray

        return ray.get(self.coordinator.status.remote(), timeout=CALL_DEADLINE_S)

    def flush(self) -> None:
        """Publish every record the service holds for client sweeps."""
        import ray

        ray.get(self.coordinator.flush.remote(), timeout=CALL_DEADLINE_S)

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _evaluation_of(f: concurrent.futures.Future, job: Job) -> concurrent.futures.Future:
    out: concurrent.futures.Future = concurrent.futures.Future()
    out.job_id, out.workload = job.job_id, job.workload.uuid  # type: ignore[attr-defined]

    def done(src: concurrent.futures.Future) -> None:
        try:
            result: JobResult = src.result()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's future
            out.set_exception(e)
        else:
            out.set_result(result.evaluation)

    f.add_done_callback(done)
    return out


__all__ = ["Client", "QueueFull", "Evaluation"]
