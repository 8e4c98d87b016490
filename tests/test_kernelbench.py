"""Importing KernelBench-style tasks gives a dataset fibray loads and sweeps: const axes, seeded weights as
shared blobs, a self-contained reference, a reference solution, and ModelNew candidates that pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fibray.compile import build_reference
from fibray.compile.base import BuildCache
from fibray.dataset import load_dataset
from fibray.evaluate.inputs import materialize
from fibray.interop.kernelbench import (
    BINDING, ENTRY_FILE, KernelBenchError, import_tasks, kernelbench_solution, main, wrap_model_new,
)
from fibray.schema import Solution

from _sweep_helpers import reachable_tmpdir

DATA = Path(__file__).resolve().parent / "data"
TASKS = DATA / "kernelbench"
CANDIDATES = DATA / "kernelbench_candidates"
MATMUL, CHAIN = "kb_level1_1_square_matmul", "kb_level2_2_conv_relu_groupnorm"
CPU = torch.device("cpu")


def _task_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_task_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dataset_root() -> Path:
    out = reachable_tmpdir("kb-dataset-") / "dataset"  # executors may run as another user
    assert main([str(TASKS), str(out), "--workloads", "3",
                 "--candidate", f"{CANDIDATES / 'matmul_triton_new.py'}={MATMUL}",
                 "--candidate", f"{CANDIDATES / 'conv_chain_new.py'}={CHAIN}"]) == 0
    return out


def test_tasks_become_definitions_with_a_const_axis_per_dimension_and_weights_as_inputs(dataset_root: Path) -> None:
    ds = load_dataset(dataset_root)  # validates every file and that every blob is there
    mm, chain = ds.definitions[MATMUL], ds.definitions[CHAIN]
    assert mm.var_axes == [] and list(mm.inputs) == ["A", "B"] and mm.const_axes["A_0"] == 64
    assert list(chain.inputs) == ["x", "scale", "conv_weight", "conv_bias", "group_norm_weight", "group_norm_bias"]
    assert chain.input_shapes({})["conv_weight"] == (8, 3, 3, 3) and chain.output_shapes({}) == {"output": (2, 8, 10, 10)}
    assert all(not chain.var_axes and len(ds.workloads[n]) == 3 for n in (MATMUL, CHAIN))
    blobs = {w.inputs["conv_weight"].path for w in ds.workloads[CHAIN]}
    assert len(blobs) == 1  # one weights blob that every workload shares
    assert sorted(s.name for s in ds.solutions_for(CHAIN)) == [f"{CHAIN}_conv_chain_new", f"{CHAIN}_reference"]


def test_weights_are_the_models_parameters_drawn_from_the_seed(dataset_root: Path) -> None:
    ds = load_dataset(dataset_root)
    task = _task_module(TASKS / "level2" / "2_conv_relu_groupnorm.py")
    torch.manual_seed(0)
    model = task.Model(*task.get_init_inputs())
    blob = load_file(str(dataset_root / ds.workloads[CHAIN][0].inputs["conv_weight"].path))
    assert torch.equal(blob["conv_weight"], model.conv.weight.detach())
    assert torch.equal(blob["scale"], model.scale.detach())


def test_reference_is_self_contained_and_reproduces_the_model_on_the_stored_inputs(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    task = _task_module(TASKS / "level2" / "2_conv_relu_groupnorm.py")
    torch.manual_seed(0)
    model = task.Model(*task.get_init_inputs())
    d = ds.definitions[CHAIN]
    run = build_reference(d.reference, d.name, tmp_path)  # the reference alone: no file beside it
    for w in ds.workloads[CHAIN]:
        args = materialize(d, w, root=dataset_root, seed=0, trial=0, device=CPU)
        with torch.no_grad():
            assert torch.allclose(run(*args), model(args[0]), atol=1e-6)


def test_reference_uses_the_weights_it_is_given(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    d = ds.definitions[CHAIN]
    run = build_reference(d.reference, d.name, tmp_path)
    args = materialize(d, ds.workloads[CHAIN][0], root=dataset_root, seed=0, trial=0, device=CPU)
    before = run(*args)
    args[1] = args[1] * 2  # scale
    assert torch.allclose(run(*args), before * 2, atol=1e-6)


def test_modelnew_candidates_match_the_reference_when_built_like_any_solution(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    cache = BuildCache(tmp_path)
    for name, cand in ((MATMUL, "matmul_triton_new"), (CHAIN, "conv_chain_new")):
        d = ds.definitions[name]
        sol = ds.solutions[f"{name}_{cand}"]
        assert sol.spec.binding is None and sol.entry_file == ENTRY_FILE  # flashinfer-bench accepts it
        ref = build_reference(d.reference, d.name, tmp_path / name)
        args = materialize(d, ds.workloads[name][1], root=dataset_root, seed=0, trial=0, device=CPU)
        assert torch.allclose(cache.get(sol)(*args), ref(*args), atol=1e-4, rtol=1e-4)
    assert ds.solutions[f"{MATMUL}_matmul_triton_new"].spec.language.value == "triton"


def test_a_raw_binding_kernelbench_solution_is_wrapped_into_a_runnable_one(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    d = ds.definitions[CHAIN]
    raw = Solution.model_validate({
        "name": "agent_chain", "definition": CHAIN, "author": "agent",
        "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "kernel.py::ModelNew",
                 "binding": BINDING, "destination_passing_style": False},
        "sources": [{"path": "kernel.py", "content": (CANDIDATES / "conv_chain_new.py").read_text()}],
    })
    sol = wrap_model_new(d, raw)
    assert sol.entry_file == ENTRY_FILE and sol.spec.binding is None
    args = materialize(d, ds.workloads[CHAIN][0], root=dataset_root, seed=0, trial=0, device=CPU)
    ref = build_reference(d.reference, d.name, tmp_path / "ref")
    assert torch.allclose(BuildCache(tmp_path).get(sol)(*args), ref(*args), atol=1e-4)
    assert wrap_model_new(d, ds.solutions[f"{CHAIN}_reference"]) is ds.solutions[f"{CHAIN}_reference"]


def test_a_candidate_that_renames_the_parameters_fails_with_a_message_naming_them(dataset_root: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset_root)
    d = ds.definitions[CHAIN]
    source = (CANDIDATES / "conv_chain_new.py").read_text().replace("self.conv ", "self.conv2d ").replace("self.conv.", "self.conv2d.")
    sol = kernelbench_solution(d, {"model_new.py": source}, name="renamed", author="t")
    args = materialize(d, ds.workloads[CHAIN][0], root=dataset_root, seed=0, trial=0, device=CPU)
    with pytest.raises(ValueError, match=r"no parameters \['conv.weight', 'conv.bias'\]"):
        BuildCache(tmp_path).get(sol)(*args)


@pytest.mark.parametrize("file, message", [
    ("no_model.py", "no top-level `class Model"),
    ("get_inputs_raises.py", "get_inputs() raised RuntimeError: the input generator is broken"),
    ("non_tensor_input.py", "get_inputs()[1] is a int, not a tensor"),
])
def test_a_bad_task_is_one_error_naming_the_file(file: str, message: str) -> None:
    with pytest.raises(KernelBenchError) as e:
        import_tasks(DATA / "kernelbench_bad" / file)
    assert str(e.value).count("\n") == 0 and str(e.value).startswith(str(DATA / "kernelbench_bad" / file))
    assert message in str(e.value)


def test_a_folder_with_bad_tasks_reports_each_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in [*(DATA / "kernelbench_bad").glob("*.py"), TASKS / "level1" / "1_square_matmul.py"]:
        (src / p.name).write_text(p.read_text())
    assert main([str(src), str(tmp_path / "out")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith(f"error: {src}/") for line in errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no staging folder left behind


def test_import_into_an_existing_folder_is_repeatable_and_never_replaces_different_files(dataset_root: Path) -> None:
    before = {p: p.read_bytes() for p in dataset_root.rglob("*") if p.is_file()}
    assert main([str(TASKS), str(dataset_root), "--workloads", "3"]) == 0  # byte-identical files: accepted
    assert main([str(TASKS), str(dataset_root), "--workloads", "3", "--seed", "1"]) == 2  # other weights: refused
    assert {p: p.read_bytes() for p in dataset_root.rglob("*") if p.is_file()} == before


def test_workload_inputs_are_the_tasks_get_inputs_under_seeds(dataset_root: Path) -> None:
    ds = load_dataset(dataset_root)
    task = _task_module(TASKS / "level1" / "1_square_matmul.py")
    torch.manual_seed(1)  # workload 0 uses seed + 1
    a, b = task.get_inputs()
    w = ds.workloads[MATMUL][0]
    stored = load_file(str(dataset_root / w.inputs["A"].path))
    assert torch.equal(stored["A"], a) and torch.equal(stored["B"], b)
    assert len({wl.uuid for wl in ds.workloads[MATMUL]}) == 3


def test_a_tampered_weights_blob_changes_the_reference_output(dataset_root: Path, tmp_path: Path) -> None:
    """The weights live in the blob, not in the reference: every run reads the same stored values."""
    ds = load_dataset(dataset_root)
    d, w = ds.definitions[CHAIN], ds.workloads[CHAIN][0]
    copy = tmp_path / "copy"
    for p in dataset_root.rglob("*"):
        if p.is_file():
            (copy / p.relative_to(dataset_root)).parent.mkdir(parents=True, exist_ok=True)
            (copy / p.relative_to(dataset_root)).write_bytes(p.read_bytes())
    blob = copy / w.inputs["conv_bias"].path
    tensors = load_file(str(blob))
    tensors["conv_bias"] = tensors["conv_bias"] + 1
    save_file(tensors, str(blob))
    run = build_reference(d.reference, d.name, tmp_path)
    a = run(*materialize(d, w, root=dataset_root, seed=0, trial=0, device=CPU))
    b = run(*materialize(d, w, root=copy, seed=0, trial=0, device=CPU))
    assert not torch.allclose(a, b)


def test_the_imported_dataset_loads_in_flashinfer_bench_and_its_reference_runs_there(dataset_root: Path) -> None:
    try:
        from flashinfer_bench.data import TraceSet
    except ImportError:
        pytest.fail("flashinfer-bench 0.1.2 is needed: pip install --no-deps flashinfer-bench==0.1.2 docstring-parser")
    ts = TraceSet.from_path(str(dataset_root))
    assert set(ts.definitions) == {MATMUL, CHAIN} and {len(v) for v in ts.workloads.values()} == {3}
    assert {s.name for s in ts.solutions[CHAIN]} == {f"{CHAIN}_reference", f"{CHAIN}_conv_chain_new"}
    ds = load_dataset(dataset_root)
    namespace: dict = {}
    exec(compile(ts.definitions[CHAIN].reference, "<fib reference>", "exec"), namespace)  # nothing beside it
    args = materialize(ds.definitions[CHAIN], ds.workloads[CHAIN][0], root=dataset_root, seed=0, trial=0, device=CPU)
    assert namespace["run"](*args).shape == (2, 8, 10, 10)


@pytest.mark.slow
def test_sweep_of_the_imported_dataset_passes_the_reference_and_the_modelnew_candidates(dataset_root: Path) -> None:
    import ray

    from fibray.store import scan
    from fibray.sweep import run_sweep, validate_config

    store = reachable_tmpdir("kb-store-")
    cfg = validate_config({
        "dataset": {"root": str(dataset_root)}, "store": {"root": str(store)},
        "sweep": {"name": "kernelbench", "progress": False}, "eval": {"warmup": 0, "iterations": 2, "trials": 1},
    })
    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = run_sweep(cfg)
    finally:
        ray.shutdown()
    df = scan(store).collect()
    assert report.recorded == 2 * 2 * 3 and df.height == 12
    assert set(df["status"].to_list()) == {"PASSED"}, df.select("solution", "status", "reason", "log").to_dicts()
    assert json.loads(df["axes"][0]) == {}
