"""Python-callable generators for the agent-loop tests (`evolve.generator.callable: _evolve_agents:<name>`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CANDIDATES = Path(__file__).resolve().parent / "data" / "kernelbench_candidates"


def nothing(task: dict[str, Any]) -> list:
    """Proposes nothing: every round is spent without a candidate."""
    return []


def modelnew_matmul(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A raw KernelBench candidate (binding kernelbench, entry file::ModelNew) for a KernelBench matmul task."""
    assert task["kernelbench"], "the task should say it is a KernelBench definition"
    return [{
        "name": f"matmul_modelnew_r{task['round']}", "definition": task["definition"]["name"], "author": "callable-agent",
        "spec": {"language": "triton", "target_hardware": ["cpu", "cuda"], "entry_point": "kernel.py::ModelNew",
                 "binding": "kernelbench", "destination_passing_style": False},
        "sources": [{"path": "kernel.py", "content": (CANDIDATES / "matmul_triton_new.py").read_text()}],
    }]
