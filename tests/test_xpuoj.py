"""Importing an XPU-OJ problem package gives a dataset fibray loads, with a faithful reference and a c_abi solution."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from fibray.compile.cache import ArtifactCache
from fibray.compile.cuda import c_abi_argtypes
from fibray.dataset import load_dataset
from fibray.interop.xpuoj import XpuojError, import_package, main, write_dataset
from fibray.evaluate.inputs import materialize

PACKAGE = Path(__file__).resolve().parent / "data" / "xpuoj" / "silu_scale"


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("xpuoj-dataset")
    assert main([str(PACKAGE), str(out)]) == 0
    return out


def test_imported_package_loads_as_a_dataset_with_one_workload_per_test_case(dataset_root: Path) -> None:
    ds = load_dataset(dataset_root)  # also checks every safetensors blob is there
    d = ds.definitions["xpuoj_silu_scale"]
    assert list(d.inputs) == ["x", "T", "H", "alpha"] and list(d.outputs) == ["y"]
    assert d.var_axes == ["T", "H"] and d.inputs["x"].shape == ["T", "H"]
    assert d.inputs["alpha"].shape is None and d.inputs["alpha"].dtype.value == "float32"
    assert (d.check.atol, d.check.rtol) == (0.01, 0.01)  # the problem's check() defaults
    assert [w.axes for w in ds.workloads[d.name]] == [{"T": 4, "H": 256}, {"T": 16, "H": 1024}, {"T": 33, "H": 512}]
    assert [s.name for s in ds.solutions_for(d.name)] == ["xpuoj_silu_scale_xpuoj_cuda"]


def test_imported_reference_reproduces_the_problem_baseline_on_the_stored_inputs(dataset_root: Path) -> None:
    ds = load_dataset(dataset_root)
    d = ds.definitions["xpuoj_silu_scale"]
    namespace: dict = {}
    exec(compile(d.reference, "<reference>", "exec"), namespace)
    spec = importlib.util.spec_from_file_location("_silu_problem", PACKAGE / "problem.py")
    problem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(problem)
    for w in ds.workloads[d.name]:
        x, t, h, alpha = materialize(d, w, root=dataset_root, seed=0, trial=0, device=torch.device("cpu"))
        expected = torch.zeros(t, h, dtype=torch.bfloat16)
        problem.baseline(x, expected, t, h, alpha)
        assert torch.equal(namespace["run"](x, t, h, alpha), expected)


@pytest.mark.slow
def test_imported_solution_compiles_and_takes_fibray_c_abi_order(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    sol = ds.solutions["xpuoj_silu_scale_xpuoj_cuda"]
    assert sol.spec.binding == "c_abi"
    result = ArtifactCache(tmp_path).ensure(sol)
    assert result.entry.status == "ok", result.entry.message
    p, f, i = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
    # fibray order: x, T, H, alpha | y | axes T, H -- the adapter reorders to the submission's (x, y, T, H, alpha)
    assert c_abi_argtypes(ds.definitions[sol.definition]) == [p, i, i, f, p, i, i]


def test_import_is_repeatable_and_never_overwrites_different_files(dataset_root: Path) -> None:
    again = import_package(PACKAGE)
    write_dataset(again, dataset_root)  # byte-identical: accepted
    renamed = import_package(PACKAGE)
    renamed.workloads[0] = renamed.workloads[0].model_copy(update={"uuid": "something-else"})
    with pytest.raises(XpuojError, match="overwrite"):
        write_dataset(renamed, dataset_root)


def test_package_without_a_problem_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "kernel.cu").write_text("extern \"C\" void run_kernel() {}\n")
    with pytest.raises(XpuojError, match="getTestCaseSize"):
        import_package(tmp_path)
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
