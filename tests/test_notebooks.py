"""The notebooks run top to bottom against a store written by the real smoke sweep, and draw their plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


@pytest.fixture(scope="module")
def smoke_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store made by `python -m fibray.sweep +experiment=smoke` (once for this module)."""
    work = tmp_path_factory.mktemp("smoke")
    store = work / "store"
    proc = subprocess.run(
        [sys.executable, "-m", "fibray.sweep", "+experiment=smoke", f"store.root={store}", "sweep.progress=false"],
        cwd=work, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return store


def _run(name: str, store: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("FIBRAY_STORE", str(store))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def _outputs(nb: nbformat.NotebookNode) -> tuple[int, str]:
    """(number of PNG images shown, all plain-text and HTML output joined)."""
    images, text = 0, []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            images += "image/png" in data
            text += [out.get("text", ""), data.get("text/plain", ""), data.get("text/html", "")]
    return images, "\n".join(text)


def test_committed_notebooks_carry_no_outputs() -> None:
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), path


def test_leaderboard_notebook_shows_the_tables_and_plots(smoke_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, text = _outputs(_run("leaderboard.ipynb", smoke_store, monkeypatch))
    assert images == 3  # fast_p, ranking, speedup by axis
    for expected in ("sweep 'smoke'", "fibray-team", "agent-x", "fast_1.5", "tied_with", "rmsnorm_h4096_torch"):
        assert expected in text


def test_failures_notebook_shows_the_taxonomy_and_its_plot(smoke_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, text = _outputs(_run("failures.ipynb", smoke_store, monkeypatch))
    assert images == 1
    for expected in ("syntax_error", "wrong_shape", "wrong_dtype", "tolerance_exceeded", "COMPILE_ERROR", "example_log"):
        assert expected in text


def test_report_command_runs_on_the_smoke_store(smoke_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "fibray.report", "--store", str(smoke_store), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rmsnorm_h4096_torch" in proc.stdout
    # the smoke store was timed on a CPU: its speedups mean nothing, so no speedup plots (issue 19)
    assert sorted(p.name for p in out.iterdir()) == ["failures.png", "ranking.png", "report.html"]
    from fibray.report.build import CPU_HIDDEN

    assert CPU_HIDDEN in (out / "report.html").read_text()
