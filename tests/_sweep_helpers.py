"""Helpers for tests that run real sweeps: config dicts and the designed verdict of each bundled solution."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from fibray.sweep import SweepConfig, validate_config

REPO = Path(__file__).resolve().parents[1]

# Bundled solutions are named <definition>_<variant>; each variant is designed to land on one verdict.
DESIGNED = {
    "torch": ("PASSED", None),
    "triton": ("PASSED", None),
    "triton_big_eps": ("INCORRECT_NUMERICAL", "tolerance_exceeded"),
    "triton_scaled": ("INCORRECT_NUMERICAL", "tolerance_exceeded"),
    "torch_fp32_out": ("INCORRECT_DTYPE", "wrong_dtype"),
    "torch_flat": ("INCORRECT_SHAPE", "wrong_shape"),
    "torch_batched": ("INCORRECT_SHAPE", "wrong_shape"),
    "triton_syntax_error": ("COMPILE_ERROR", "syntax_error"),
    "triton_missing_arg": ("RUNTIME_ERROR", "exception"),
}


def designed_verdict(solution: str, definition: str) -> tuple[str, Any]:
    return DESIGNED[solution.removeprefix(definition + "_")]


def smoke_config(store: Path, **overrides: Any) -> SweepConfig:
    """The smoke experiment as a typed config (the same values as conf/experiment/smoke.yaml)."""
    raw: dict[str, Any] = {
        "dataset": {"root": str(REPO / "datasets" / "core"), "workload_set": "cpu_small"},
        "solutions": {"roots": [str(REPO / "solutions")]},
        "store": {"root": str(store)},
        "sweep": {"name": "smoke", "progress": False},
        "eval": {"warmup": 1, "iterations": 5, "trials": 2},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        raw.setdefault(section, {})[name] = value
    return validate_config(raw)


def reachable_tmpdir(prefix: str) -> Path:
    """A temp dir that unprivileged executors can reach (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o755)
    return path
