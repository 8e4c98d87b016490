"""The agent loop's typed configuration, validated from the composed Hydra config (conf/evolve.yaml).

It shares the sweep's dataset, store, cluster, eval and runner sections; `evolve` holds the loop:
its run id, budgets, the public/hidden split and the generator. A bad key is one ConfigError naming it.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from fibray.schema import EvalSettings
from fibray.sweep.config import ClusterConfig, DatasetConfig, RunnerConfig, StoreConfig, Name, _Strict, validate_model

__all__ = ["BudgetConfig", "EvolveConfig", "EvolveSection", "GeneratorConfig", "SplitConfig", "validate_evolve_config"]


class GeneratorConfig(_Strict):
    kind: Literal["search", "shell", "callable"] = "search"
    """search: the built-in Triton config search; shell: a command; callable: a Python `module:function`."""
    command: Optional[list[str] | str] = None
    """shell: the command (a list, or a string split like a shell would); task JSON on stdin, solutions on stdout."""
    callable: Optional[str] = None
    """callable: `module:function`, called with the task dict; returns solution dicts (or their JSON)."""
    deadline_s: float = Field(default=600.0, gt=0)
    """Seconds a shell or callable generator may take for one round; past it the round is lost."""
    templates: dict[str, str] = Field(default_factory=dict)
    """search: definition-name glob -> template (a Solution JSON, or a Triton .py whose `run` is the entry)."""
    seed: int = Field(default=0, ge=0)
    """search: seed of its random choices."""
    explore: float = Field(default=0.25, ge=0, le=1)
    """search: share of each round's candidates drawn at random instead of mutated from the best."""
    max_output_bytes: int = Field(default=16 << 20, ge=1024)
    """shell: most bytes of stdout read; more is garbage."""

    @model_validator(mode="after")
    def _validate_kind(self) -> "GeneratorConfig":
        if self.kind == "shell" and not self.command:
            raise ValueError("command: required when kind is shell")
        if self.kind == "callable" and (not self.callable or ":" not in self.callable):
            raise ValueError(f"callable: expected 'module:function' when kind is callable (got {self.callable!r})")
        if self.kind == "search" and not self.templates:
            raise ValueError("templates: the search needs at least one template (definition glob -> file)")
        return self


class BudgetConfig(_Strict):
    max_rounds: int = Field(default=10, ge=1)
    """Rounds per definition (1..R)."""
    candidates: int = Field(default=4, ge=1)
    """Candidates asked of the generator per round (N); more are cut."""
    max_candidates: Optional[int] = Field(default=None, ge=1)
    """Candidates per definition over the whole run; null: no limit."""
    wall_time_s: Optional[float] = Field(default=None, gt=0)
    """No round starts after this many seconds of this invocation; null: no limit."""
    patience: Optional[int] = Field(default=None, ge=1)
    """Stop a definition after K rounds in a row without a better solution; null: never."""
    min_improvement: float = Field(default=0.0, ge=0)
    """A round improves when its best speedup beats the best so far by more than this fraction."""


class SplitConfig(_Strict):
    hidden_fraction: float = Field(default=0.25, ge=0, lt=1)
    """Without a splits/ sidecar: the share of each definition's workloads kept hidden (at least one when
    there are two or more)."""
    seed: int = Field(default=0, ge=0)
    """Seed of that deterministic split."""


class EvolveSection(_Strict):
    run_id: Name = "evolve"
    """The loop's run: a store partition (sweep=<run_id>); rerunning the same id resumes it."""
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    feedback_log_chars: int = Field(default=2000, ge=100)
    """Most characters of a candidate's compile/runtime log fed back to the generator."""
    progress: bool = True
    """Print a progress line per definition and round."""


class EvolveConfig(_Strict):
    dataset: DatasetConfig
    store: StoreConfig = Field(default_factory=StoreConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    evolve: EvolveSection = Field(default_factory=EvolveSection)


def validate_evolve_config(raw: dict[str, Any]) -> EvolveConfig:
    """Validate a plain dict (the resolved Hydra config) into an EvolveConfig."""
    return validate_model(EvolveConfig, raw, "evolve")
