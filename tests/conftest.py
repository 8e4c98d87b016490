"""Shared test setup: CPU-only Triton runs interpreted; the project's own FlashInfer Trace fixture,
and the real third-party sample where one is found (FIBRAY_FIB_SAMPLE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "fib_trace"
"""A small FlashInfer Trace folder of fibray's own making (tests/fixtures/make_fib_trace.py)."""
SHARED_SAMPLE = Path(os.environ.get("FIBRAY_FIB_SAMPLE") or REPO.parent / "shared" / "fib-trace-sample")
"""The real third-party sample (flashinfer-trace's definitions and workloads); CI has it."""


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    return FIXTURE


@pytest.fixture(scope="session")
def sample_root() -> Path:
    """The third-party sample; its tests are skipped where there is none (an error where
    FIBRAY_REQUIRE_SAMPLE=1, as in CI, so that they cannot silently stop running there)."""
    if not SHARED_SAMPLE.is_dir():
        why = f"no FlashInfer Trace sample at {SHARED_SAMPLE} (set FIBRAY_FIB_SAMPLE to a copy)"
        if os.environ.get("FIBRAY_REQUIRE_SAMPLE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return SHARED_SAMPLE
