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


def expected_verdict(entry: list) -> tuple[str, Any]:
    """(status, reason) of an entry of tests/fault_expectations*.json."""
    return entry[0], entry[1]


def meets_extra(entry: list, timing_mode: Any, latency_ms: Any) -> bool:
    """An entry's optional third item against a row: a string is the suffix its timing mode must end in
    ("host_bound": a GPU slot kept a lie's timing at its own clock); a number, the least latency (ms) the
    row may show (an attack that no longer pays: its honest kernel's time)."""
    if len(entry) < 3:
        return True
    extra = entry[2]
    if isinstance(extra, str):
        return str(timing_mode).endswith("+" + extra)
    return latency_ms is not None and latency_ms >= extra


def smoke_config(store: Path, **overrides: Any) -> SweepConfig:
    """The smoke experiment as `python -m fibray.sweep +experiment=smoke` composes it (conf/config.yaml
    with conf/experiment/smoke.yaml), writing to `store`, without a progress line, and with
    `section__key=value` overrides; validated like the command line's."""
    from fibray.sweep.__main__ import compose_config

    raw = compose_config(["+experiment=smoke"])
    raw["store"]["root"] = str(store)
    raw["sweep"]["progress"] = False
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        raw.setdefault(section, {})[name] = value
    return validate_config(raw)


def reachable_tmpdir(prefix: str) -> Path:
    """A temp dir that unprivileged executors can reach (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o755)
    return path


def assert_memory_bound(ex, limits: dict, bound: int) -> None:
    """`ex` (a sandbox.Executor) is held to `bound` bytes of host memory: by its memory cgroup, where
    one could be made (its processes then have no address-space limit), else by RLIMIT_AS."""
    from fibray.workers.process.cgroup import _limit_file

    if ex.cgroup is not None and ex.cgroup.bounds_memory:
        assert _limit_file(ex.cgroup.memory_h, ex.cgroup.memory).read_text().strip() == str(bound)
        assert limits["Max address space"] == "unlimited", limits
    else:
        assert limits["Max address space"] == str(bound), limits


def inline_solution(name: str, source: str) -> Any:
    """A CPU solution of rmsnorm_h4096 whose main.py is `source`."""
    from fibray.schema import Solution

    return Solution.model_validate({
        "name": name, "definition": "rmsnorm_h4096", "author": "t",
        "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "main.py::run",
                 "destination_passing_style": True},
        "sources": [{"path": "main.py", "content": source}]})
