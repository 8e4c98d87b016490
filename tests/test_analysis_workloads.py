"""Best solution per workload, and speedup as a function of each var axis."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from fibray.analysis import best_per_workload, evaluations, speedup_by_axis
from _analysis_fixtures import make_store, row


def test_best_solution_of_a_workload_is_its_fastest_passed_one(tmp_path: Path) -> None:
    rows = [row("d", "w1", "a", speedup=1.5), row("d", "w1", "b", speedup=3.0, author="bob"),
            row("d", "w1", "c", "INCORRECT_NUMERICAL"),  # a wrong answer never wins, however fast
            row("d", "w2", "a", speedup=0.7), row("d", "w2", "b", "COMPILE_ERROR", author="bob"),
            row("d", "w3", "a", "TIMEOUT"), row("d", "w3", "b", "RUNTIME_ERROR", author="bob")]
    best = {r["workload_uuid"]: r for r in best_per_workload(evaluations(make_store(tmp_path, rows))).to_dicts()}
    assert (best["w1"]["solution"], best["w1"]["author"], best["w1"]["speedup"]) == ("b", "bob", 3.0)
    assert (best["w1"]["candidates"], best["w1"]["passed_solutions"]) == (3, 2)
    assert best["w2"]["solution"] == "a"
    # nothing passed w3: it stays in the table, with no winner
    assert (best["w3"]["solution"], best["w3"]["passed_solutions"]) == (None, 0)


def test_equal_speedups_are_broken_by_solution_name(tmp_path: Path) -> None:
    rows = [row("d", "w1", "zeta", speedup=2.0), row("d", "w1", "alpha", speedup=2.0)]
    assert best_per_workload(evaluations(make_store(tmp_path, rows)))["solution"].to_list() == ["alpha"]


def test_speedup_by_axis_is_the_geomean_of_passed_rows_at_each_axis_value(tmp_path: Path) -> None:
    rows = [
        row("d", "w1", "s", speedup=1.0, axes={"m": 1, "n": 8}),
        row("d", "w2", "s", speedup=4.0, axes={"m": 1, "n": 16}),
        row("d", "w3", "s", speedup=2.0, axes={"m": 2, "n": 8}),
        row("d", "w4", "s", "RUNTIME_ERROR", axes={"m": 2, "n": 16}),
    ]
    series = speedup_by_axis(evaluations(make_store(tmp_path, rows)))
    m = series.filter(pl.col("axis") == "m")
    assert m.select("value", "geomean_speedup", "n").rows() == [(1.0, pytest.approx(2.0), 2), (2.0, 2.0, 1)]
    n = series.filter(pl.col("axis") == "n")
    assert n.select("value", "geomean_speedup", "n").rows() == [(8.0, pytest.approx(2 ** 0.5), 2), (16.0, 4.0, 1)]


def test_non_numeric_axis_values_are_left_out_of_the_series(tmp_path: Path) -> None:
    rows = [row("d", "w1", "s", speedup=2.0, axes={"layout": "nhd", "m": 4})]
    series = speedup_by_axis(evaluations(make_store(tmp_path, rows)))
    assert series["axis"].to_list() == ["m"]
