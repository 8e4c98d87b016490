"""Inputs that expose bugs: outlier draws per dtype and definition, and a per-sweep secret salt
that no candidate can know (answers precomputed for the public seed fail)."""

from __future__ import annotations

import json
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from fibray.compile import BuildCache, bind
from fibray.dataset import load_dataset
from fibray.evaluate import Evaluator
from fibray.evaluate.inputs import InputError, materialize, random_tensor
from fibray.evaluate.run import Judge
from fibray.evaluate.environment import environment
from fibray.schema import Definition, EvalSettings, Job, RandomInputSpec, Solution, Workload
from fibray.store import TraceStore
from _sweep_helpers import REPO

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_outlier_draws_scale_a_fraction_within_the_dtypes_range(dtype):
    x = random_tensor((32, 4096), dtype, CPU, 7, RandomInputSpec()).float()
    big = x.abs() > 50
    assert torch.isfinite(x).all()
    assert 0.005 < big.float().mean().item() < 0.0101  # ~1% of the values, drawn with replacement
    assert x.abs().max().item() <= torch.finfo(dtype).max / 2
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert x.abs().max().item() > 500  # wide range: up to 1e3 x N(0,1)


def test_normal_draws_are_unchanged_without_a_key():
    """No key, normal distribution: the seeds and values of earlier sweeps (references stay comparable)."""
    import hashlib

    d = _scale_def()
    w = Workload.model_validate({"uuid": "w1", "axes": {"n": 8}, "inputs": {"x": {"type": "random"}}})
    x = materialize(d, w, root=Path("."), seed=0, trial=0, device=CPU)[0]
    old_seed = int(hashlib.sha256(b"0:w1:0:x").hexdigest()[:15], 16)
    gen = torch.Generator().manual_seed(old_seed)
    assert torch.equal(x, torch.randn((8,), generator=gen))


def _scale_def(**over) -> Definition:
    raw = {"name": "scale2", "op_type": "test", "axes": {"n": {"type": "var"}},
           "inputs": {"x": {"shape": ["n"], "dtype": "float32"}, "p": {"shape": ["n"], "dtype": "float32"}},
           "outputs": {"y": {"shape": ["n"], "dtype": "float32"}}, "reference": "def run(x, p):\n    return x * p\n"}
    raw.update(over)
    return Definition.model_validate(raw)


def test_a_definition_chooses_which_inputs_take_outliers_and_mixed_alternates_trials():
    d = _scale_def(random_inputs={"outlier_inputs": ["x"], "outlier_fraction": 0.05})
    w = Workload.model_validate({"uuid": "w", "axes": {"n": 4000}, "inputs": {"x": {"type": "random"}, "p": {"type": "random"}}})
    big = lambda t: (t.abs() > 50).float().mean().item()
    x0, p0 = materialize(d, w, root=Path("."), seed=0, trial=0, device=CPU, distribution="mixed")
    x1, p1 = materialize(d, w, root=Path("."), seed=0, trial=1, device=CPU, distribution="mixed")
    assert big(x0) == 0 and big(p0) == 0  # even trial: N(0,1)
    assert 0.03 < big(x1) <= 0.05 and big(p1) == 0  # odd trial: outliers in x only
    with pytest.raises(InputError, match="eval.input_distribution"):
        materialize(d, w, root=Path("."), seed=0, trial=0, device=CPU, distribution="uniform")


def test_a_definition_naming_an_unknown_outlier_input_is_refused():
    with pytest.raises(ValueError, match="random_inputs.outlier_inputs: \\['z'\\] are not inputs"):
        _scale_def(random_inputs={"outlier_inputs": ["z"]})


def test_the_input_distribution_is_part_of_a_jobs_identity_but_old_ids_are_kept():
    ds = _core(["rmsnorm_h4096_torch"])
    d, w, sol = ds.definitions["rmsnorm_h4096"], ds.workloads["rmsnorm_h4096"][0], ds.solutions["rmsnorm_h4096_torch"]
    normal = Job.make_id(d, w, sol, EvalSettings())
    assert Job.make_id(d, w, sol, EvalSettings(input_distribution="outliers")) != normal
    from fibray.schema.job import content_hash

    before = EvalSettings().model_dump(mode="json")
    for later in ("input_distribution", "timing"):  # how a job id was computed before these settings existed
        del before[later]
    assert normal == content_hash(d.to_json_dict(), w.to_json_dict(), sol.name, sol.hash, before)


def test_the_sweep_salt_is_drawn_once_kept_private_and_reused_on_resume(tmp_path):
    store = TraceStore(tmp_path)
    salt = store.sweep_salt("s1")
    assert len(salt) == 32 and store.sweep_salt("s1") == salt and store.sweep_salt("s2") != salt
    path = tmp_path / "_secrets" / "sweep=s1"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not list(tmp_path.glob("**/*.parquet"))  # nothing a reader of the store sees
    other = TraceStore(tmp_path / "other")
    assert other.sweep_salt("s1", adopt=salt) == salt == other.sweep_salt("s1")  # a second store sharing the inputs
    from fibray.store.writer import StoreError

    with pytest.raises(StoreError, match="already has a different input salt"):
        other.sweep_salt("s1", adopt=b"x" * 32)


def _core(solutions: list[str], roots: list[Path] | None = None):
    return load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=roots or [REPO / "solutions"],
                        solutions=solutions, workload_set="cpu_small")


def _candidate_job(name: str, settings: EvalSettings, key: str | None = None, workload: int = 1) -> Job:
    ds = _core([f"offender_{name}"], [REPO / "tests" / "candidates"])
    sol = ds.solutions[f"offender_{name}"]
    job = Job(job_id=f"inputs-{name}-{settings.input_distribution}-{key}", sweep="t", definition=ds.definitions["rmsnorm_h4096"],
              workload=ds.workloads["rmsnorm_h4096"][workload], solution=sol, settings=settings, dataset_root=str(ds.root))
    return job.salted(key.encode()) if key else job


def test_answers_precomputed_for_the_public_seed_are_right_unsalted_and_wrong_salted(tmp_path):
    """The judge's trial inputs and references against the candidate's looked-up answers: all
    right for the public seed, all wrong once the sweep's salt is in the seeds."""
    s = EvalSettings(warmup=1, iterations=3, trials=3)
    judge = Judge(tmp_path / "judge", CPU, environment(CPU))
    runnable = bind(BuildCache(tmp_path / "builds").get(_candidate_job("hardcoded_unsalted", s).solution),
                    _candidate_job("hardcoded_unsalted", s).definition)
    from fibray.check import checker_for
    from fibray.evaluate.inputs import allocate_outputs

    for key, ok in ((None, True), ("sweep-secret", False)):
        job = _candidate_job("hardcoded_unsalted", s, key)
        state = judge.state(job)
        tol, kind = judge.tolerance(job)
        verdicts = []
        for t in range(s.trials):
            outs = allocate_outputs(job.definition, job.workload.axes, CPU)
            runnable.fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in state.inputs[t]], *outs)
            verdicts.append(checker_for(kind)(outs, state.refs[t], list(job.definition.outputs), tol).ok)
        assert verdicts == [ok] * s.trials, key


def test_a_salted_job_with_precomputed_answers_does_not_pass():
    ev = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-salt-"))).evaluate(
        _candidate_job("hardcoded_unsalted", EvalSettings(warmup=1, iterations=3, trials=2), "sweep-secret"))
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "tolerance_exceeded"), ev.log[-500:]


@pytest.mark.parametrize("distribution, status", [("normal", "PASSED"), ("outliers", "INCORRECT_NUMERICAL"),
                                                  ("mixed", "INCORRECT_NUMERICAL")])
def test_an_fp16_overflow_passes_on_normal_inputs_and_fails_on_outliers(distribution, status):
    s = EvalSettings(warmup=1, iterations=3, trials=2, input_distribution=distribution)
    ev = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-outliers-"))).evaluate(_candidate_job("fp16_overflow", s))
    assert ev.status.value == status, ev.log[-500:]
    if status != "PASSED":
        assert ev.reason == "tolerance_exceeded"


def test_the_honest_control_passes_on_outliers():
    ds = _core(["rmsnorm_h4096_torch"])
    s = EvalSettings(warmup=1, iterations=3, trials=2, input_distribution="outliers")
    job = Job(job_id="outliers-control", sweep="t", definition=ds.definitions["rmsnorm_h4096"],
              workload=ds.workloads["rmsnorm_h4096"][1], solution=ds.solutions["rmsnorm_h4096_torch"], settings=s,
              dataset_root=str(ds.root)).salted(b"k")
    ev = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-outliers-"))).evaluate(job)
    assert ev.status.value == "PASSED", ev.log[-500:]
