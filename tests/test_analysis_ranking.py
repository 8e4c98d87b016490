"""Author ranking with bootstrap intervals: noise is a tie, a real gap is a rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from fibray.analysis import evaluations, rank_authors
from _analysis_fixtures import make_store, row


def _author_rows(author: str, fast: int, n: int = 40, definition: str = "d") -> list[dict]:
    """An author with one solution on n workloads, 2x faster on the first `fast`, failing on the rest."""
    return [row(definition, f"w{i}", f"{author}-sol", "PASSED" if i < fast else "INCORRECT_NUMERICAL",
                speedup=2.0, author=author) for i in range(n)]


def _ranks(tmp_path: Path, rows: list[dict], **kwargs) -> dict[str, dict]:
    ranking = rank_authors(evaluations(make_store(tmp_path, rows)), **kwargs)
    return {r["author"]: r for r in ranking.to_dicts()}


def test_authors_whose_difference_is_noise_are_tied(tmp_path: Path) -> None:
    got = _ranks(tmp_path, _author_rows("alice", 20) + _author_rows("bob", 21) + _author_rows("carol", 0))
    assert (got["bob"]["rank"], got["alice"]["rank"]) == (1, 1)
    assert got["bob"]["tied_with"] == ["alice"] and got["alice"]["tied_with"] == ["bob"]
    assert got["carol"]["rank"] == 3 and got["carol"]["tied_with"] == []


def test_a_clear_difference_gives_separate_ranks(tmp_path: Path) -> None:
    got = _ranks(tmp_path, _author_rows("alice", 36) + _author_rows("bob", 4))
    assert (got["alice"]["rank"], got["bob"]["rank"]) == (1, 2)
    assert got["alice"]["tied_with"] == [] and got["bob"]["tied_with"] == []


def test_identical_authors_share_rank_one(tmp_path: Path) -> None:
    got = _ranks(tmp_path, _author_rows("alice", 10) + _author_rows("bob", 10))
    assert got["alice"]["rank"] == got["bob"]["rank"] == 1


def test_score_averages_definitions_not_workloads(tmp_path: Path) -> None:
    # fast on both workloads of d, on none of the 10 of e: (1 + 0) / 2, not 2 / 12.
    rows = _author_rows("alice", 2, n=2, definition="d") + _author_rows("alice", 0, n=10, definition="e")
    got = _ranks(tmp_path, rows)["alice"]
    assert got["score"] == pytest.approx(0.5)
    assert (got["definitions"], got["workloads"], got["solutions"]) == (2, 12, 2)


def test_score_is_the_share_of_an_authors_solutions_fast_on_each_workload(tmp_path: Path) -> None:
    # Two solutions on one workload, one fast: 0.5; a second agent with one fast solution: 1.0.
    rows = [row("d", "w1", "a", speedup=3.0, author="alice"), row("d", "w1", "b", "TIMEOUT", author="alice"),
            row("d", "w1", "c", speedup=3.0, author="bob")]
    got = _ranks(tmp_path, rows)
    assert (got["alice"]["score"], got["bob"]["score"]) == (0.5, 1.0)


def test_threshold_p_is_applied_to_the_speedup(tmp_path: Path) -> None:
    rows = [row("d", f"w{i}", "s", speedup=1.2) for i in range(4)]
    assert _ranks(tmp_path, rows, p=1.0)["alice"]["score"] == 1.0
    assert _ranks(tmp_path, rows, p=1.5)["alice"]["score"] == 0.0


def test_interval_brackets_the_score_and_the_seed_makes_it_repeatable(tmp_path: Path) -> None:
    units = evaluations(make_store(tmp_path, _author_rows("alice", 13) + _author_rows("bob", 30)))
    first, again = rank_authors(units, seed=7), rank_authors(units, seed=7)
    assert first.equals(again)
    for r in first.to_dicts():
        assert r["ci_low"] <= r["score"] <= r["ci_high"]
        assert r["ci_low"] < r["ci_high"]


def test_empty_selection_gives_an_empty_ranking(tmp_path: Path) -> None:
    units = evaluations(make_store(tmp_path, _author_rows("alice", 3)), sweeps="no-such-sweep")
    assert rank_authors(units).is_empty()
    assert rank_authors(units).columns[:2] == ["rank", "author"]
