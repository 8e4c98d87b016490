"""The one catalogue of failure reasons (the refinement of an Evaluation's status).

Groups of reasons that the workers act on are defined here so that every module reads the
same sets.
"""

from __future__ import annotations

POISONING_REASONS = frozenset({"illegal_memory_access", "device_assert", "cuda_error"})
"""A fault after which the executor's CUDA context cannot be trusted."""

FAULT_REASONS = frozenset({"build_timeout", "run_timeout", "crashed", "killed_by_signal", "illegal_memory_access",
                           "device_assert", "cuda_error", "executor_error", "sandbox_failed", "bad_message"})
"""A fault of the candidate's process (not of its answer): the job escalates to isolation."""
