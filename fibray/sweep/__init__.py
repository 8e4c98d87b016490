"""Sweeps: typed config, job construction, the driver loop and its summary."""

from fibray.sweep.config import ConfigError, SweepConfig, validate_config
from fibray.sweep.driver import SweepReport, format_summary, make_jobs, run_sweep, summary_rows

__all__ = ["ConfigError", "SweepConfig", "SweepReport", "format_summary", "make_jobs", "run_sweep", "summary_rows", "validate_config"]
