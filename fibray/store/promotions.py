"""The `promotions` table: append-only Parquet under <store.root>/_promotions/, one row per event.

An event is a gate's outcome, a review, a rollout step or a demotion of one artifact (a
solution built one way for one environment). Rows are only ever added, by the store's own
rule (temporary name, fsync, rename); an artifact's stage is that of its latest row. Reads
use pyarrow only, so apply() can read it on a serving host without Polars.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from fibray.schema import content_hash
from fibray.store.writer import StoreError

PROMOTIONS_DIR = "_promotions"
"""Folder of the table under the store root (outside the definition=/sweep= partitions)."""


class Stage(StrEnum):
    """Where an artifact stands on its way to serving traffic (the stage after a row)."""

    CANDIDATE = "candidate"
    """Gates are being run; none has failed yet."""
    VALIDATED = "validated"
    """Every automated gate passed; waits for review."""
    SHADOW = "shadow"
    """Reviewed: runs beside the fallback, is compared, never returns its result."""
    CANARY = "canary"
    """Serves a configured fraction of calls; a sample is compared with the fallback."""
    DEFAULT = "default"
    """Serves every call it is the fastest for."""
    DEMOTED = "demoted"
    """Taken out of serving (runtime failure or by hand); gates must be run again."""
    REJECTED = "rejected"
    """A gate failed."""


SERVING_STAGES = frozenset({Stage.SHADOW, Stage.CANARY, Stage.DEFAULT})
"""Stages apply() may route calls to when it requires promotion."""


class Gate(StrEnum):
    """What a row records."""

    HIDDEN = "hidden"
    """Every hidden workload PASSED (a sweep on the hidden split)."""
    MEMCHECK = "memcheck"
    """compute-sanitizer memcheck clean on every workload."""
    RACECHECK = "racecheck"
    """compute-sanitizer racecheck clean on every workload."""
    INITCHECK = "initcheck"
    """compute-sanitizer initcheck clean on every workload."""
    SYNCCHECK = "synccheck"
    """compute-sanitizer synccheck clean on every workload."""
    SMEM_POISON = "smem_poison"
    """Outputs bit-identical whichever pattern fills shared memory before each call, on every workload
    (a read of shared memory the kernel did not write changes them; fibray.promote.smem_poison)."""
    REBENCH = "rebench"
    """Fresh-process re-benchmark median within the sweep's confidence interval on every workload."""
    AUTOMATED = "automated"
    """Summary of the automated gates of one run of `python -m fibray.promote`."""
    REVIEW = "review"
    """A person's approval (`--approve`)."""
    ROLLOUT = "rollout"
    """A step shadow -> canary -> default (`--stage`)."""
    RUNTIME = "runtime"
    """apply() demoted it while serving (exception, NaN/Inf, mismatch, P99 latency)."""


class Outcome(StrEnum):
    """A gate's verdict."""

    PASSED = "passed"
    """It ran and found nothing wrong."""
    FAILED = "failed"
    """It ran and found something wrong (the reason says what)."""
    NOT_RUN = "not_run"
    """It could not run here (no GPU, no working sanitizer, no hidden workloads): never a pass."""


SANITIZER_GATES = (Gate.MEMCHECK, Gate.RACECHECK, Gate.INITCHECK, Gate.SYNCCHECK)
"""The compute-sanitizer tools, one gate each."""
AUTOMATED_GATES = (Gate.HIDDEN, *SANITIZER_GATES, Gate.SMEM_POISON, Gate.REBENCH)
"""The gates `python -m fibray.promote` runs, in order; an artifact is validated only when all passed."""

SCHEMA = pa.schema([
    ("artifact_id", pa.string()),        # artifact_id(solution_hash, recipe_hash, environment_key)
    ("definition", pa.string()),
    ("solution", pa.string()),
    ("solution_hash", pa.string()),
    ("recipe_hash", pa.string()),        # build recipe: the toolchain fingerprint of its language
    ("environment_key", pa.string()),
    ("environment", pa.string()),        # JSON: hardware, driver, cuda, torch, triton
    ("stage", pa.string()),              # Stage after this row
    ("gate", pa.string()),               # Gate
    ("outcome", pa.string()),            # Outcome
    ("passed", pa.bool_()),              # outcome == passed
    ("reason", pa.string()),
    ("evidence", pa.string()),           # JSON: sweep ids, sanitizer reports, re-benchmark statistics
    ("actor", pa.string()),              # who or what wrote the row (user@host, apply@host:pid)
    ("recorded_at", pa.timestamp("us", tz="UTC")),
])


def artifact_id(solution_hash: str, recipe_hash: str, environment_key: str) -> str:
    """An artifact's identity: the solution's content, how it is built, and where it runs."""
    return content_hash("artifact", solution_hash, recipe_hash, environment_key)[:32]


class PromotionRecord(BaseModel):
    """One row of the promotions table."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    artifact_id: str
    """artifact_id(solution_hash, recipe_hash, environment_key)."""
    definition: str
    """Definition name."""
    solution: str
    """Solution name."""
    solution_hash: str
    """Solution content hash."""
    recipe_hash: str
    """Hash of the build recipe (toolchain fingerprint)."""
    environment_key: str
    """Hash of the environment fields."""
    environment: dict[str, Optional[str]]
    """hardware, driver, cuda, torch, triton."""
    stage: Stage
    """The artifact's stage after this row."""
    gate: Gate
    """What this row records."""
    outcome: Outcome
    """The gate's verdict."""
    reason: str = ""
    """Why (a failure's cause, why a gate did not run, a reviewer's note)."""
    evidence: dict[str, Any] = Field(default_factory=dict)
    """Sweep ids, sanitizer reports, re-benchmark statistics."""
    actor: str
    """Who or what wrote the row."""
    recorded_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    """When, UTC."""

    @property
    def passed(self) -> bool:
        return self.outcome is Outcome.PASSED

    def to_row(self) -> dict[str, Any]:
        row = self.model_dump(mode="python")
        row.update(stage=self.stage.value, gate=self.gate.value, outcome=self.outcome.value, passed=self.passed,
                   environment=json.dumps(self.environment, sort_keys=True),
                   evidence=json.dumps(self.evidence, sort_keys=True, default=str))
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> PromotionRecord:
        row = {k: v for k, v in row.items() if k != "passed"}
        row["environment"] = json.loads(row["environment"] or "{}")
        row["evidence"] = json.loads(row["evidence"] or "{}")
        return cls.model_validate(row)


class PromotionLog:
    """The promotions table of one store root: append rows, read them, the latest stage per artifact."""

    def __init__(self, store_root: str | Path) -> None:
        self.folder = Path(store_root) / PROMOTIONS_DIR

    def exists(self) -> bool:
        """Whether any row was ever written."""
        return bool(self.files())

    def files(self) -> list[Path]:
        # names start with a nanosecond stamp, so their order is write order on one clock
        return sorted(self.folder.glob("part-*.parquet")) if self.folder.is_dir() else []

    def append(self, records: list[PromotionRecord]) -> Optional[Path]:
        """Publish the records as one new file (never rewriting one); returns its path."""
        if not records:
            return None
        table = pa.Table.from_pylist([r.to_row() for r in records], schema=SCHEMA)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"store.root: cannot create {self.folder}: {e.strerror}") from None
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.parquet"
        tmp = self.folder / f".{name}.tmp"
        try:
            pq.write_table(table, tmp, compression="zstd")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.folder / name)
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise StoreError(f"store.root: cannot write {self.folder / name}: {e.strerror}") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return self.folder / name

    def read(self) -> list[PromotionRecord]:
        """Every row, in write order."""
        rows: list[PromotionRecord] = []
        for path in self.files():
            rows.extend(PromotionRecord.from_row(r) for r in pq.read_table(path, schema=SCHEMA).to_pylist())
        return rows

    def history(self, artifact: str) -> list[PromotionRecord]:
        """The rows of one artifact, in write order."""
        return [r for r in self.read() if r.artifact_id == artifact]

    def latest(self) -> dict[str, PromotionRecord]:
        """Artifact id -> its latest row (whose stage is the artifact's stage)."""
        out: dict[str, PromotionRecord] = {}
        for r in self.read():
            out[r.artifact_id] = r
        return out

    def stages(self) -> dict[str, Stage]:
        """Artifact id -> its current stage."""
        return {a: r.stage for a, r in self.latest().items()}
