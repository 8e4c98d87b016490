"""The trace store's row: one evaluation, flat, with its Arrow schema.

Partition columns (definition, sweep) live in the directory names, not in the files.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow as pa

from fibray.schema import Evaluation, Job, JobResult
from fibray.schema.reasons import Reason

PARTITION_COLUMNS = ("definition", "sweep")

SCHEMA = pa.schema([
    ("job_id", pa.string()),
    ("op_type", pa.string()),
    ("workload_uuid", pa.string()),
    ("split", pa.string()),             # public | hidden | replay (the dataset's splits/ sidecar)
    ("axes", pa.string()),              # JSON object: var-axis name -> value
    ("workload", pa.string()),          # JSON of the full FlashInfer Trace workload
    ("solution", pa.string()),
    ("solution_hash", pa.string()),
    ("author", pa.string()),
    ("language", pa.string()),
    ("status", pa.string()),
    ("reason", pa.string()),
    ("log", pa.string()),
    ("max_abs_error", pa.float64()),
    ("max_rel_error", pa.float64()),
    ("matched_ratio", pa.float64()),
    ("correctness_extra", pa.string()),  # JSON
    ("latency_ms", pa.float64()),        # median
    ("latency_p95_ms", pa.float64()),
    ("latency_mean_ms", pa.float64()),
    ("latency_cv", pa.float64()),
    ("n_samples", pa.int64()),
    ("timing_mode", pa.string()),        # wall_clock | stream_events | device_sync
    ("reference_latency_ms", pa.float64()),
    ("speedup", pa.float64()),
    ("hardware", pa.string()),
    ("libs", pa.string()),               # JSON: library -> version
    ("torch_version", pa.string()),
    ("triton_version", pa.string()),
    ("cuda_version", pa.string()),
    ("python_version", pa.string()),
    ("fibray_version", pa.string()),
    ("settings", pa.string()),           # JSON of the evaluation settings
    ("worker", pa.string()),
    ("isolation", pa.string()),
    ("attempt", pa.int64()),
    ("escalated", pa.bool_()),           # re-run in a fresh process after a fault
    ("network_isolated", pa.bool_()),    # candidate ran without network
    ("privileges_dropped", pa.bool_()),  # candidate ran as an unprivileged user
    ("checks", pa.string()),             # supervisor | executor: where outputs, inputs and guards were verified
    ("started_at", pa.timestamp("us", tz="UTC")),
    ("finished_at", pa.timestamp("us", tz="UTC")),
    ("evaluation_timestamp", pa.string()),
    # agent loop (fibray.evolve); null for sweeps
    ("round", pa.int64()),               # the loop's round that proposed the solution (1..R)
    ("parent", pa.string()),             # name of the solution it was derived from
    ("generator", pa.string()),          # what proposed it: search, shell:<cmd>, callable:<module:function>
    ("run_id", pa.string()),             # the loop's run (also its sweep partition)
    ("dataset_name", pa.string()),       # the dataset's root folder name (null in rows older than the column)
    ("dataset_hash", pa.string()),       # sha256 of the dataset's definitions and workloads (fibray.dataset)
    ("environment_limited", pa.bool_()), # could not run here (no GPU, interpreted Triton): not charged to the author
    ("reference_latency_source", pa.string()),  # measured | reused (an earlier row's: fibray.sweep.reuse)
    ("reference_job_id", pa.string()),   # the job whose evaluation timed the reference latency
])

LOOP_COLUMNS = ("round", "parent", "generator", "run_id")
"""The agent loop's columns: to_row takes their values as `loop`; every other writer leaves them null."""

COLUMNS = [*PARTITION_COLUMNS, *SCHEMA.names]

TIMING_MODES = {"wall_clock": "wall clock", "stream_events": "CUDA events on the stream",
                "device_sync": "CUDA events, device synchronised"}
"""timing_mode column value -> what it means (summary and report say it in these words)."""
TIMING_VARIANTS = {"host_bound": "host-bound: latency from the supervisor's clock"}
"""A timing_mode's "+variant" -> its words, where they differ from its name (fibray.timing.bound.host_bound_timing)."""


def describe_timing_mode(mode: str) -> str:
    """A timing_mode value in words: 'wall clock', 'CUDA events on the stream (adaptive)', ..."""
    base, _, variants = mode.partition("+")
    words = ", ".join(TIMING_VARIANTS.get(v, v) for v in variants.split("+") if v)
    return TIMING_MODES.get(base, base) + (f" ({words})" if words else "")


def environment_limited(evaluation: Evaluation, language: str) -> bool:
    """True when the verdict says what this machine cannot do, not what the candidate did.

    A CUDA/C++ candidate on a machine without a GPU (`device_required`), and a Triton kernel that
    ran out of its run deadline under the CPU interpreter (which runs kernels 100-10000x slower
    than a GPU), could not be judged here. The status stays as recorded; analysis sets them apart.
    """
    if evaluation.reason == Reason.DEVICE_REQUIRED:
        return True
    on_cpu = evaluation.environment.hardware.startswith("cpu")
    return (on_cpu and language == "triton" and evaluation.status.value == "TIMEOUT"
            and evaluation.reason == Reason.RUN_TIMEOUT)


def to_row(job: Job, result: JobResult, loop: Optional[dict[str, Any]] = None, dataset_name: Optional[str] = None,
           dataset_hash: Optional[str] = None) -> dict[str, Any]:
    """Flatten a finished job into one store row (partition columns included); `loop` fills LOOP_COLUMNS."""
    from datetime import datetime

    ev = result.evaluation
    corr, perf, libs = ev.correctness, ev.performance, ev.environment.libs
    extra = (corr.extra or {}) if corr else {}
    return {
        "definition": job.definition.name,
        "sweep": job.sweep,
        "job_id": job.job_id,
        "op_type": job.definition.op_type,
        "workload_uuid": job.workload.uuid,
        "split": job.split.value,
        "axes": json.dumps(job.workload.axes, sort_keys=True),
        "workload": json.dumps(job.workload.to_json_dict(), sort_keys=True),
        "solution": job.solution.name,
        "solution_hash": job.solution.hash,
        "author": job.solution.author,
        "language": job.solution.spec.language.value,
        "status": ev.status.value,
        "reason": ev.reason,
        "log": ev.log,
        "max_abs_error": corr.max_absolute_error if corr else None,
        "max_rel_error": corr.max_relative_error if corr else None,
        "matched_ratio": extra.get("matched_ratio"),
        "correctness_extra": json.dumps(extra, sort_keys=True) if extra else None,
        "latency_ms": perf.latency_ms if perf else None,
        "latency_p95_ms": perf.latency_p95_ms if perf else None,
        "latency_mean_ms": perf.latency_mean_ms if perf else None,
        "latency_cv": perf.latency_cv if perf else None,
        "n_samples": perf.n_samples if perf else None,
        "timing_mode": perf.timing_mode if perf else None,
        "reference_latency_ms": perf.reference_latency_ms if perf else None,
        "speedup": perf.speedup_factor if perf else None,
        "hardware": ev.environment.hardware,
        "libs": json.dumps(libs, sort_keys=True),
        "torch_version": libs.get("torch"),
        "triton_version": libs.get("triton"),
        "cuda_version": libs.get("cuda"),
        "python_version": libs.get("python"),
        "fibray_version": libs.get("fibray"),
        "settings": json.dumps(job.settings.model_dump(mode="json"), sort_keys=True),
        "worker": result.worker,
        "isolation": result.isolation,
        "attempt": result.attempt,
        "escalated": result.escalated,
        "network_isolated": result.network_isolated,
        "privileges_dropped": result.privileges_dropped,
        "checks": result.checks,
        "started_at": datetime.fromisoformat(result.started_at),
        "finished_at": datetime.fromisoformat(result.finished_at),
        "evaluation_timestamp": ev.timestamp,
        **{c: (loop or {}).get(c) for c in LOOP_COLUMNS},
        "dataset_name": dataset_name,
        "dataset_hash": dataset_hash,
        "environment_limited": environment_limited(ev, job.solution.spec.language.value),
        "reference_latency_source": perf.reference_latency_source if perf else None,
        "reference_job_id": perf.reference_job_id if perf else None,
    }
