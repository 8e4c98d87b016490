"""Workload splits: which workloads may feed back to a candidate's author and which only score.

A split is a property of a workload within one dataset, kept beside the FlashInfer Trace
layout (see fibray.dataset.splits), never inside the workload's own JSON.
"""

from __future__ import annotations

from enum import StrEnum


class Split(StrEnum):
    """Where a workload's results may go."""

    PUBLIC = "public"
    """Results feed back (sweep summaries, the agent loop). The default for an unlisted workload."""
    HIDDEN = "hidden"
    """Results are stored and reported (promotion, reports), never fed back to the candidate's author."""
    REPLAY = "replay"
    """Recorded from live calls (fibray.tracing); stored and reported like hidden ones."""
