"""The cuda/cpp builder: every CUDA source in the repo compiles with nvcc, errors are verdicts,
the c_abi calling convention is the documented one, and nothing runs where no GPU is."""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import subprocess
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from fibray.compile import BuildError, DeviceRequired, bind, builder_for
from fibray.compile.cache import ArtifactCache, CacheResult
from fibray.compile.cuda import CAbiArgumentError, c_abi_argtypes, c_abi_arguments, gencode_flags, load_artifact
from fibray.schema import Definition, EvalSettings, Job, RandomInput, Solution, Workload

REPO = Path(__file__).resolve().parents[1]
LLM = REPO / "datasets" / "llm"


def _cuda_solution_files() -> list[Path]:
    """Every solution JSON in the repo whose language needs nvcc or a C++ compiler."""
    found = []
    for path in sorted([*REPO.glob("datasets/*/solutions/**/*.json"), *REPO.glob("solutions/**/*.json"),
                        *REPO.glob("tests/**/*.json")]):
        try:
            sol = Solution.model_validate_json(path.read_text(encoding="utf-8"))
        except ValidationError:
            continue
        if sol.spec.language.value in ("cuda", "cpp"):
            found.append(path)
    return found


CUDA_SOLUTIONS = _cuda_solution_files()
FAULTS = json.loads((REPO / "tests" / "fault_expectations.json").read_text())
"""Offenders' designed verdicts: one that is to fail compiling (offender_includes_root_file) is not a broken solution."""


def _definition(name: str) -> Definition:
    return Definition.model_validate_json(next(LLM.glob(f"definitions/**/{name}.json")).read_text(encoding="utf-8"))


def _solution(name: str) -> Solution:
    return Solution.model_validate_json(next(LLM.glob(f"solutions/**/{name}.json")).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cuda-artifacts")


@pytest.fixture(scope="module")
def compiled(cache_dir: Path) -> dict[str, CacheResult]:
    """Each repo CUDA solution compiled once for the module, two at a time (nvcc is slow)."""
    cache = ArtifactCache(cache_dir)
    solutions = [Solution.model_validate_json(p.read_text(encoding="utf-8")) for p in CUDA_SOLUTIONS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip((s.name for s in solutions), pool.map(cache.ensure, solutions)))


def test_the_repo_has_cuda_solutions_in_both_bindings_for_the_three_llm_definitions() -> None:
    sols = [Solution.model_validate_json(p.read_text()) for p in CUDA_SOLUTIONS]
    pairs = {(s.definition, s.spec.binding) for s in sols if not s.name.endswith("_compile_error")}
    for definition in ("rmsnorm_h4096", "gemm_n4096_k4096", "gqa_paged_decode_h32_kv8_d128_ps1"):
        assert {(definition, "torch"), (definition, "c_abi")} <= pairs


@pytest.mark.slow
@pytest.mark.parametrize("path", CUDA_SOLUTIONS, ids=lambda p: p.stem)
def test_every_cuda_solution_in_the_repo_compiles_with_nvcc(path: Path, compiled: dict[str, CacheResult]) -> None:
    sol = Solution.model_validate_json(path.read_text(encoding="utf-8"))
    entry = compiled[sol.name].entry
    if sol.name.endswith("_compile_error") or FAULTS.get(sol.name, [])[:2] == ["COMPILE_ERROR", "nvcc_error"]:
        assert (entry.status, entry.reason) == ("failed", "nvcc_error")
        assert "error" in entry.message and "kernel.cu" in entry.message  # the compiler's own words
    else:
        assert entry.status == "ok", entry.message


@pytest.mark.slow
def test_compile_error_solution_is_a_compile_error_verdict_with_reason_nvcc_error(
        compiled: dict[str, CacheResult], cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fibray.evaluate import Evaluator

    monkeypatch.setenv("FIBRAY_BUILD_CACHE", str(cache_dir))  # the module already compiled it: reuse, don't rebuild
    definition, sol = _definition("rmsnorm_h4096"), _solution("rmsnorm_h4096_cuda_compile_error")
    workload = Workload(axes={"batch_size": 2}, inputs={"hidden_states": RandomInput(), "weight": RandomInput()}, uuid="cuda-ce")
    settings = EvalSettings(warmup=0, iterations=1, trials=1)
    job = Job(job_id=Job.make_id(definition, workload, sol, settings), sweep="t", definition=definition,
              workload=workload, solution=sol, settings=settings, dataset_root=str(LLM))
    ev = Evaluator(tmp_path).evaluate(job)
    assert (ev.status.value, ev.reason) == ("COMPILE_ERROR", "nvcc_error")
    assert "expected a \";\"" in ev.log


def test_unsupported_binding_is_a_build_error_naming_the_binding(tmp_path: Path) -> None:
    data = _solution("rmsnorm_h4096_cuda_c_abi").to_json_dict()
    data["spec"]["binding"] = "tvm-ffi"
    with pytest.raises(BuildError) as e:
        builder_for("cuda")(Solution.model_validate(data), tmp_path)
    assert e.value.reason == "unsupported_binding" and "tvm-ffi" in str(e.value)


@pytest.mark.slow
def test_c_abi_library_exports_only_the_entry_and_fibray_helpers(compiled: dict[str, CacheResult]) -> None:
    lib = compiled["gqa_paged_decode_h32_kv8_d128_ps1_cuda_c_abi"].path / "lib.so"
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    # Everything else is local, so two solutions in one worker never share a symbol (or a static).
    assert {line.split()[-1] for line in out.splitlines() if line.strip()} == {
        "run_kernel", "fibray_cabi_set_device", "fibray_cabi_last_error"}


@pytest.mark.slow
def test_c_abi_runnable_needs_its_definition_then_refuses_to_run_without_a_gpu(compiled: dict[str, CacheResult]) -> None:
    sol = _solution("rmsnorm_h4096_cuda_c_abi")
    runnable = load_artifact(sol, compiled[sol.name].path)
    x, w, y = torch.zeros(2, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16), torch.empty(2, 4096, dtype=torch.bfloat16)
    with pytest.raises(CAbiArgumentError, match="bound to its definition"):
        runnable(x, w, y)
    bound = bind(runnable, _definition("rmsnorm_h4096"))
    assert bound.destination_passing_style
    with pytest.raises(DeviceRequired):  # no GPU here, or tensors on the CPU on a GPU machine
        bound(x, w, y)


def test_c_abi_convention_is_inputs_then_outputs_then_var_axes_with_typed_scalars() -> None:
    d = _definition("gqa_paged_decode_h32_kv8_d128_ps1")
    p, f, i = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
    assert c_abi_argtypes(d) == [p, p, p, p, p, f, p, p, i, i, i, i]
    q, k, v = torch.zeros(3, 32, 128), torch.zeros(11, 1, 8, 128), torch.zeros(11, 1, 8, 128)
    indptr, indices = torch.tensor([0, 2, 5, 7], dtype=torch.int32), torch.arange(7, dtype=torch.int32)
    out, lse = torch.zeros(3, 32, 128), torch.zeros(3, 32)
    args = c_abi_arguments(d, [q, k, v, indptr, indices, 1, out, lse])
    assert args[:5] == [t.data_ptr() for t in (q, k, v, indptr, indices)]
    assert args[5] == 1.0 and isinstance(args[5], float)  # float32 scalar -> double, even when given as an int
    assert args[6:8] == [out.data_ptr(), lse.data_ptr()]
    assert args[8:] == [3, 11, 4, 7]  # batch_size, num_pages, len_indptr, num_kv_indices, in axes order


def test_c_abi_rejects_non_contiguous_tensors_and_wrong_argument_counts() -> None:
    d = _definition("rmsnorm_h4096")
    x, w, y = torch.zeros(4096, 2).t(), torch.zeros(4096), torch.zeros(2, 4096)
    with pytest.raises(CAbiArgumentError, match="contiguous"):
        c_abi_arguments(d, [x, w, y])
    with pytest.raises(CAbiArgumentError, match="2 inputs and 1 outputs"):
        c_abi_arguments(d, [x.contiguous(), w])


def test_fibray_cuda_arch_overrides_the_sm_90_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gencode_flags() == ["-gencode", "arch=compute_90,code=sm_90"]
    monkeypatch.setenv("FIBRAY_CUDA_ARCH", "sm_80,9.0a")
    assert gencode_flags() == ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("FIBRAY_CUDA_ARCH", "hopper")
    with pytest.raises(BuildError, match="FIBRAY_CUDA_ARCH"):
        gencode_flags()


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is not None, reason="CPU-only torch: the torch extension cannot be linked there")
def test_torch_binding_on_cpu_only_torch_is_compile_checked_and_raises_device_required(compiled: dict[str, CacheResult]) -> None:
    sol = _solution("rmsnorm_h4096_cuda_torch")
    runnable = load_artifact(sol, compiled[sol.name].path)
    assert runnable.meta["mode"] == "compile_only"
    with pytest.raises(DeviceRequired):
        runnable(torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16),
                 torch.zeros(1, 4096, dtype=torch.bfloat16))


_CPU_EXTENSION = r"""
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

void run(const at::Tensor& x, double alpha, at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && y.is_contiguous(), "float32, contiguous");
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) py[i] = px[i] * static_cast<float>(alpha);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
"""


@pytest.mark.slow
def test_cpp_torch_extension_is_built_imported_and_called_on_the_cpu(tmp_path: Path) -> None:
    sol = Solution.model_validate({
        "name": "scale_cpp", "definition": "scale", "author": "test",
        "spec": {"language": "cpp", "target_hardware": ["cpu"], "entry_point": "ext.cpp::run", "binding": "torch"},
        "sources": [{"path": "ext.cpp", "content": _CPU_EXTENSION}],
    })
    runnable = builder_for("cpp")(sol, tmp_path)
    assert runnable.meta["mode"] == "full"
    x, y = torch.arange(6, dtype=torch.float32), torch.empty(6)
    runnable(x, 2.5, y)
    assert torch.equal(y, x * 2.5)
    with pytest.raises(RuntimeError, match="float32, contiguous"):  # TORCH_CHECK surfaces as a Python error
        runnable(x.double(), 1.0, y)


@pytest.mark.slow
def test_missing_c_abi_entry_symbol_is_a_build_error(tmp_path: Path) -> None:
    sol = Solution.model_validate({
        "name": "nothing_exported", "definition": "d", "author": "test",
        "spec": {"language": "cuda", "target_hardware": ["cuda"], "entry_point": "k.cu::run_kernel", "binding": "c_abi"},
        "sources": [{"path": "k.cu", "content": "void run_kernel(void* p) { (void)p; }  // C++ linkage: mangled\n"}],
    })
    with pytest.raises(BuildError) as e:
        builder_for("cuda")(sol, tmp_path)
    assert e.value.reason == "missing_entry_symbol" and "extern \"C\"" in str(e.value)


@pytest.mark.slow
def test_artifact_description_names_binding_and_mode(compiled: dict[str, CacheResult]) -> None:
    art = json.loads((compiled["gemm_n4096_k4096_cuda_mma_c_abi"].path / "cuda_artifact.json").read_text())
    assert (art["binding"], art["mode"], art["library"]) == ("c_abi", "full", "lib.so")
