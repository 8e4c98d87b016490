"""Contracts: Definition, Workload, Solution, Evaluation, Trace (FlashInfer Trace compatible).

This package imports nothing else from fibray.
"""

from fibray.schema.definition import AxisConst, AxisVar, CheckSpec, Definition, DType, RandomInputSpec, TensorSpec
from fibray.schema.job import EvalSettings, Job, JobResult, content_hash
from fibray.schema.reasons import Reason
from fibray.schema.split import Split
from fibray.schema.solution import BuildSpec, Language, Solution, SourceFile
from fibray.schema.trace import (
    Correctness,
    Environment,
    Evaluation,
    EvaluationStatus,
    Performance,
    Trace,
)
from fibray.schema.workload import InputSpec, RandomInput, SafetensorsInput, ScalarInput, Workload

__all__ = [
    "AxisConst", "AxisVar", "BuildSpec", "CheckSpec", "Correctness", "DType", "Definition", "RandomInputSpec",
    "Environment", "EvalSettings", "Evaluation", "Job", "JobResult", "content_hash", "EvaluationStatus", "InputSpec", "Language", "Performance",
    "RandomInput", "Reason", "SafetensorsInput", "ScalarInput", "Solution", "SourceFile", "Split", "TensorSpec",
    "Trace", "Workload",
]
