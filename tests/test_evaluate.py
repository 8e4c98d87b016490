"""One evaluation's parts: tolerance rules, inputs, the Triton interpreter's casts, timing stats."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from fibray.compile import BuildCache, BuildError, patch_interpreter_casts
from fibray.check import Tolerance, checker_for
from fibray.evaluate import Evaluator, bound_log
from fibray.evaluate.inputs import BlobCache, InputError, allocate_outputs, materialize
from fibray.schema import Definition, EvalSettings, Job, SafetensorsInput, Solution, Workload
from fibray.timing import LatencyStats


def test_elementwise_rule_is_atol_plus_rtol_times_ref():
    tol = Tolerance(atol=0.125, rtol=0.125)  # binary fractions: the boundary is exact
    ref = torch.tensor([8.0, 0.0])
    ok = checker_for("elementwise")([torch.tensor([9.125, 0.125])], [ref], ["y"], tol)  # 1.125 <= 0.125+1.0
    bad = checker_for("elementwise")([torch.tensor([9.25, 0.0])], [ref], ["y"], tol)
    assert ok.ok and not bad.ok
    assert bad.status.value == "INCORRECT_NUMERICAL" and bad.reason == "tolerance_exceeded"
    assert bad.max_abs == 1.25 and bad.extra["matched_ratio"] == 0.5


def test_matched_ratio_accepts_a_few_outliers_but_not_many():
    ref = torch.zeros(100)
    few = ref.clone(); few[:3] = 5.0
    many = ref.clone(); many[:10] = 5.0
    tol = Tolerance(atol=0.01, rtol=0.01, matched_ratio=0.95)
    assert checker_for("matched_ratio")([few], [ref], ["y"], tol).ok
    res = checker_for("matched_ratio")([many], [ref], ["y"], tol)
    assert not res.ok and res.extra["matched_ratio"] == pytest.approx(0.90)


@pytest.mark.parametrize("out, status, reason", [
    (torch.zeros(3, 2), "INCORRECT_SHAPE", "wrong_shape"),
    (torch.zeros(2, 3, dtype=torch.float64), "INCORRECT_DTYPE", "wrong_dtype"),
    (torch.tensor([[0.0, float("nan"), 0.0]] * 2), "INCORRECT_NUMERICAL", "non_finite_output"),
    (torch.tensor([[0.0, float("inf"), 0.0]] * 2), "INCORRECT_NUMERICAL", "non_finite_output"),
])
def test_structural_failures_are_classified(out, status, reason):
    res = checker_for("elementwise")([out], [torch.zeros(2, 3)], ["y"], Tolerance(1.0, 1.0))
    assert (res.status.value, res.reason) == (status, reason)


def test_interpreter_casts_fp32_to_bf16_like_the_gpu():
    """The interpreter truncates fp32->bf16; fibray's patch rounds to nearest even like a GPU."""
    import triton
    import triton.language as tl

    patch_interpreter_casts()

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    # values just above a bf16 half-ULP, exact ties to even, negatives, NaN
    x = torch.tensor([1.0 + 3 * 2**-9, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 3 * 2**-9), 3.14159, float("nan")])
    y = torch.empty_like(x, dtype=torch.bfloat16)
    cast[(1,)](x, y, x.numel(), BLOCK=8)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y[:-1].view(torch.int16), expected[:-1].view(torch.int16))
    assert math.isnan(float(y[-1]))


def _def(**over) -> Definition:
    raw = {
        "name": "scale", "op_type": "test",
        "axes": {"n": {"type": "var"}},
        "inputs": {"x": {"shape": ["n"], "dtype": "float32"}, "k": {"shape": None, "dtype": "float32"}},
        "outputs": {"y": {"shape": ["n"], "dtype": "float32"}},
        "reference": "def run(x, k):\n    return x * k\n",
    }
    raw.update(over)
    return Definition.model_validate(raw)


def test_random_inputs_depend_on_workload_trial_and_seed_only():
    d = _def()
    w = Workload.model_validate({"uuid": "w1", "axes": {"n": 5}, "inputs": {"x": {"type": "random"}, "k": {"type": "scalar", "value": 2.0}}})
    a = materialize(d, w, root=Path("."), seed=0, trial=0, device=torch.device("cpu"))
    b = materialize(d, w, root=Path("."), seed=0, trial=0, device=torch.device("cpu"))
    c = materialize(d, w, root=Path("."), seed=0, trial=1, device=torch.device("cpu"))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0]) and a[1] == 2.0


def test_safetensors_inputs_load_and_bad_keys_are_errors(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.arange(4, dtype=torch.float32)}, str(tmp_path / "blob.safetensors"))
    d = _def()
    good = Workload.model_validate({"uuid": "w", "axes": {"n": 4}, "inputs": {
        "x": {"type": "safetensors", "path": "blob.safetensors", "tensor_key": "x"}, "k": {"type": "scalar", "value": 1}}})
    args = materialize(d, good, root=tmp_path, seed=0, trial=0, device=torch.device("cpu"), blobs=BlobCache())
    assert args[0].tolist() == [0, 1, 2, 3]
    bad_key = good.model_copy(update={"inputs": {**good.inputs, "x": SafetensorsInput(path="blob.safetensors", tensor_key="y")}})
    with pytest.raises(InputError, match="tensor_key: 'y' not in"):
        materialize(d, bad_key, root=tmp_path, seed=0, trial=0, device=torch.device("cpu"))
    missing = good.model_copy(update={"inputs": {**good.inputs, "x": SafetensorsInput(path="gone.safetensors", tensor_key="x")}})
    with pytest.raises(InputError, match="not found"):
        materialize(d, missing, root=tmp_path, seed=0, trial=0, device=torch.device("cpu"))
    wrong_shape = Workload.model_validate({**good.model_dump(), "axes": {"n": 5}})
    with pytest.raises(InputError, match="blob shape"):
        materialize(d, wrong_shape, root=tmp_path, seed=0, trial=0, device=torch.device("cpu"))


def test_destination_outputs_start_poisoned():
    out = allocate_outputs(_def(), {"n": 4}, torch.device("cpu"))[0]
    assert torch.isnan(out).all()


def _solution(src: str, dps: bool, language: str = "python") -> Solution:
    return Solution.model_validate({
        "name": "cand", "definition": "scale", "author": "t",
        "spec": {"language": language, "target_hardware": ["cpu"], "entry_point": "main.py::run", "destination_passing_style": dps},
        "sources": [{"path": "main.py", "content": src}]})


def _evaluate(src: str, dps: bool = True, **settings):
    d = _def()
    w = Workload.model_validate({"uuid": "w", "axes": {"n": 64}, "inputs": {"x": {"type": "random"}, "k": {"type": "scalar", "value": 3.0}}})
    s = EvalSettings(**{"warmup": 1, "iterations": 3, "trials": 2, **settings})
    sol = _solution("import torch\n" + src, dps)
    job = Job(job_id="j", sweep="t", definition=d, workload=w, solution=sol, settings=s, dataset_root=".")
    return Evaluator(Path(tempfile.mkdtemp())).evaluate(job)


_UNFORMATTABLE = (
    "class _Hidden(type):\n"
    "    def __getattribute__(cls, name):\n"
    "        if name in ('__name__', '__qualname__', '__module__'):\n"
    "            raise RuntimeError('no name')\n"
    "        return super().__getattribute__(name)\n"
    "class Unformattable(Exception, metaclass=_Hidden):\n"
    "    def __str__(self):\n"
    "        raise Unformattable()\n"
    "    def __repr__(self):\n"
    "        raise RuntimeError('no repr')\n"
)
"""An exception whose message, repr, name and module all raise when read."""


@pytest.mark.parametrize("src, dps, status, reason", [
    ("def run(x, k, y):\n    y.copy_(x * k)\n", True, "PASSED", None),
    ("def run(x, k):\n    return x * k\n", False, "PASSED", None),
    ("def run(x, k, y):\n    pass\n", True, "INCORRECT_NUMERICAL", "non_finite_output"),
    ("def run(x, k, y):\n    y.copy_(x * k)\n    x.zero_()\n", True, "INCORRECT_NUMERICAL", "mutated_inputs"),
    ("def run(x, k):\n    y = x * k\n    x.add_(1)\n    return y\n", False, "INCORRECT_NUMERICAL", "mutated_inputs"),
    ("def run(x, k):\n    return x.mul_(k)\n", False, "INCORRECT_NUMERICAL", "output_aliases_input"),
    ("def run(x, k, y):\n    y.copy_(x * k)\n    torch.as_strided(y, (y.numel() + 8,), (1,)).fill_(0)\n", True, "INCORRECT_NUMERICAL", "out_of_bounds_write"),
    ("_cache = {}\ndef run(x, k, y):\n    key = x.data_ptr()\n    if key not in _cache:\n        _cache[key] = x * k\n    y.copy_(_cache[key])\n", True, "INCORRECT_NUMERICAL", "wrong_while_timed"),
    ("def run(x, k):\n    return x[:]\n", False, "INCORRECT_NUMERICAL", "output_aliases_input"),
    ("def run(x, k):\n    return x * k, x\n", False, "INCORRECT_SHAPE", "wrong_output_count"),
    ("def run(x, k, y):\n    raise SystemExit(3)\n", True, "RUNTIME_ERROR", "system_exit"),
    ("def run(x, k, y):\n    raise KeyboardInterrupt\n", True, "RUNTIME_ERROR", "keyboard_interrupt"),
    ("import nonexistent_module_xyz\ndef run(x, k, y):\n    pass\n", True, "COMPILE_ERROR", "import_error"),
    ("def helper(x):\n    return x\n", True, "COMPILE_ERROR", "missing_entry_symbol"),
    (_UNFORMATTABLE + "def run(x, k, y):\n    raise Unformattable()\n", True, "RUNTIME_ERROR", "exception"),
    (_UNFORMATTABLE + "raise Unformattable()\n", True, "COMPILE_ERROR", "import_error"),
])
def test_candidate_behaviours_map_to_status_and_reason(src, dps, status, reason):
    ev = _evaluate(src, dps)
    assert (ev.status.value, ev.reason) == (status, reason), ev.log[-800:]


def test_an_exception_that_cannot_be_formatted_still_shows_where_it_was_raised():
    from fibray.compile import format_raised

    ev = _evaluate(_UNFORMATTABLE + "def run(x, k, y):\n    raise Unformattable()\n")
    assert "message not shown" in ev.log and 'main.py", line 13, in run' in ev.log, ev.log[-800:]
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a  # a cycle of causes formats, each once
    assert format_raised(a).count("ValueError: a") == 1


def test_passed_evaluation_carries_latency_statistics():
    ev = _evaluate("def run(x, k, y):\n    y.copy_(x * k)\n")
    p = ev.performance
    assert p.n_samples == 6 and p.latency_ms > 0 and p.latency_p95_ms >= p.latency_ms
    assert p.speedup_factor == pytest.approx(p.reference_latency_ms / p.latency_ms)
    assert ev.environment.libs["torch"] == torch.__version__


def test_no_timed_call_sees_inputs_an_earlier_call_saw(tmp_path, monkeypatch):
    """A candidate that remembers the values it was called on (a cache keyed by content) must
    find nothing to reuse while timed: trials, warm-up and revisited timing sets are all changed
    before each timed call."""
    log = tmp_path / "seen.txt"
    monkeypatch.setenv("FIBRAY_TEST_SEEN", str(log))
    src = ("import os, hashlib\n"
           "def run(x, k, y):\n"
           "    with open(os.environ['FIBRAY_TEST_SEEN'], 'a') as f:\n"
           "        f.write(hashlib.sha1(x.numpy().tobytes()).hexdigest() + '\\n')\n"
           "    y.copy_(x * k)\n")
    trials, warmup = 2, 5
    ev = _evaluate(src, warmup=warmup, iterations=12, trials=trials)
    assert ev.status.value == "PASSED", ev.log[-800:]
    seen = log.read_text().split()
    timed = seen[trials + warmup: trials + warmup + ev.performance.n_samples]
    assert ev.performance.n_samples > 16 and len(timed) == ev.performance.n_samples  # more calls than distinct sets
    earlier = set(seen[: trials + warmup])
    assert len(set(timed)) == len(timed) and not earlier & set(timed)


def test_failed_build_is_cached_as_a_failure(tmp_path):
    cache = BuildCache(tmp_path)
    sol = _solution("def run(:\n", True)
    with pytest.raises(BuildError) as first:
        cache.get(sol)
    with pytest.raises(BuildError) as second:
        cache.get(sol)
    assert first.value is second.value and first.value.reason == "syntax_error"


def test_latency_stats_and_log_bounds():
    s = LatencyStats.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median_ms, s.p95_ms, s.n) == (3.0, 100.0, 5)
    assert s.cv == pytest.approx(math.sqrt(sum((v - 22) ** 2 for v in [1, 2, 3, 4, 100]) / 5) / 22)
    text = "head" + "x" * 10000 + "TAIL"
    bounded = bound_log(text, 1000)
    assert len(bounded) <= 1000 and bounded.startswith("head") and bounded.endswith("TAIL")


def test_interpreter_dot_on_bf16_matches_a_matmul():
    """Triton 3.9's interpreter multiplies bf16 bit patterns as integers; fibray widens them."""
    import triton
    import triton.language as tl

    patch_interpreter_casts()

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :])
        b = tl.load(b_ptr + r[:, None] * N + r[None, :])
        tl.store(c_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    c = torch.empty(16, 16, dtype=torch.float32)
    dot[(1,)](a, b, c, N=16)
    torch.testing.assert_close(c, a.float() @ b.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_fp8_inputs_survive_timing_with_revisited_input_sets():
    """Timing revisits input sets (more calls than distinct sets) and changes them before each
    call; fp8 tensors have no arithmetic, so their bytes are changed instead."""
    from fibray.dataset import load_dataset

    name = "gemm_fp8_block_scale_n1024_k2048"
    root = Path(__file__).resolve().parents[1] / "datasets" / "llm"
    ds = load_dataset(root, definitions=[name], workload_set="cpu_small", max_workloads_per_definition=1)
    sol = ds.solutions[f"{name}_torch"]
    job = Job(job_id="fp8-timing", sweep="t", definition=ds.definitions[name], workload=ds.workloads[name][0],
              solution=sol, settings=EvalSettings(warmup=1, iterations=40, trials=1), dataset_root=str(ds.root))
    ev = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-fp8-")), torch.device("cpu")).evaluate(job)
    assert ev.status.value == "PASSED", ev.log
    assert ev.performance.n_samples > 16  # more timed calls than distinct input sets: sets were revisited


@pytest.mark.parametrize("n", [50176, 200704])  # sizes where n * (1/n) < 1 in double precision
def test_matched_ratio_is_an_exact_count(n, monkeypatch):
    """On CUDA mean() multiplies by 1/n: 7 x 7168 outputs all within tolerance came out as
    0.9999999999999999 and failed. The ratio is a count divided by n, exactly 1.0 when all match."""
    from fibray.check.base import error_stats

    # this machine's mean() divides exactly; give it CUDA's rounding, which the ratio must not depend on
    monkeypatch.setattr(torch.Tensor, "mean", lambda self, *a, **k: self.sum(*a, **k) * (1.0 / self.numel()))

    ref = torch.randn(n, dtype=torch.float32)
    _, _, ratio = error_stats(ref.clone(), ref, Tolerance(atol=1e-2, rtol=1e-2))
    assert ratio == 1.0
    out = ref.clone()
    out[n // 2] += 1.0
    _, _, ratio = error_stats(out, ref, Tolerance(atol=1e-2, rtol=1e-2))
    assert ratio == (n - 1) / n
    assert n * (1.0 / n) < 1.0  # the rounding the old mean() was exposed to


def test_the_jobs_last_candidate_calls_are_inside_its_timing_window():
    """The timed calls, their check and the recheck (the job's last call of the candidate) happen in one
    exclusive hold of the GPU: a slot's window probes the GPU as it ends, so GPU work a job's calls leave
    running fails that job even when no later window (its workload's reference) follows."""
    from contextlib import contextmanager

    from fibray.evaluate.run import run_job

    open_holds: list[tuple[str, bool]] = []
    seen: list[tuple[str, tuple]] = []

    class RecordingGpu:
        @contextmanager
        def hold(self, phase, name, exclusive=False):
            open_holds.append((name, exclusive))
            try:
                with phase(name):
                    yield
            finally:
                open_holds.pop()

    ev = Evaluator(Path(tempfile.mkdtemp()))
    for op in ("trial", "time", "recheck"):
        real = getattr(ev.runner, op)

        def spy(*a, _op=op, _real=real, **k):
            seen.append((_op, tuple(open_holds)))
            return _real(*a, **k)
        setattr(ev.runner, op, spy)
    sol = _solution("import torch\ndef run(x, k, y):\n    y.copy_(x * k)\n", True)
    w = Workload.model_validate({"uuid": "w", "axes": {"n": 64}, "inputs": {"x": {"type": "random"}, "k": {"type": "scalar", "value": 3.0}}})
    job = Job(job_id="j", sweep="t", definition=_def(), workload=w, solution=sol,
              settings=EvalSettings(warmup=1, iterations=3, trials=2), dataset_root=".")
    result = run_job(job, ev.judge, ev.runner, gpu=RecordingGpu())
    assert result.status.value == "PASSED", result.log[-500:]
    window = (("timing", True),)
    assert [op for op, holds in seen if holds == window] == ["time", "recheck"]
    assert all(holds == () for op, holds in seen if op == "trial")  # trials hold nothing: the GPU is shared
