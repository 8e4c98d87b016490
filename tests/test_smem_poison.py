"""The shared-memory poison gate on the CPU: its PTX assembles, its bitwise comparison of real output
files, not_run (never passed) without a GPU, and its sandboxed runner end to end on CPU candidates."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _apply_fixtures import _definition, _solution
from safetensors.torch import save_file

from fibray.promote.sanitize_runner import SanitizeJob
from fibray.promote.sanitizer import run_tool
from fibray.promote.smem_poison import (
    OUTPUT_FILE, PATTERNS, RUNNER, Check, PoisonError, Verdict, check_of, compare_outputs, judge, poison_ptx,
    smem_poison_gate, unavailable,
)
from fibray.schema import Definition, Solution, Workload
from fibray.store import Gate, Outcome
from fibray.workers.process.sandbox import SandboxPolicy

DEFINITION = Definition.model_validate(_definition("scale_h64"))
WORKLOAD = Workload.model_validate({"uuid": "w-n4", "axes": {"n": 4},
                                    "inputs": {"x": {"type": "random"}, "w": {"type": "random"}}})


def ptxas() -> str | None:
    found = shutil.which("ptxas")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if not found and home and os.access(Path(home) / "bin" / "ptxas", os.X_OK):
            found = str(Path(home) / "bin" / "ptxas")
    return found


def job(body: str, tmp_path: Path, **kw: object) -> SanitizeJob:
    sol = Solution.model_validate(_solution("scale_h64", "s", body, **kw))
    return SanitizeJob(definition=DEFINITION, workload=WORKLOAD, solution=sol, dataset_root=str(tmp_path), device="cpu")


def outputs(folder: Path, *runs: dict[str, torch.Tensor]) -> Path:
    """Write one output file per call, as the runner does."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, tensors in enumerate(runs):
        save_file(tensors, str(folder / OUTPUT_FILE.format(i)))
    return folder


def bits(*words: int) -> torch.Tensor:
    """float32 elements with exactly these bit patterns."""
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("major, minor", [(9, 0), (8, 0)])
def test_the_poison_ptx_assembles_for_the_device_it_targets(tmp_path: Path, major: int, minor: int) -> None:
    exe = ptxas()
    if exe is None:
        pytest.skip("no ptxas (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    src = tmp_path / "poison.ptx"
    src.write_text(poison_ptx(major, minor))
    done = subprocess.run([exe, f"-arch=sm_{major}{minor}", str(src), "-o", str(tmp_path / "poison.cubin")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "poison.cubin").stat().st_size > 0
    assert f".target sm_{major}{minor}" in src.read_text() and ".extern .shared" in src.read_text()


def test_a_device_without_a_known_ptx_version_is_a_poison_error_naming_it() -> None:
    with pytest.raises(PoisonError, match="sm_99"):
        poison_ptx(9, 9)


def test_the_two_patterns_differ_in_every_bit_and_neither_is_a_float_nan_or_inf() -> None:
    a, again, b = PATTERNS
    assert a == again and a ^ b == 0xFFFFFFFF
    words = torch.tensor([a, b], dtype=torch.int64).to(torch.int32)  # wraps into int32 as the bits are
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.isfinite(words.view(dtype).float()).all(), dtype


def test_identical_outputs_pass(tmp_path: Path) -> None:
    y = torch.randn(4, 8)
    check = compare_outputs(outputs(tmp_path, {"y": y}, {"y": y.clone()}, {"y": y.clone()}))
    result = judge({"w-n4": check})
    assert check.verdict is Verdict.SAME and (result.gate, result.outcome) == (Gate.SMEM_POISON, Outcome.PASSED)


def test_outputs_that_change_with_the_pattern_fail_naming_the_workload_and_the_elements(tmp_path: Path) -> None:
    y = torch.randn(4, 8)
    other = y.clone()
    other[0, :3] += 1
    result = judge({"w-n4": compare_outputs(outputs(tmp_path, {"y": y}, {"y": y.clone()}, {"y": other}))})
    assert result.outcome is Outcome.FAILED
    assert "outputs change with the shared-memory poison pattern" in result.reason
    assert "w-n4" in result.reason and "y: 3 of 32 elements differ" in result.reason
    assert result.evidence["runs"][0]["differing"] == 3


def test_outputs_that_differ_under_the_same_pattern_are_not_run_never_passed(tmp_path: Path) -> None:
    y = torch.randn(4, 8)
    result = judge({"w-n4": compare_outputs(outputs(tmp_path, {"y": y}, {"y": y + 1}, {"y": y}))})
    assert result.outcome is Outcome.NOT_RUN and result.reason.startswith("not_run: ")
    assert "not deterministic run to run: a read of uninitialised shared memory cannot be told apart" in result.reason


def test_nan_payloads_and_signed_zeros_compare_bit_for_bit(tmp_path: Path) -> None:
    same = bits(0x7FC00001, 0x80000000, 0x3F800000)  # a NaN with a payload, -0.0, 1.0
    moved = bits(0x7FC00002, 0x00000000, 0x3F800000)  # another payload, +0.0: equal values or NaN, other bits
    assert compare_outputs(outputs(tmp_path / "a", {"y": same}, {"y": same.clone()}, {"y": same.clone()})).verdict \
        is Verdict.SAME  # by value NaN != NaN: it would look not deterministic
    check = compare_outputs(outputs(tmp_path / "b", {"y": same}, {"y": same.clone()}, {"y": moved}))
    assert (check.verdict, check.differing) == (Verdict.CHANGES, 2)


def test_bfloat16_and_several_outputs_are_compared_per_output(tmp_path: Path) -> None:
    y, s = torch.randn(16).to(torch.bfloat16), torch.arange(4, dtype=torch.int64)
    s2 = s.clone()
    s2[1] = 7
    check = compare_outputs(outputs(tmp_path, {"y": y, "s": s}, {"y": y.clone(), "s": s.clone()}, {"y": y.clone(), "s": s2}))
    assert check.verdict is Verdict.CHANGES and "s: 1 of 4 elements differ" in check.detail and "y:" not in check.detail


def test_a_missing_or_corrupt_output_file_fails_the_gate(tmp_path: Path) -> None:
    y = torch.randn(4)
    missing = compare_outputs(outputs(tmp_path / "m", {"y": y}, {"y": y}))
    corrupt = outputs(tmp_path / "c", {"y": y}, {"y": y}, {"y": y})
    (corrupt / OUTPUT_FILE.format(1)).write_bytes(b"\xff" * 40)
    for check, words in ((missing, "outputs_2.safetensors is missing"), (compare_outputs(corrupt), "unreadable")):
        result = judge({"w": check})
        assert result.outcome is Outcome.FAILED and words in result.reason, result.reason


def test_an_output_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    y = torch.randn(4)
    folder = outputs(tmp_path / "l", {"y": y}, {"y": y})
    outputs(tmp_path / "elsewhere", {"y": y})
    (folder / OUTPUT_FILE.format(2)).symlink_to(tmp_path / "elsewhere" / OUTPUT_FILE.format(0))
    check = compare_outputs(folder)
    assert check.verdict is Verdict.NO_OUTPUTS and judge({"w": check}).outcome is Outcome.FAILED


def test_a_failure_anywhere_outweighs_a_workload_that_could_not_be_compared() -> None:
    result = judge({"a": Check(Verdict.NOT_DETERMINISTIC, "x"), "b": Check(Verdict.TIMEOUT, "no answer within 8s"),
                    "c": Check(Verdict.SAME, "ok")})
    assert result.outcome is Outcome.FAILED and "1/3 workload(s) failed; b: timed out" in result.reason
    assert judge({}).outcome is Outcome.NOT_RUN


def test_a_poison_that_cannot_be_applied_is_not_run_not_a_failure_of_the_candidate() -> None:
    from fibray.promote.sanitize_runner import RUNNER_UNAVAILABLE
    from fibray.promote.sanitizer import ToolRun

    run = ToolRun(Gate.SMEM_POISON.value, "w", "error", RUNNER_UNAVAILABLE, None, 1.0,
                  "fibray.promote.smem_poison: s on w: PoisonError: cuModuleLoadData (PTX for sm_90) failed")
    result = judge({"w": check_of(run, 60)})
    assert result.outcome is Outcome.NOT_RUN and "cuModuleLoadData" in result.reason


def test_without_a_gpu_the_gate_is_not_run_with_the_reason(tmp_path: Path) -> None:
    from fibray.workers.start import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has a GPU")
    result = smem_poison_gate([job("return x * w", tmp_path)])
    assert result.outcome is Outcome.NOT_RUN and result.reason == "not_run: no GPU visible to this process (NVML counts none)"


def test_jobs_on_the_cpu_are_never_poisoned_so_never_judged(monkeypatch, tmp_path: Path) -> None:
    import fibray.workers.start as start

    monkeypatch.setattr(start, "visible_gpu_count", lambda: 1)  # past the GPU check, to the job's device
    why = unavailable([job("return x * w", tmp_path)], SandboxPolicy())
    assert why is not None and "not on the GPU" in why


def poisoned_run(sj: SanitizeJob) -> tuple:
    """The runner process as the gate starts it (sandboxed, bare): the run, the files it left, their check."""
    files: list[str] = []

    def inspect(workdir: Path) -> Check:
        files.extend(sorted(p.name for p in workdir.glob("outputs_*")))
        return compare_outputs(workdir)

    run = run_tool([], Gate.SMEM_POISON.value, sj, deadline_s=120, module=RUNNER, inspect=inspect)
    return run, files, run.found


@pytest.mark.slow
def test_the_runner_calls_a_candidate_three_times_and_saves_outputs_that_compare_equal(tmp_path: Path) -> None:
    run, files, check = poisoned_run(job("return x * w", tmp_path))
    assert (run.outcome, run.returncode) == ("clean", 0), run.tail
    assert files == [OUTPUT_FILE.format(i) for i in range(3)]
    assert check.verdict is Verdict.SAME and judge({"w-n4": check_of(run, 120)}).outcome is Outcome.PASSED


@pytest.mark.slow
def test_the_runner_zeroes_fresh_outputs_for_destination_passing_candidates(tmp_path: Path) -> None:
    # writes half of y: the other half must be the same zeros each call, not what the last call left
    run, files, check = poisoned_run(job("y[: y.shape[0] // 2] = x[: x.shape[0] // 2] * w", tmp_path, dps=True))
    assert run.outcome == "clean" and check.verdict is Verdict.SAME, (run.tail, check)


@pytest.mark.slow
def test_a_candidate_whose_third_call_differs_is_failed_end_to_end(tmp_path: Path) -> None:
    # on the CPU nothing is poisoned: a call counter stands in for an output that follows the pattern
    body = "global CALLS\nCALLS = globals().get('CALLS', 0) + 1\nreturn x * w * (2.0 if CALLS == 3 else 1.0)"
    run, _, check = poisoned_run(job(body, tmp_path))
    result = judge({"w-n4": check_of(run, 120)})
    assert result.outcome is Outcome.FAILED and "y: 256 of 256 elements differ" in result.reason, result.reason


@pytest.mark.slow
def test_a_candidate_that_differs_call_to_call_is_not_run_end_to_end(tmp_path: Path) -> None:
    run, _, check = poisoned_run(job("return x * w + torch.rand_like(x)", tmp_path))
    assert check.verdict is Verdict.NOT_DETERMINISTIC
    assert judge({"w-n4": check_of(run, 120)}).outcome is Outcome.NOT_RUN


@pytest.mark.slow
def test_a_candidate_that_raises_fails_the_gate_as_having_raised(tmp_path: Path) -> None:
    run, files, _ = poisoned_run(job("raise RuntimeError('boom')", tmp_path))
    result = judge({"w-n4": check_of(run, 120)})
    assert run.outcome == "runner_failed" and files == []
    assert result.outcome is Outcome.FAILED and "the candidate raised" in result.reason and "boom" in result.reason
