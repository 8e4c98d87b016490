"""A sweep's jobs run on a running service instead of private slots: the same interface as the
sweep's WorkerPool (run, first_dispatch, slot_stats, shutdown), so the driver, its store writer,
its ledger and its resume stay as they are. The service answers; the driver records.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Any, Callable, Optional

from fibray.schema import Job, JobResult
from fibray.serve.state import ServiceError, find_coordinator

log = logging.getLogger(__name__)

_CALL_DEADLINE_S = 60.0
_BATCH = 256
"""Most jobs sent in one submission call (the rest follow as the queue makes room)."""


class ServiceRunner:
    """Runs a sweep's jobs on the service's slots; calls on_result(job, result) once per job."""

    def __init__(self, coordinator: Any, name: str, status: dict, joined: bool = False) -> None:
        self.coordinator, self.name = coordinator, name
        self.joined = joined
        """Whether finding the service connected this process to its cluster (the driver disconnects after)."""
        self.num_slots = sum(1 for s in status["slots"] if s["phase"] == "ready") or len(status["slots"])
        self.lanes = status["lanes"]
        self.first_dispatch: Optional[float] = None

    def run(self, jobs: list[Job], on_result: Callable[[Job, JobResult], None]) -> None:
        import ray
        from ray.exceptions import RayActorError

        client = f"sweep:{jobs[0].sweep if jobs else '?'}:{socket.gethostname()}:{os.getpid()}"
        rest, waiting, pause = list(jobs), {}, 0.02
        while rest or waiting:
            if rest:
                answer = ray.get(self.coordinator.submit.remote(client, rest[:_BATCH]), timeout=_CALL_DEADLINE_S)
                if answer["tickets"] and self.first_dispatch is None:
                    self.first_dispatch = time.monotonic()
                for ticket, job in zip(answer["tickets"], rest):
                    waiting[self.coordinator.result.remote(ticket)] = job
                rest = rest[len(answer["tickets"]):]
                pause = 0.02 if answer["tickets"] else min(0.5, pause * 2)
            if not waiting:
                time.sleep(pause)
                continue
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=pause if rest else 5.0)
            if ready:
                others = [r for r in waiting if r not in ready]
                ready += ray.wait(others, num_returns=len(others), timeout=0)[0] if others else []
            for ref in ready:
                job = waiting.pop(ref)
                try:
                    result = ray.get(ref)
                except RayActorError as e:
                    raise ServiceError(f"service {self.name!r} was lost during the sweep ({type(e).__name__}); "
                                       "run the sweep again to resume it") from None
                on_result(job, result)

    def slot_stats(self) -> list[dict]:
        import ray

        return ray.get(self.coordinator.slot_stats.remote(), timeout=_CALL_DEADLINE_S)

    def shutdown(self) -> None:
        """The service's slots are not the sweep's: they stay."""


def attach_service(name: Optional[str], address: Optional[str], state_dir: Optional[str],
                   log_to_driver: bool = False) -> Optional[ServiceRunner]:
    """A runner on the service `name` if one is running where this sweep would run, else None
    (the sweep starts private slots). Costs nothing when no service could be there."""
    if not name:
        return None
    connected = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    coordinator = find_coordinator(name, address, state_dir, log_to_driver)  # before Ray is imported: it may set its auth
    if coordinator is None:
        return None
    import ray

    status = ray.get(coordinator.status.remote(), timeout=_CALL_DEADLINE_S)
    if not any(s["phase"] == "ready" for s in status["slots"]):
        log.warning("service %r has no ready slot; the sweep starts its own", name)
        return None
    log.info("sweep runs on service %r (%d slot(s), %d lane(s) each)", name, len(status["slots"]), status["lanes"])
    return ServiceRunner(coordinator, name, status, joined=not connected)
