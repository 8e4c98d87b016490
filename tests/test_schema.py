"""Contracts: FlashInfer Trace folders (the project's own fixture, and the real sample where
one is found) load losslessly; bad input fails naming file and field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fibray.dataset import DatasetError, load_dataset
from fibray.schema import Definition, Evaluation, Solution, Trace


def _all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl"))


def _round_trips(files: list[Path]) -> None:
    for path in files:
        lines = [path.read_text()] if path.suffix == ".json" else [l for l in path.read_text().splitlines() if l.strip()]
        model = Definition if "definitions" in path.parts else Solution if "solutions" in path.parts else Trace
        for line in lines:
            raw = json.loads(line)
            first = model.model_validate(raw)
            dumped = first.to_json_dict()
            assert dumped == raw, path
            assert model.model_validate_json(first.model_dump_json()) == first, path


def test_every_fixture_file_round_trips_losslessly(fixture_root):
    files = _all_files(fixture_root)
    assert {p.relative_to(fixture_root).parts[0] for p in files} == {"definitions", "workloads", "solutions", "traces"}
    _round_trips(files)


def test_fixture_loads_as_a_dataset_with_its_solutions_and_traces(fixture_root):
    ds = load_dataset(fixture_root)
    assert {k: len(v) for k, v in ds.workloads.items()} == {"rmsnorm_h64": 3, "gather_rows_d16": 2}
    assert set(ds.solutions) == {"rmsnorm_h64_torch", "gather_rows_d16_torch"}
    assert len(ds.traces) == 5 and {t.evaluation.status.value for t in ds.traces} == {"PASSED", "INCORRECT_NUMERICAL"}


def test_fixture_safetensors_input_is_read_from_its_blob_not_randomised(fixture_root):
    from safetensors.torch import load_file

    from fibray.evaluate.inputs import materialize

    ds = load_dataset(fixture_root, definitions=["gather_rows_d16"])
    d = ds.definitions["gather_rows_d16"]
    for w in ds.workloads["gather_rows_d16"]:
        src = w.inputs["indices"]
        stored = load_file(str(fixture_root / src.path))[src.tensor_key]
        for seed in (0, 1):
            args = dict(zip(d.inputs, materialize(d, w, root=fixture_root, seed=seed, trial=0, device="cpu")))
            assert torch.equal(args["indices"], stored) and args["scale"] == 0.5


def test_fixture_solutions_pass_on_their_workloads(fixture_root, tmp_path):
    from fibray.evaluate import Evaluator
    from fibray.schema import EvalSettings, Job

    ds = load_dataset(fixture_root)
    ev = Evaluator(tmp_path)
    s = EvalSettings(warmup=1, iterations=2, trials=1)
    for name, workloads in ds.workloads.items():
        sol = ds.solutions[f"{name}_torch"]
        for w in workloads:
            job = Job(job_id=f"{name}-{w.uuid}", sweep="t", definition=ds.definitions[name], workload=w, solution=sol,
                      settings=s, dataset_root=str(fixture_root))
            result = ev.evaluate(job)
            assert result.status.value == "PASSED", (name, result.reason, result.log[-300:])


def test_missing_safetensors_blob_is_reported_not_randomised(fixture_root, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(fixture_root, root)
    first = json.loads((root / "workloads" / "gather" / "gather_rows_d16.jsonl").read_text().splitlines()[0])
    (root / first["workload"]["inputs"]["indices"]["path"]).unlink()
    with pytest.raises(DatasetError) as e:
        load_dataset(root, definitions=["gather_rows_d16"])
    msg = str(e.value)
    assert "gather_rows_d16.jsonl:1" in msg
    assert "workload.inputs.indices.path" in msg and "not found" in msg


def test_every_sample_file_round_trips_losslessly(sample_root):
    files = _all_files(sample_root)
    assert len(files) > 150
    _round_trips(files)


def test_sample_gemm_and_rmsnorm_load_as_a_dataset(sample_root):
    ds = load_dataset(sample_root, definitions=["rmsnorm_h4096", "gemm_n128_k2048"], max_workloads_per_definition=2)
    assert set(ds.definitions) == {"rmsnorm_h4096", "gemm_n128_k2048"}
    assert [len(v) for v in ds.workloads.values()] == [2, 2]


def test_sample_missing_safetensors_blob_is_reported_not_randomised(sample_root):
    with pytest.raises(DatasetError) as e:
        load_dataset(sample_root, definitions=["gqa_paged_decode_h32_kv8_d128_ps1"])
    msg = str(e.value)
    assert "gqa_paged_decode_h32_kv8_d128_ps1.jsonl:1" in msg
    assert "workload.inputs.kv_indptr.path" in msg and "not found" in msg


def test_bundled_dataset_and_solutions_round_trip(repo):
    for path in sorted((repo / "solutions").rglob("*.json")) + sorted((repo / "datasets" / "core").rglob("*.json")):
        raw = json.loads(path.read_text())
        model = Solution if "solutions" in path.parts else Definition
        assert model.model_validate(raw).to_json_dict() == raw


def test_solution_hash_ignores_name_but_not_sources(repo):
    raw = json.loads(next((repo / "solutions").rglob("*_torch.json")).read_text())
    a = Solution.model_validate(raw)
    b = Solution.model_validate({**raw, "name": "renamed", "author": "someone"})
    c = Solution.model_validate({**raw, "sources": [{"path": "main.py", "content": raw["sources"][0]["content"] + "\n# x"}]})
    assert a.hash == b.hash != c.hash


def test_evaluation_requires_performance_only_when_passed():
    env = {"hardware": "cpu", "libs": {}}
    with pytest.raises(ValueError, match="performance"):
        Evaluation.model_validate({"status": "PASSED", "environment": env, "timestamp": "t",
                                   "correctness": {"max_relative_error": 0, "max_absolute_error": 0}})
    ok = Evaluation.model_validate({"status": "TIMEOUT", "environment": env, "timestamp": "t", "reason": "run_timeout"})
    assert ok.reason == "run_timeout"


# --- invalid input: each case names the file and the field, and writes nothing --------------

def _mini_dataset(tmp_path: Path, repo: Path) -> Path:
    root = tmp_path / "ds"
    shutil.copytree(repo / "datasets" / "core", root)
    return root


def _definition(root: Path) -> Path:
    return root / "definitions" / "rmsnorm" / "rmsnorm_h4096.json"


def _edit_json(path: Path, fn) -> None:
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))


def _solution_file(tmp_path: Path, repo: Path, fn) -> Path:
    folder = tmp_path / "sols"
    folder.mkdir(exist_ok=True)
    raw = json.loads((repo / "solutions" / "rmsnorm" / "rmsnorm_h4096" / "rmsnorm_h4096_triton.json").read_text())
    fn(raw)
    path = folder / "bad.json"
    path.write_text(json.dumps(raw))
    return folder


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("case, field", [
    ("malformed_json", "malformed JSON"),
    ("unknown_dtype", "inputs.weight.dtype"),
    ("undefined_axis", "inputs.weight.shape: axis 'hidden'"),
    ("reference_without_run", "reference: must define a top-level function 'run'"),
    ("duplicate_definition", "duplicate definition 'rmsnorm_h4096'"),
])
def test_bad_definition_fails_naming_file_and_field(tmp_path, repo, case, field):
    root = _mini_dataset(tmp_path, repo)
    path = _definition(root)
    if case == "malformed_json":
        path.write_text(path.read_text()[:-20])
    elif case == "unknown_dtype":
        _edit_json(path, lambda d: d["inputs"]["weight"].update(dtype="bfloat17"))
    elif case == "undefined_axis":
        _edit_json(path, lambda d: d["inputs"]["weight"].update(shape=["hidden"]))
    elif case == "reference_without_run":
        _edit_json(path, lambda d: d.update(reference="def forward(x):\n    return x\n"))
    elif case == "duplicate_definition":
        shutil.copy(path, path.with_name("copy.json"))
    before = _snapshot(tmp_path)
    with pytest.raises(DatasetError) as e:
        load_dataset(root)
    assert field in str(e.value)
    assert "rmsnorm_h4096.json" in str(e.value) or "copy.json" in str(e.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("case, field", [
    ("entry_point_missing", "spec.entry_point: file 'kernel.py' is not among sources"),
    ("absolute_path", "path: absolute paths are not allowed"),
    ("dotdot_path", "path: '..' is not allowed"),
    ("duplicate_source", "duplicate source path 'main.py'"),
    ("bad_entry_point", "spec.entry_point: expected 'file_path::symbol'"),
])
def test_bad_solution_fails_naming_file_and_field(tmp_path, repo, case, field):
    root = _mini_dataset(tmp_path, repo)
    edits = {
        "entry_point_missing": lambda s: s["spec"].update(entry_point="kernel.py::run"),
        "absolute_path": lambda s: s["sources"][0].update(path="/etc/main.py"),
        "dotdot_path": lambda s: s["sources"][0].update(path="../main.py"),
        "duplicate_source": lambda s: s["sources"].append(dict(s["sources"][0])),
        "bad_entry_point": lambda s: s["spec"].update(entry_point="main.py"),
    }
    folder = _solution_file(tmp_path, repo, edits[case])
    before = _snapshot(tmp_path)
    with pytest.raises(DatasetError) as e:
        load_dataset(root, solution_roots=[folder])
    assert field in str(e.value) and "bad.json" in str(e.value)
    assert _snapshot(tmp_path) == before


def test_duplicate_solution_names_across_roots_fail(tmp_path, repo):
    root = _mini_dataset(tmp_path, repo)
    folder = _solution_file(tmp_path, repo, lambda s: None)
    with pytest.raises(DatasetError, match="duplicate solution 'rmsnorm_h4096_triton'"):
        load_dataset(root, solution_roots=[repo / "solutions", folder])


def test_unknown_definition_name_suggests_close_match(repo):
    with pytest.raises(DatasetError, match="did you mean rmsnorm_h4096"):
        load_dataset(repo / "datasets" / "core", definitions=["rmsnorm_h4069"])


def test_missing_dataset_root_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="not a directory"):
        load_dataset(tmp_path / "nope")
