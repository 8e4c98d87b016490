"""Runnable examples of fibray (run from the repository root: `python -m examples.<name>`)."""
