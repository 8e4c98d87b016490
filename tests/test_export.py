"""Exporting a real sweep's store rows gives a FlashInfer Trace folder that flashinfer-bench 0.1.2 loads unchanged."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fibray.dataset import load_dataset
from fibray.interop.export import ExportError, evaluation_from_row, export_store, main, torch_shim_solution
from fibray.schema import Definition, Solution
from fibray.store import TraceStore
from fibray.sweep import run_sweep, validate_config

REPO = Path(__file__).resolve().parents[1]
CORE, SOLUTIONS = REPO / "datasets" / "core", REPO / "solutions"
FIB_INSTALL = "pip install --no-deps flashinfer-bench==0.1.2 docstring-parser"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by the real smoke sweep, cut to two definitions so that it stays quick."""
    root = tmp_path_factory.mktemp("store")
    cfg = validate_config({
        "dataset": {"root": str(CORE), "workload_set": "cpu_small", "definitions": ["rmsnorm_h4096", "gemm_n128_k2048"],
                    "max_workloads_per_definition": 2},
        "solutions": {"roots": [str(SOLUTIONS)]},
        "store": {"root": str(root)},
        "sweep": {"name": "export", "progress": False},
        "eval": {"warmup": 1, "iterations": 3, "trials": 1},
    })
    report = run_sweep(cfg)
    assert report.recorded > 0
    return root


def _flashinfer_trace_set():
    try:
        from flashinfer_bench.data import TraceSet
    except ImportError:
        pytest.fail(f"flashinfer-bench 0.1.2 is needed for the round trip: {FIB_INSTALL}")
    return TraceSet


@pytest.mark.slow
def test_exported_sweep_loads_in_flashinfer_bench_with_the_same_traces_and_statuses(store: Path, tmp_path: Path,
                                                                                    capsys: pytest.CaptureFixture) -> None:
    TraceSet = _flashinfer_trace_set()
    out = tmp_path / "export"
    assert main(["--store", str(store), "--sweep", "export", "--dataset", str(CORE), "--solutions", str(SOLUTIONS),
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out.resolve()}: ")  # says what it wrote
    rows = TraceStore(store).read(sweep="export").to_pylist()
    ts = TraceSet.from_path(str(out))
    traces = [t for ts_list in ts.traces.values() for t in ts_list]
    assert len(traces) == len(rows)
    assert Counter((t.solution, t.workload.uuid, t.evaluation.status.value) for t in traces) == Counter(
        (r["solution"], r["workload_uuid"], r["status"]) for r in rows)
    assert len(set(Counter(r["status"] for r in rows))) >= 4  # the bundled candidates land on many verdicts
    used = {r["solution"] for r in rows}
    assert {s.name for sols in ts.solutions.values() for s in sols} == used
    assert set(ts.definitions) == {r["definition"] for r in rows}
    assert {w.workload.uuid for ws in ts.workloads.values() for w in ws} == {r["workload_uuid"] for r in rows}
    passed = next(t for t in traces if t.evaluation.status.value == "PASSED")
    assert passed.evaluation.performance.latency_ms > 0 and passed.evaluation.environment.hardware


@pytest.mark.slow
def test_exported_folder_also_loads_in_fibray(store: Path, tmp_path: Path) -> None:
    export_store(store, tmp_path / "out", datasets=[CORE], solution_roots=[SOLUTIONS], sweep="export")
    ds = load_dataset(tmp_path / "out")
    assert len(ds.traces) == TraceStore(store).read(sweep="export").num_rows
    assert all(t.evaluation is not None and t.solution in ds.solutions for t in ds.traces)


@pytest.mark.slow
def test_export_refuses_a_solution_whose_code_changed_since_the_sweep(store: Path, tmp_path: Path) -> None:
    changed = tmp_path / "solutions"
    for path in SOLUTIONS.rglob("*.json"):
        data = json.loads(path.read_text())
        if data["name"] == "rmsnorm_h4096_torch":
            data["sources"][0]["content"] += "\n# edited after the sweep\n"
        target = changed / path.relative_to(SOLUTIONS)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data))
    with pytest.raises(ExportError, match="rmsnorm_h4096_torch.*code changed"):
        export_store(store, tmp_path / "out", datasets=[CORE], solution_roots=[changed], sweep="export")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_refuses_a_folder_that_is_not_empty(store: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_store(store, tmp_path / "out", datasets=[CORE], solution_roots=[SOLUTIONS], sweep="export")


def test_nan_errors_export_as_strict_json_that_flashinfer_bench_reads() -> None:
    from fibray.schema import Trace, Workload

    TraceSet = _flashinfer_trace_set()  # noqa: F841  (fail clearly when flashinfer-bench is missing)
    from flashinfer_bench.data import Trace as FibTrace

    ev = evaluation_from_row({"status": "INCORRECT_NUMERICAL", "max_abs_error": None, "max_rel_error": float("inf"),
                              "log": "output aliases input", "hardware": "cpu", "libs": "{}",
                              "evaluation_timestamp": "2026-01-01T00:00:00+00:00", "reason": "output_aliases_input"})
    line = Trace(definition="d", workload=Workload(axes={}, inputs={}, uuid="u"), solution="s",
                 evaluation=ev).model_dump_json(exclude_unset=True)
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    corr = FibTrace.model_validate_json(line).evaluation.correctness
    assert corr.max_absolute_error != corr.max_absolute_error and corr.max_relative_error == float("inf")


def test_c_abi_solution_exports_as_a_torch_extension_calling_the_same_run_kernel() -> None:
    llm = REPO / "datasets" / "llm"
    sol = Solution.model_validate_json(
        (llm / "solutions/rmsnorm/rmsnorm_h4096/rmsnorm_h4096_cuda_c_abi.json").read_text())
    definition = Definition.model_validate_json((llm / "definitions/rmsnorm/rmsnorm_h4096.json").read_text())
    shim = torch_shim_solution(sol, definition)
    assert (shim.name, shim.spec.binding, shim.spec.entry_point) == (sol.name, "torch", "_fibray_torch_shim.cpp::run")
    assert [s.content for s in shim.sources[:-1]] == [s.content for s in sol.sources]  # kernel sources untouched
    code = shim.sources[-1].content
    assert 'extern "C" void run_kernel(const void*, const void*, void*, int64_t);' in code
    assert "run_kernel(a_hidden_states.data_ptr(), a_weight.data_ptr(), a_output.data_ptr(), a_hidden_states.size(0));" in code


def test_the_projects_own_fixture_loads_in_flashinfer_bench_as_in_fibray() -> None:
    """tests/fixtures/fib_trace is a FlashInfer Trace folder flashinfer-bench reads the way fibray does."""
    TraceSet = _flashinfer_trace_set()
    root = REPO / "tests" / "fixtures" / "fib_trace"
    ds = load_dataset(root)
    ts = TraceSet.from_path(str(root))
    assert set(ts.definitions) == set(ds.definitions)
    assert {s.name for sols in ts.solutions.values() for s in sols} == set(ds.solutions)
    assert {w.workload.uuid for ws in ts.workloads.values() for w in ws} == {
        w.uuid for ws in ds.workloads.values() for w in ws}
    theirs = Counter((t.solution, t.workload.uuid, t.evaluation.status.value) for ts_list in ts.traces.values() for t in ts_list)
    assert theirs == Counter((t.solution, t.workload.uuid, t.evaluation.status.value) for t in ds.traces)
