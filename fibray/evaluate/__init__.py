"""One evaluation: the job protocol (run), the judge, the candidate runner, inputs, phases and
the environment. Names load on first use, so an executor imports the candidate runner without
the judge, and apply() the environment without either."""

from __future__ import annotations

__all__ = ["CandidateRunner", "Evaluator", "Judge", "Phases", "SideFault", "TrialOutput", "bound_log",
           "default_device", "environment", "now_iso", "run_job"]

_HOME = {"CandidateRunner": "candidate", "TrialOutput": "candidate", "Evaluator": "run", "Judge": "judge",
         "SideFault": "run", "bound_log": "judge", "run_job": "run", "Phases": "phases", "now_iso": "phases",
         "default_device": "environment", "environment": "environment"}


def __getattr__(name: str):
    if name in _HOME:
        import importlib

        value = getattr(importlib.import_module(f"fibray.evaluate.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fibray.evaluate' has no attribute {name!r}")
