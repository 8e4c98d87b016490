"""ApplyConfig: which evaluations apply() trusts, and how it behaves at call time.

Validated once, when apply is enabled; nothing in it is read on the hot path except
values copied into plain attributes of the dispatchers.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DISABLE_ENV = "FIBRAY_APPLY_DISABLE"
"""Environment variable: when set to 1/true/yes/on, enable_apply() substitutes nothing."""


class ApplyConfig(BaseModel):
    """How apply() builds its dispatch index and what it does at call time."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_atol: float = Field(default=1e-2, ge=0)
    """Largest absolute tolerance an evaluation may have been judged with (or its max abs error)."""
    max_rtol: float = Field(default=1e-2, ge=0)
    """Largest relative tolerance an evaluation may have been judged with."""
    definitions: list[str] | None = None
    """Definition names to dispatch; None for every definition in the dataset."""
    sweeps: list[str] | None = None
    """Store sweeps whose evaluations count; None for all."""
    hardware: str | None = None
    """Hardware name evaluations must have run on; None: the running device (e.g. 'NVIDIA H200')."""
    match_libs: list[str] = Field(default_factory=lambda: ["torch", "triton", "cuda"])
    """Libraries whose versions must match the running process."""
    version_match: Literal["exact", "minor"] = "minor"
    """exact: identical version strings; minor: same major.minor (local build tags ignored)."""
    min_speedup: float | None = Field(default=None, gt=0)
    """Drop evaluations whose speedup over the definition's reference is below this; None keeps all."""
    on_miss: Literal["nearest", "fallback"] = "nearest"
    """Unseen var-axis values: use the winner of the nearest measured key, or call the fallback."""
    candidates_per_key: int = Field(default=2, ge=1)
    """Ranked solutions kept per key and built ahead; a runner-up takes over when the winner is switched off."""
    finite_check_calls: int | None = Field(default=None, ge=0)
    """Outputs checked for NaN/Inf: None on every substituted call; N on the first N calls of each solution; 0 never."""
    bucket_cache_size: int = Field(default=4096, ge=0)
    """Most resolved unseen keys remembered per definition (beyond it they are resolved on every call)."""
    compiled_dispatch: bool = True
    """Serve plain hits and misses through the C++ hit path (compiled once per torch build, about 30 s,
    then cached; the Python path if it cannot be built); False: the Python path only."""
    workdir: str | None = None
    """Folder for builds; None: a fresh temporary folder."""
    require_promotion: bool = False
    """Serve only artifacts whose latest stage in the store's promotions table (python -m fibray.promote)
    is default, canary or shadow for this process's environment (GPU, driver, CUDA, torch, triton);
    False: every verified winner serves at once, as before promotion existed."""
    canary_fraction: float = Field(default=0.05, ge=0, le=1)
    """Share of a canary artifact's calls it answers (chosen by a hash of its artifact id and the call's index)."""
    canary_compare_fraction: float = Field(default=0.1, ge=0, le=1)
    """Share of the calls a canary answers that are also run on the baseline and compared."""
    canary_compare_first: int = Field(default=8, ge=0)
    """The first N calls a canary answers are all compared."""
    shadow_fraction: float = Field(default=1.0, ge=0, le=1)
    """Share of a shadow artifact's calls on which it runs beside the baseline."""
    latency_window: int = Field(default=100, ge=4)
    """Compared calls over which a staged artifact's P99 latency is set against its baseline's."""
    latency_margin: float = Field(default=0.10, ge=0)
    """Demote a staged artifact whose P99 exceeds its baseline's by more than this fraction."""
    record_demotions: bool = True
    """Write a promotions row (stage demoted) when an artifact is demoted, if the store is writable."""

    @field_validator("match_libs")
    @classmethod
    def _validate_match_libs(cls, v: list[str]) -> list[str]:
        bad = [lib for lib in v if not lib or not lib.strip()]
        if bad:
            raise ValueError(f"match_libs: library names must be non-empty (got {v!r})")
        return v


def disabled_by_env() -> bool:
    """True when FIBRAY_APPLY_DISABLE asks for every call to go to its fallback."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
