"""What this machine cannot do is not charged to candidates: a CUDA candidate without a GPU and a Triton
kernel too slow for the CPU interpreter's deadline are recorded as environment-limited and kept out of
leaderboards, rankings and failure taxonomies; CPU speedups are hidden unless asked for."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from fibray.analysis import evaluations, failure_taxonomy, leaderboard, rank_authors
from fibray.report import build_report
from fibray.schema import Environment, Evaluation, EvaluationStatus
from fibray.store.columns import environment_limited
from _analysis_fixtures import make_store, row


def _ev(status: str, reason: str | None, hardware: str) -> Evaluation:
    return Evaluation(status=EvaluationStatus(status), reason=reason, log="", timestamp="2026-01-01T00:00:00Z",
                      environment=Environment(hardware=hardware, libs={}))


@pytest.mark.parametrize("status, reason, hardware, language, limited", [
    ("RUNTIME_ERROR", "device_required", "cpu-x86_64", "cuda", True),
    ("TIMEOUT", "run_timeout", "cpu-x86_64", "triton", True),       # the interpreter, not the kernel
    ("TIMEOUT", "run_timeout", "NVIDIA H200", "triton", False),     # on a GPU a hang is the kernel's
    ("TIMEOUT", "run_timeout", "cpu-x86_64", "python", False),      # python runs at full speed on a CPU
    ("TIMEOUT", "build_timeout", "cpu-x86_64", "triton", False),
    ("COMPILE_ERROR", "nvcc_error", "cpu-x86_64", "cuda", False),
])
def test_environment_limited_means_this_machine_could_not_judge(status, reason, hardware, language, limited):
    assert environment_limited(_ev(status, reason, hardware), language) is limited


def _limited(definition: str, workload: str, solution: str, status: str, reason: str, **kw) -> dict:
    r = row(definition, workload, solution, status, reason=reason, **kw)
    r.update(environment_limited=True, hardware="cpu-x86_64")
    return r


@pytest.fixture
def store(tmp_path: Path) -> Path:
    rows = [row("d", f"w{i}", "d_triton", speedup=1.2, author="alice") for i in range(2)]
    rows += [_limited("d", f"w{i}", "d_cuda", "RUNTIME_ERROR", "device_required", author="bob", language="cuda")
             for i in range(2)]
    rows += [_limited("d", "w0", "d_slow", "TIMEOUT", "run_timeout", author="bob")]
    make_store(tmp_path / "store", rows)
    return tmp_path / "store"


def test_limited_rows_are_left_out_of_leaderboard_ranking_and_taxonomy(store):
    units = evaluations(store, "s1")
    assert set(leaderboard(units)["solution"]) == {"d_triton"}
    assert set(rank_authors(units)["author"]) == {"alice"}
    taxonomy = failure_taxonomy(units)
    assert set(taxonomy["author"]) == {"alice"} and taxonomy["failed"].sum() == 0
    apart = evaluations(store, "s1", environment_limited=True).collect()
    assert sorted(apart["solution"]) == ["d_cuda", "d_cuda", "d_slow"]
    assert evaluations(store, "s1", environment_limited=None).collect().height == 5


def test_report_lists_limited_rows_apart(store, tmp_path):
    report = build_report(store, tmp_path / "out")
    text = report.text()
    section = text.split("## Could not run here", 1)[1]
    assert "d_cuda" in section and "device_required" in section and "d_slow" in section and "run_timeout" in section
    before = text.split("## Could not run here", 1)[0]
    assert "d_cuda" not in before and "d_slow" not in before
    assert "Could not run here" in (tmp_path / "out" / "report.html").read_text()


def _cpu_store(root: Path) -> Path:
    rows = []
    for author, speed in (("alice", 3.0), ("bob", 0.2)):
        for i in range(3):
            r = row("d", f"w{i}", f"d_{author}", speedup=speed, author=author)
            r.update(hardware="cpu-x86_64", timing_mode="wall_clock")
            rows.append(r)
    make_store(root, rows)
    return root


def test_cpu_speedups_are_hidden_from_rankings_by_default(tmp_path):
    store = _cpu_store(tmp_path / "store")
    report = build_report(store, tmp_path / "out")
    text = report.text()
    assert "timing: wall clock on cpu-x86_64 (Triton interpreted)" in text
    assert "hidden (--show-cpu-speedups to show)" in text
    board = dict(report.sections[0].tables)[""]
    assert "geomean_speedup" not in board.columns and "fast_1" not in board.columns
    ranking = dict(report.sections[1].tables)[""]
    assert ranking["rank"].to_list() == [1, 1]  # both correct everywhere: tied on correctness, not split by CPU speed
    assert not (tmp_path / "out" / "fast_p.png").exists()


def test_cpu_speedups_are_shown_when_asked(tmp_path):
    store = _cpu_store(tmp_path / "store")
    report = build_report(store, tmp_path / "out", show_cpu_speedups=True)
    board = dict(report.sections[0].tables)[""]
    assert board.filter(pl.col("solution") == "d_alice")["geomean_speedup"].item() == pytest.approx(3.0)
    assert "speedups were timed by wall clock on a CPU: not meaningful" in report.text()
