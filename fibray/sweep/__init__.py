"""Sweeps: typed config, job construction, the driver loop and its summary."""

from fibray.sweep.config import ConfigError, SweepConfig, validate_config
from fibray.sweep.driver import SweepInterrupted, SweepReport, make_jobs, run_sweep
from fibray.sweep.summary import format_summary, summary_rows, sweep_summary

__all__ = ["ConfigError", "SweepConfig", "SweepInterrupted", "SweepReport", "format_summary", "make_jobs", "run_sweep",
           "summary_rows", "sweep_summary", "validate_config"]
