"""No work twice: a reference latency the store already holds is passed with the job, not timed again.

A reference's latency depends on the definition (its reference code), the workload, the
environment (GPU model, library versions) and the timing settings; it is reused when an earlier row
of the store matches on all of them. Read with pyarrow only (the GPU host has no polars).
"""

from __future__ import annotations

import json
from typing import Optional

from fibray.schema import Job
from fibray.schema.job import KnownReference, environment_key

TIMING_KEYS = ("warmup", "iterations", "trials", "flush_l2", "sync_device", "timing", "input_distribution", "seed")
"""The evaluation settings a reference's latency depends on (its timed calls and its inputs' shapes and values)."""

_COLUMNS = ["definition", "workload_uuid", "dataset_hash", "settings", "hardware", "libs", "status",
            "reference_latency_ms", "reference_latency_source", "reference_job_id", "job_id"]


def _timing(settings: dict) -> str:
    return json.dumps({k: settings.get(k) for k in TIMING_KEYS}, sort_keys=True)


def known_references(store, jobs: list[Job], dataset_hash: Optional[str]) -> list[Job]:
    """`jobs`, each with the reference latencies earlier rows measured for its definition, workload
    and timing settings on the same dataset (one per environment; the slot takes its own)."""
    if dataset_hash is None or not jobs or not any(j.settings.time_reference for j in jobs):
        return jobs
    table = store.read(columns=_COLUMNS)
    if table.num_rows == 0:
        return jobs
    wanted = {(j.definition.name, j.workload.uuid) for j in jobs}
    found: dict[tuple, dict[str, KnownReference]] = {}
    for row in table.to_pylist():
        ms = row["reference_latency_ms"]
        if (row["status"] != "PASSED" or not ms or ms <= 0 or row["dataset_hash"] != dataset_hash
                or (row["definition"], row["workload_uuid"]) not in wanted):
            continue
        try:
            settings, libs = json.loads(row["settings"] or "{}"), json.loads(row["libs"] or "{}")
        except ValueError:
            continue
        key = (row["definition"], row["workload_uuid"], _timing(settings))
        env = environment_key(row["hardware"] or "", libs)
        source = row["job_id"] if row["reference_latency_source"] != "reused" else (row["reference_job_id"] or row["job_id"])
        found.setdefault(key, {}).setdefault(env, KnownReference(latency_ms=float(ms), job_id=source))
    out = []
    for j in jobs:
        known = found.get((j.definition.name, j.workload.uuid, _timing(j.settings.model_dump(mode="json"))))
        out.append(j.model_copy(update={"known_references": known}) if known else j)
    return out
