"""The GPU actor: a long-lived Ray actor pinned to one GPU that evaluates jobs.

It keeps its device context, builds and per-workload references warm between jobs.
It never writes to the store; it returns JobResults to the driver, which owns the store.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Optional

import ray

from fibray.schema import Job, JobResult


class GpuWorker:
    """Evaluates jobs on the GPU Ray assigned to it (or on the CPU for a logical GPU)."""

    def __init__(self, name: str, workdir: Optional[str] = None, torch_threads: Optional[int] = None) -> None:
        import torch

        from fibray.build import prepare_triton
        from fibray.evaluate import Evaluator

        prepare_triton()  # before any candidate defines a kernel
        if torch_threads:
            torch.set_num_threads(torch_threads)
        base = Path(workdir) if workdir else Path(tempfile.gettempdir())
        self.workdir = Path(tempfile.mkdtemp(prefix=f"fibray-{name}-", dir=base))
        self.evaluator = Evaluator(self.workdir)
        if self.evaluator.device.type == "cuda":
            torch.zeros(1, device=self.evaluator.device)  # create the context now, not on the first job
        self.name = f"{name}@{socket.gethostname()}:{os.getpid()}"

    def info(self) -> dict:
        """Who and where this worker is."""
        return {"name": self.name, "pid": os.getpid(), "device": str(self.evaluator.device),
                "environment": self.evaluator.env.model_dump(mode="json")}

    def build(self, job: Job) -> Optional[str]:
        """Build the job's solution; the error text if it failed, else None."""
        err = self.evaluator.build(job)
        return None if err is None else str(err)

    def run(self, job: Job, started_at: str) -> JobResult:
        """Evaluate one job."""
        from fibray.evaluate import now_iso

        evaluation = self.evaluator.evaluate(job)
        return JobResult(job_id=job.job_id, evaluation=evaluation, worker=self.name, isolation="persistent",
                         attempt=job.attempt, started_at=started_at, finished_at=now_iso())


RemoteGpuWorker = ray.remote(GpuWorker)
