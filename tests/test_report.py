"""`python -m fibray.report`: prints the tables, writes PNGs and one self-contained HTML page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fibray.analysis import AnalysisError
from fibray.report import build_report
from fibray.report.__main__ import main
from _analysis_fixtures import make_store, row

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("fast_p.png", "ranking.png", "speedup_by_axis.png", "failures.png")


def _sweep_rows(sweep: str, at: float, slow: float) -> list[dict]:
    rows = []
    for i, m in enumerate((1, 4, 16, 64)):
        rows.append(row("gemm", f"w{i}", "gemm_triton", speedup=2.0 / slow * (1 + i / 4), sweep=sweep, at=at, axes={"m": m}))
        rows.append(row("gemm", f"w{i}", "gemm_cuda", "COMPILE_ERROR" if i % 2 else "PASSED", speedup=0.8, sweep=sweep,
                        author="agent-x", language="cuda", reason="nvcc_error", at=at, axes={"m": m}))
        rows.append(row("norm", f"n{i}", "norm_torch", "INCORRECT_NUMERICAL" if i == 3 else "PASSED", speedup=1.3,
                        sweep=sweep, language="python", reason="tolerance_exceeded", at=at, axes={"b": 2 ** i}))
    return rows


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    make_store(root, _sweep_rows("old", at=0.0, slow=1.0) + _sweep_rows("new", at=100.0, slow=2.0))
    return root


def test_report_command_prints_tables_and_writes_plots_and_html(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "fibray.report", "--store", str(store), "--sweep", "new",
                           "--baseline-sweep", "old", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for title in ("## Leaderboard", "## Author ranking", "## Failure taxonomy: by reason", "## Comparison with 'old'"):
        assert title in proc.stdout
    assert re.search(r"\| gemm\s+\| gemm_triton\s+\| alice", proc.stdout)
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(PLOTS)
    assert not re.search(r"""(src|href)=['"](?!data:)""", page), "the page must not load anything from outside"


def test_comparison_in_the_report_finds_the_regressions(store: Path, tmp_path: Path) -> None:
    report = build_report(store, tmp_path, sweep="new", baseline="old")
    summary = dict(next(s for s in report.sections if s.title.startswith("Comparison")).tables)["summary"]
    gemm = summary.filter(summary["definition"] == "gemm").to_dicts()[0]
    assert (gemm["regression"], gemm["unchanged"]) == (4, 4)


def test_without_sweep_the_latest_one_is_reported(store: Path, tmp_path: Path) -> None:
    report = build_report(store, tmp_path)
    assert report.sweep == "new"
    assert any("reporting the latest, 'new'" in n for n in report.notes)


def test_a_missing_store_is_a_clear_error_and_nothing_is_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main(["--store", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_an_empty_store_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--store", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "holds no trace files" in capsys.readouterr().err


def test_an_unknown_sweep_is_named(store: Path, tmp_path: Path) -> None:
    with pytest.raises(AnalysisError, match="'typo'.*it has: new, old"):
        build_report(store, tmp_path, sweep="typo")
    with pytest.raises(AnalysisError, match="baseline-sweep"):
        build_report(store, tmp_path, sweep="new", baseline="new")
