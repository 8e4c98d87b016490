"""Leaderboard and fast_p on hand-made stores whose answers are worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pytest

from fibray.analysis import AnalysisError, evaluations, fast_p_curve, leaderboard
from fibray.store import TraceStore
from _analysis_fixtures import make_store, row

# Definition d has workloads w1..w4. "fast" passes w1 (4x), w2 (1.2x), w3 (0.5x) and fails w4;
# "slow" passes w1 at exactly 1.0x, fails to compile on w2 and was never run on w3, w4.
# Definition e has two workloads, one passed by "other". Sweep s2 holds rows that must not count.
ROWS = [
    row("d", "w1", "fast", speedup=4.0), row("d", "w2", "fast", speedup=1.2), row("d", "w3", "fast", speedup=0.5),
    row("d", "w4", "fast", "INCORRECT_NUMERICAL", reason="tolerance_exceeded"),
    row("d", "w1", "slow", speedup=1.0, author="bob"), row("d", "w2", "slow", "COMPILE_ERROR", author="bob"),
    row("e", "x1", "other", speedup=3.0), row("e", "x2", "other", "RUNTIME_ERROR"),
    row("d", "w1", "fast", "TIMEOUT", sweep="s2"), row("d", "w9", "fast", speedup=9.0, sweep="s2"),
]


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    store = make_store(tmp_path_factory.mktemp("store"), ROWS)
    return leaderboard(evaluations(store, "s1"))


def _get(board: pl.DataFrame, solution: str) -> dict:
    return board.filter(pl.col("solution") == solution).to_dicts()[0]


def test_passed_is_counted_over_every_workload_of_the_definition(board: pl.DataFrame) -> None:
    fast, slow, other = _get(board, "fast"), _get(board, "slow"), _get(board, "other")
    assert (fast["passed"], fast["total"], fast["evaluated"]) == (3, 4, 4)
    # slow ran on 2 of d's 4 workloads: the two it never ran count against it.
    assert (slow["passed"], slow["total"], slow["evaluated"]) == (1, 4, 2)
    assert (other["passed"], other["total"]) == (1, 2)


def test_geomean_speedup_is_over_passed_workloads_only(board: pl.DataFrame) -> None:
    assert _get(board, "fast")["geomean_speedup"] == pytest.approx((4.0 * 1.2 * 0.5) ** (1 / 3))
    assert _get(board, "slow")["geomean_speedup"] == pytest.approx(1.0)


def test_fast_p_counts_workloads_passed_and_strictly_faster_than_p(board: pl.DataFrame) -> None:
    fast, slow = _get(board, "fast"), _get(board, "slow")
    assert [fast[f"fast_{p}"] for p in ("0", "1", "1.5", "2")] == [0.75, 0.5, 0.25, 0.25]
    # exactly 1.0x is not faster than p = 1
    assert [slow[f"fast_{p}"] for p in ("0", "1", "1.5", "2")] == [0.25, 0.0, 0.0, 0.0]


def test_rows_of_other_sweeps_are_left_out(board: pl.DataFrame) -> None:
    assert set(board["definition"]) == {"d", "e"}
    assert _get(board, "fast")["total"] == 4  # w9 exists only in sweep s2


def test_leaderboard_puts_the_best_solution_of_each_definition_first(board: pl.DataFrame) -> None:
    assert board.filter(pl.col("definition") == "d")["solution"].to_list() == ["fast", "slow"]


def test_fast_0_is_the_correct_rate_even_when_the_reference_was_not_timed(tmp_path: Path) -> None:
    store = make_store(tmp_path, [row("d", "w1", "s", speedup=None), row("d", "w2", "s", "RUNTIME_ERROR")])
    got = leaderboard(evaluations(store)).to_dicts()[0]
    assert (got["fast_0"], got["fast_1"], got["geomean_speedup"]) == (0.5, 0.0, None)


def test_a_job_recorded_twice_counts_once_as_its_latest_published_verdict(tmp_path: Path) -> None:
    # The verdict published last wins, whatever finished_at its row claims (a forger's says 2099).
    store = TraceStore(tmp_path)
    store.append([row("d", "w1", "s", "RUNTIME_ERROR", at=60.0), row("d", "w2", "s", speedup=2.0)])
    store.append([row("d", "w1", "s", speedup=2.0, at=10.0)])
    got = leaderboard(evaluations(store)).to_dicts()[0]
    assert (got["passed"], got["total"], got["evaluated"], got["fast_1"]) == (2, 2, 2, 1.0)


def test_fast_p_curve_agrees_with_the_leaderboard_and_never_rises(board: pl.DataFrame, tmp_path: Path) -> None:
    units = evaluations(make_store(tmp_path, ROWS), "s1")
    curve = fast_p_curve(units, [0, 0.25, 1, 1.5, 2, 3, 5])
    fast = curve.filter(pl.col("solution") == "fast")
    assert fast["fast_p"].to_list() == [0.75, 0.75, 0.5, 0.25, 0.25, 0.25, 0.0]
    for (_d, _s), part in curve.group_by("definition", "solution"):
        values = part.sort("p")["fast_p"].to_list()
        assert values == sorted(values, reverse=True)


def test_fast_p_curve_by_author_counts_a_workload_if_any_of_its_solutions_is_fast(tmp_path: Path) -> None:
    rows = [row("d", "w1", "a1", speedup=3.0), row("d", "w2", "a1", "COMPILE_ERROR"),
            row("d", "w1", "a2", "COMPILE_ERROR"), row("d", "w2", "a2", speedup=1.1),
            row("d", "w3", "a2", "TIMEOUT")]
    curve = fast_p_curve(evaluations(make_store(tmp_path, rows)), [0, 1, 2], by=("author",))
    assert dict(zip(curve["p"], curve["fast_p"])) == {0.0: 2 / 3, 1.0: 2 / 3, 2.0: 1 / 3}


def test_a_missing_store_is_an_analysis_error_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(AnalysisError, match="does not exist"):
        evaluations(tmp_path / "nowhere")
    with pytest.raises(AnalysisError, match="no trace files"):
        evaluations(tmp_path)


def test_geomean_matches_a_direct_computation_on_many_rows(tmp_path: Path) -> None:
    speedups = [0.5 + 0.01 * i for i in range(200)]
    store = make_store(tmp_path, [row("d", f"w{i}", "s", speedup=s) for i, s in enumerate(speedups)], files_per_partition=4)
    got = leaderboard(evaluations(store)).to_dicts()[0]
    assert got["geomean_speedup"] == pytest.approx(math.exp(sum(map(math.log, speedups)) / len(speedups)))
    assert got["fast_1"] == pytest.approx(sum(s > 1 for s in speedups) / 200)
