"""Job and JobResult: what the sweep driver sends to a worker and what comes back.

A job's id is a content hash of its definition, workload, solution and evaluation
settings, so the trace store can serve as the ledger of what is already done.
"""

from __future__ import annotations

import hashlib
import json
import hmac
from typing import Literal, Optional

from pydantic import ConfigDict, Field

from fibray.schema._base import Model
from fibray.schema.definition import Definition
from fibray.schema.solution import Solution
from fibray.schema.split import Split
from fibray.schema.trace import Evaluation
from fibray.schema.workload import Workload


class EvalSettings(Model):
    """Evaluation settings that change a verdict (part of a job's identity)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup: int = Field(default=3, ge=0)
    """Untimed calls before timing."""
    iterations: int = Field(default=20, ge=1)
    """Timed calls per trial."""
    trials: int = Field(default=3, ge=1)
    """Independent input sets; each is checked and then timed."""
    atol: float = Field(default=1e-2, ge=0)
    """Absolute tolerance, unless the definition's check sets one."""
    rtol: float = Field(default=1e-2, ge=0)
    """Relative tolerance, unless the definition's check sets one."""
    matched_ratio: Optional[float] = Field(default=None, gt=0, le=1)
    """Required fraction within tolerance for matched_ratio checks, unless the definition sets one."""
    seed: int = Field(default=0, ge=0)
    """Base seed of random inputs; each workload and trial derives its own."""
    flush_l2: bool = True
    """Flush the GPU L2 cache before each timed call."""
    sync_device: bool = True
    """Synchronise the whole device before the end timing mark (counts side-stream work)."""
    time_reference: bool = True
    """Time the reference as well, for speedup."""
    build_deadline_s: float = Field(default=300.0, gt=0)
    """Deadline for building one solution, seconds."""
    run_deadline_s: float = Field(default=120.0, gt=0)
    """Deadline for one evaluation once built, seconds."""
    log_limit: int = Field(default=4096, ge=256)
    """Most characters of candidate error text kept in a record."""
    input_distribution: Literal["normal", "outliers", "mixed"] = "normal"
    """Random floating-point inputs: N(0,1); N(0,1) with a fraction scaled into outliers (see
    Definition.random_inputs); or mixed (even trials normal, odd trials outliers)."""
    timing: Literal["fixed", "adaptive"] = "fixed"
    """fixed: iterations timed calls per input set; adaptive: stop early once the mean's standard
    error is below 1% of it (the row's timing_mode ends in +adaptive: never compare it unawares)."""


_ID_OMITTED_AT_DEFAULT = {"input_distribution": "normal", "timing": "fixed"}
"""Settings added after job ids were first recorded: left out of the id at their default, so
that a sweep recorded before them resumes with the same ids."""


def settings_for_id(dumped: dict) -> dict:
    """The part of dumped settings (as a store row's `settings` holds them) that a job id hashes."""
    return {k: v for k, v in dumped.items() if _ID_OMITTED_AT_DEFAULT.get(k, object()) != v}


def content_hash(*parts: object) -> str:
    """sha256 hex of a canonical JSON encoding of the parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class KnownReference(Model):
    """A reference latency an earlier row of the store measured (fibray.sweep.reuse)."""

    latency_ms: float = Field(gt=0.0)
    """Its median, ms."""
    job_id: str
    """The job whose evaluation timed it."""


def environment_key(hardware: str, libs: dict[str, str]) -> str:
    """Where a latency holds: the device model and every library version (a row's `hardware` and `libs`)."""
    return json.dumps([hardware, libs], sort_keys=True)


class Job(Model):
    """One evaluation to run: a solution on a workload of a definition."""

    job_id: str
    """Content hash of definition, workload, solution and settings."""
    sweep: str
    """Sweep name."""
    definition: Definition
    """The definition."""
    workload: Workload
    """The workload."""
    solution: Solution
    """The candidate."""
    settings: EvalSettings
    """Evaluation settings."""
    dataset_root: str
    """Dataset root, for safetensors paths."""
    attempt: int = 1
    """1 for the first try; higher when re-run after a lost worker."""
    input_key: Optional[str] = None
    """HMAC of the sweep's secret salt and this workload (set by the driver, never part of the id):
    random inputs are drawn from it, so no candidate can know them before they arrive."""
    split: Split = Split.PUBLIC
    """The workload's split in its dataset (not part of the job's identity)."""
    known_references: Optional[dict[str, KnownReference]] = None
    """Reference latencies the store already holds for this definition, workload and timing settings,
    by `environment_key` (set by the driver, never part of the id): a slot of a matching environment
    reuses its own instead of timing the reference again."""

    @staticmethod
    def make_id(definition: Definition, workload: Workload, solution: Solution, settings: EvalSettings) -> str:
        """The content-hash id of a job."""
        return content_hash(definition.to_json_dict(), workload.to_json_dict(), solution.name, solution.hash,
                            settings_for_id(settings.model_dump(mode="json")))

    def salted(self, salt: bytes) -> "Job":
        """This job with the input key of `salt` (the sweep's secret) for its workload."""
        return self.model_copy(update={"input_key": input_key(salt, self.workload.uuid)})


def input_key(salt: bytes, workload_uuid: str) -> str:
    """The per-workload key random inputs are drawn from: the salt itself never leaves the driver."""
    return hmac.new(salt, workload_uuid.encode(), hashlib.sha256).hexdigest()


class JobResult(Model):
    """A finished job: the evaluation plus how and where it ran."""

    job_id: str
    """Id of the job."""
    evaluation: Evaluation
    """The verdict."""
    worker: str
    """Worker that produced it (actor name / pid)."""
    isolation: str = "persistent"
    """persistent (long-lived actor) or isolated (fresh process)."""
    attempt: int = 1
    """Attempt number."""
    started_at: str
    """ISO-8601 start time."""
    finished_at: str
    """ISO-8601 end time."""
    escalated: bool = False
    """True when a fault in a persistent executor sent the job to a fresh process."""
    network_isolated: Optional[bool] = None
    """Whether the candidate ran without network (Linux network namespace)."""
    privileges_dropped: Optional[bool] = None
    """Whether the candidate ran as an unprivileged user."""
    checks: Optional[str] = None
    """Where the job's memory was verified: supervisor (memory it owns, shared with the executor) or
    executor (copies the executor staged through host memory: runner.executor_checks on a GPU without CUDA VMM)."""
    phases: dict[str, float] = {}
    """Seconds spent per phase of the job (build, inputs_reference, trials, check, timing, ...)."""
