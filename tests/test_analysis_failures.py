"""Failure taxonomy by author and language, and by reason, with known counts."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from fibray.analysis import evaluations, failure_reasons, failure_taxonomy
from _analysis_fixtures import make_store, row

ROWS = [
    row("d", "w1", "t1", speedup=2.0),
    row("d", "w2", "t1", "COMPILE_ERROR", reason="syntax_error"),
    row("d", "w3", "t1", "COMPILE_ERROR", reason="syntax_error"),
    row("d", "w4", "t1", "RUNTIME_ERROR", reason="illegal_memory_access"),
    row("d", "w1", "c1", "INCORRECT_NUMERICAL", reason="tolerance_exceeded", language="cuda"),
    row("d", "w2", "c1", "INCORRECT_SHAPE", reason="wrong_shape", language="cuda"),
    row("d", "w3", "c1", "INCORRECT_DTYPE", reason="wrong_dtype", language="cuda"),
    row("d", "w4", "c1", "TIMEOUT", reason="run_timeout", language="cuda"),
    row("d", "w1", "b1", "RUNTIME_ERROR", reason="crashed", author="bob"),
    row("d", "w2", "b1", "RUNTIME_ERROR", reason="exception", author="bob"),
]


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> pl.LazyFrame:
    return evaluations(make_store(tmp_path_factory.mktemp("store"), ROWS)).collect().lazy()


def test_taxonomy_counts_each_category_per_author_and_language(units: pl.LazyFrame) -> None:
    table = {(r["author"], r["language"]): r for r in failure_taxonomy(units).to_dicts()}
    assert set(table) == {("alice", "triton"), ("alice", "cuda"), ("bob", "triton")}
    t = table[("alice", "triton")]
    assert (t["evaluations"], t["passed"], t["failed"], t["compile"], t["runtime"]) == (4, 1, 3, 2, 1)
    c = table[("alice", "cuda")]
    assert (c["numerical"], c["shape"], c["dtype"], c["timeout"], c["passed"]) == (1, 1, 1, 1, 0)
    assert table[("bob", "triton")]["runtime"] == 2


def test_taxonomy_shares_of_a_group_add_up_to_one(units: pl.LazyFrame) -> None:
    table = failure_taxonomy(units)
    shares = table.select(pl.sum_horizontal(pl.col("^.*_share$"))).to_series().to_list()
    assert shares == pytest.approx([1.0] * table.height)


def test_each_reason_is_counted_with_its_share_of_the_group(units: pl.LazyFrame) -> None:
    reasons = failure_reasons(units)
    alice_triton = reasons.filter((pl.col("author") == "alice") & (pl.col("language") == "triton"))
    assert alice_triton.select("category", "reason", "count", "share").rows() == [
        ("compile", "syntax_error", 2, 0.5), ("runtime", "illegal_memory_access", 1, 0.25)]
    bob = reasons.filter(pl.col("author") == "bob")
    assert sorted(bob["reason"].to_list()) == ["crashed", "exception"]
    assert "PASSED" not in reasons["status"].to_list()


def test_taxonomy_can_be_grouped_by_any_columns(units: pl.LazyFrame) -> None:
    by_language = failure_taxonomy(units, by=("language",))
    assert dict(zip(by_language["language"], by_language["runtime"])) == {"cuda": 0, "triton": 3}


def test_a_failure_without_a_reason_is_listed_as_unspecified(tmp_path: Path) -> None:
    r = row("d", "w1", "s", "RUNTIME_ERROR")
    r["reason"] = None
    reasons = failure_reasons(evaluations(make_store(tmp_path, [r])))
    assert reasons["reason"].to_list() == ["unspecified"]
