"""Workload tracing: record the var-axis values and structured inputs of live `@apply` calls.

`trace(out, definitions)` starts a tracer; calls of decorated functions are deduplicated
by policy (per var-axis values; by average lengths for attention) and written, on stop,
as a FlashInfer Trace dataset (definitions, workloads JSONL, safetensors blobs) that a
sweep runs with `dataset.root=out dataset.workload_set=traced`; `mark_replay` marks them as
replay workloads (the splits/ sidecar) for promotion.
"""

from fibray.tracing.policy import (
    AvgLengths,
    DedupPolicy,
    DumpPolicy,
    KeepAll,
    PerAxes,
    make_dedup,
    make_dump,
    register_dedup,
    register_dump,
)
from fibray.tracing.replay import ReplayMarked, mark_replay
from fibray.tracing.tracer import TracePolicy, Tracer, TracingStats, call_axes, default_policy, trace
from fibray.tracing.writer import TracedCall, TracingError, write_calls

__all__ = [
    "AvgLengths", "DedupPolicy", "DumpPolicy", "KeepAll", "PerAxes", "ReplayMarked", "TracePolicy", "TracedCall", "Tracer",
    "TracingError", "TracingStats", "call_axes", "default_policy", "make_dedup", "make_dump", "mark_replay", "register_dedup",
    "register_dump", "trace", "write_calls",
]
