"""Comparison of two sweeps: every kind of change lands where it should."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from fibray.analysis import AnalysisError, compare_sweeps, comparison_summary
from _analysis_fixtures import make_store, row

# solution -> (baseline verdict, candidate verdict, expected change); None = not in that sweep.
CASES = {
    "slower": (("PASSED", 2.0), ("PASSED", 1.0), "regression"),
    "faster": (("PASSED", 1.0), ("PASSED", 1.5), "improvement"),
    "noise": (("PASSED", 1.0), ("PASSED", 1.02), "unchanged"),
    "broke": (("PASSED", 1.0), ("RUNTIME_ERROR", None), "broken"),
    "fixed": (("COMPILE_ERROR", None), ("PASSED", 1.0), "fixed"),
    "other_failure": (("COMPILE_ERROR", None), ("TIMEOUT", None), "status_changed"),
    "still_wrong": (("INCORRECT_SHAPE", None), ("INCORRECT_SHAPE", None), "unchanged"),
    "gone": (("PASSED", 1.0), None, "dropped"),
    "new": (None, ("PASSED", 1.0), "added"),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = []
    for name, (base, cand, _) in CASES.items():
        for sweep, verdict in (("base", base), ("cand", cand)):
            if verdict is not None:
                rows.append(row("d", "w1", name, verdict[0], speedup=verdict[1], sweep=sweep, axes={"m": 4}))
    root = tmp_path_factory.mktemp("store")
    make_store(root, rows)
    return root


def test_each_unit_gets_its_kind_of_change(store: Path) -> None:
    cmp = compare_sweeps(store, "base", "cand")
    got = {r["solution"]: str(r["change"]) for r in cmp.to_dicts()}
    assert got == {name: case[2] for name, case in CASES.items()}


def test_status_flips_are_flagged_and_ratios_are_given_only_when_both_passed(store: Path) -> None:
    cmp = {r["solution"]: r for r in compare_sweeps(store, "base", "cand").to_dicts()}
    assert {s for s, r in cmp.items() if r["status_flip"]} == {"broke", "fixed", "other_failure"}
    assert cmp["slower"]["ratio"] == pytest.approx(0.5)
    assert cmp["faster"]["ratio"] == pytest.approx(1.5)
    assert cmp["broke"]["ratio"] is None and cmp["new"]["ratio"] is None
    assert cmp["new"]["axes"] == '{"m": 4}' and cmp["gone"]["language"] == "triton"


def test_tolerance_decides_what_is_noise(store: Path) -> None:
    cmp = compare_sweeps(store, "base", "cand", tolerance=0.01)
    assert str(cmp.filter(pl.col("solution") == "noise")["change"][0]) == "improvement"


def test_summary_counts_changes_per_definition(store: Path) -> None:
    summary = comparison_summary(compare_sweeps(store, "base", "cand")).to_dicts()[0]
    assert summary["units"] == len(CASES)
    assert (summary["regression"], summary["improvement"], summary["unchanged"], summary["broken"],
            summary["fixed"], summary["added"], summary["dropped"]) == (1, 1, 2, 1, 1, 1, 1)
    assert summary["geomean_ratio"] == pytest.approx((0.5 * 1.5 * 1.02) ** (1 / 3))


def test_an_unknown_sweep_is_named_in_the_error(store: Path) -> None:
    with pytest.raises(AnalysisError, match="'nope'"):
        compare_sweeps(store, "base", "nope")
