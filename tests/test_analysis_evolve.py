"""The agent loop's analysis and report section: best speedup per round and the public -> hidden gap,
from hand-made store rows whose answers are worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from _analysis_fixtures import make_store, row
from fibray.analysis import evaluations, evolve_gap, evolve_rounds, has_loop_rows
from fibray.report import build_report


def _loop(definition: str, workload: str, solution: str, rnd: int, speedup: float = 1.0, status: str = "PASSED",
          split: str = "public", at: float = 0.0) -> dict:
    r = row(definition, workload, solution, status, speedup, sweep="run1", at=at)
    r.update(round=rnd, parent="template", generator="search", run_id="run1", split=split)
    return r


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    rows = [
        _loop("d", "w1", "r1a", 1, 1.0), _loop("d", "w2", "r1a", 1, 4.0),        # geomean 2.0
        _loop("d", "w1", "r1b", 1, 9.0), _loop("d", "w2", "r1b", 1, status="INCORRECT_NUMERICAL"),  # failed: none
        _loop("d", "w1", "r2a", 2, 1.0), _loop("d", "w2", "r2a", 2, 1.0),        # 1.0: not better
        _loop("d", "w1", "r3a", 3, 3.0), _loop("d", "w2", "r3a", 3, 3.0),        # 3.0: the best
        _loop("d", "h1", "r3a", 3, 1.5, split="hidden", at=1),                   # the best, on the hidden workload
        row("d", "w1", "plain", sweep="run1"),                                   # a sweep row: no round
    ]
    root = tmp_path / "store"
    make_store(root, rows)
    return root


def test_best_speedup_per_round_counts_only_candidates_that_passed_every_public_workload(store: Path) -> None:
    units = evaluations(store, "run1")
    assert has_loop_rows(units)
    df = evolve_rounds(units)
    assert df["round"].to_list() == [1, 2, 3]
    assert df["candidates"].to_list() == [2, 1, 1] and df["passed"].to_list() == [1, 1, 1]
    assert df["round_best"].to_list() == pytest.approx([2.0, 1.0, 3.0])
    assert df["best_so_far"].to_list() == pytest.approx([2.0, 2.0, 3.0])


def test_the_gap_compares_the_best_public_candidate_with_its_hidden_score(store: Path) -> None:
    gap = evolve_gap(evaluations(store, "run1")).to_dicts()
    assert len(gap) == 1 and gap[0]["best"] == "r3a" and gap[0]["round"] == 3
    assert gap[0]["public_speedup"] == pytest.approx(3.0) and gap[0]["hidden_speedup"] == pytest.approx(1.5)
    assert gap[0]["gap"] == pytest.approx(-0.5) and gap[0]["hidden_passed"]


def test_the_report_has_an_agent_loop_section_with_its_plot_when_the_store_has_loop_rows(store: Path, tmp_path: Path) -> None:
    report = build_report(store, tmp_path / "out", sweep="run1")
    section = next(s for s in report.sections if s.title == "Agent loop")
    assert [p.name for p in section.pngs] == ["evolve_rounds.png"] and section.pngs[0].stat().st_size > 0
    assert "Agent loop: public -> hidden" in report.text()


def test_a_sweep_without_loop_rows_has_no_agent_loop_section(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_store(root, [row("d", "w1", "s"), row("d", "w2", "s")])
    assert not has_loop_rows(evaluations(root, "s1"))
    assert all(s.title != "Agent loop" for s in build_report(root, tmp_path / "out", sweep="s1").sections)
