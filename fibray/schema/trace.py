"""Evaluation and Trace: the verdict on one (solution, workload) and its immutable record.

Status values are FlashInfer Trace's seven; ``reason`` refines a failure without
adding statuses, so flashinfer-bench reads fibray's traces.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Optional

from pydantic import Field, field_validator, model_validator

from fibray.schema._base import Model, NonEmptyString
from fibray.schema.workload import Workload


class EvaluationStatus(str, Enum):
    """Outcome of one evaluation."""

    PASSED = "PASSED"
    INCORRECT_SHAPE = "INCORRECT_SHAPE"
    INCORRECT_NUMERICAL = "INCORRECT_NUMERICAL"
    INCORRECT_DTYPE = "INCORRECT_DTYPE"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    COMPILE_ERROR = "COMPILE_ERROR"
    TIMEOUT = "TIMEOUT"


class Correctness(Model):
    """Error metrics against the reference."""

    max_relative_error: float = 0.0
    """Largest |y-ref|/(|ref|+eps) over all outputs and trials; NaN/inf if non-finite."""
    max_absolute_error: float = 0.0
    """Largest |y-ref| over all outputs and trials; NaN/inf if non-finite."""
    extra: Optional[dict[str, Any]] = None
    """Checker-specific metrics (matched_ratio, tvd, ...)."""

    @field_validator("max_relative_error", "max_absolute_error")
    @classmethod
    def _validate_error(cls, v: float) -> float:
        if not math.isnan(v) and v < 0:
            raise ValueError(f"must be non-negative or NaN, got {v}")
        return v


class Performance(Model):
    """Latency of the solution and the reference on the same inputs and device."""

    latency_ms: float = Field(default=0.0, ge=0.0)
    """Median solution latency, ms."""
    reference_latency_ms: float = Field(default=0.0, ge=0.0)
    """Median reference latency, ms."""
    speedup_factor: float = Field(default=0.0, ge=0.0)
    """reference_latency_ms / latency_ms."""
    latency_p95_ms: Optional[float] = None
    """95th percentile solution latency, ms (fibray extension)."""
    latency_mean_ms: Optional[float] = None
    """Mean solution latency, ms (fibray extension)."""
    latency_cv: Optional[float] = None
    """Coefficient of variation of solution latency, stdev/mean (fibray extension)."""
    n_samples: Optional[int] = None
    """Number of timed iterations behind the statistics (fibray extension)."""
    timing_mode: Optional[str] = None
    """wall_clock (CPU), stream_events, or device_sync when work escaped the current stream (fibray extension)."""
    reference_latency_source: Optional[str] = None
    """measured (timed for this job's workload by its slot) or reused (an earlier row's, same definition,
    workload, environment and timing settings) (fibray extension)."""
    reference_job_id: Optional[str] = None
    """The job whose evaluation timed the reference latency (fibray extension)."""


class Environment(Model):
    """Where an evaluation ran."""

    hardware: NonEmptyString
    """Device name, e.g. 'NVIDIA H200' or 'cpu'."""
    libs: dict[str, str] = Field(default_factory=dict)
    """Library name -> version."""


class Evaluation(Model):
    """The verdict on one solution for one workload."""

    status: EvaluationStatus
    """One of the seven FlashInfer Trace statuses."""
    environment: Environment
    """Hardware and library versions."""
    timestamp: NonEmptyString
    """ISO-8601 time the evaluation finished."""
    log: str = ""
    """Candidate error text, bounded."""
    correctness: Optional[Correctness] = None
    """Present for PASSED and INCORRECT_NUMERICAL."""
    performance: Optional[Performance] = None
    """Present for PASSED only."""
    reason: Optional[str] = None
    """fibray refinement of a failure (crashed, timeout, mutated_inputs, ...)."""

    @model_validator(mode="after")
    def _validate_status_fields(self) -> "Evaluation":
        s = self.status
        needs_correctness = s in (EvaluationStatus.PASSED, EvaluationStatus.INCORRECT_NUMERICAL)
        needs_performance = s == EvaluationStatus.PASSED
        if needs_correctness != (self.correctness is not None):
            raise ValueError(f"correctness: {'required' if needs_correctness else 'not allowed'} when status is {s.value}")
        if needs_performance != (self.performance is not None):
            raise ValueError(f"performance: {'required' if needs_performance else 'not allowed'} when status is {s.value}")
        return self


class Trace(Model):
    """Definition + workload + solution + evaluation; a workload trace has no solution."""

    definition: NonEmptyString
    """Definition name."""
    workload: Workload
    """The workload."""
    solution: Optional[str] = None
    """Solution name; None for a workload-only trace."""
    evaluation: Optional[Evaluation] = None
    """The verdict; None for a workload-only trace."""

    @property
    def is_workload(self) -> bool:
        """True for a workload-only trace."""
        return self.solution is None and self.evaluation is None
