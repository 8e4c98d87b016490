"""apply() with require_promotion: only promoted artifacts serve; default serves, canary takes a
deterministic share and is compared, shadow runs beside the baseline and never answers; demotion
on exception, NaN/Inf, mismatch or P99 latency, recorded in the promotions table and the counters."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _apply_fixtures import TOY_EVAL, _definition, _solution, _write, inputs, scale
from _promote_fixtures import shared_ray

from fibray.apply import ApplyConfig, apply, disable_apply, enable_apply, prometheus_text
from fibray.dataset import load_dataset
from fibray.promote.artifact import artifact_of, running_environment_record
from fibray.store import Gate, Outcome, PromotionLog, PromotionRecord, Stage
from fibray.sweep import run_sweep, validate_config

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

D = "stage_h64"
SIZES = (2, 32)
BIG = 1000.0
"""Production-like magnitude: the sweep drew N(0, 1); the flawed candidates misbehave above 100."""
SOLUTIONS = [
    _solution(D, "torch", "return x * w"),
    _solution(D, "steady", "time.sleep(0.002)\nreturn x * w"),
    _solution(D, "shifty", "return x * w * (1.01 if x.abs().max() > 100 else 1.0)", author="agent-x"),
    _solution(D, "raises", "if x.abs().max() > 100:\n    raise ValueError('range not supported')\nreturn x * w",
              author="agent-x"),
    _solution(D, "laggy", "if x.abs().max() > 100:\n    time.sleep(0.005)\nreturn x * w", author="agent-x"),
    _solution(D, "overflows", "return (x.half() * w.half()).float()", author="agent-x"),
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stages")
    dataset, store = root / "d", root / "store"
    _write(dataset / "definitions" / "scale" / f"{D}.json", _definition(D))
    path = dataset / "workloads" / "toy" / "scale" / f"{D}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(
        f'{{"definition": "{D}", "solution": null, "evaluation": null, "workload": {{"uuid": "{D}-n{n}", '
        f'"axes": {{"n": {n}}}, "inputs": {{"x": {{"type": "random"}}, "w": {{"type": "random"}}}}}}}}\n' for n in SIZES))
    for sol in SOLUTIONS:
        _write(dataset / "solutions" / f"{sol['name']}.json", sol)
    with shared_ray():
        report = run_sweep(validate_config({
            "dataset": {"root": str(dataset), "workload_set": "toy"}, "store": {"root": str(store)},
            "sweep": {"name": "toy", "progress": False}, "cluster": {"num_gpus": 1}, "eval": TOY_EVAL}))
    assert report.counts == {"PASSED": len(SOLUTIONS) * len(SIZES)}, report.counts
    return dataset, store


@pytest.fixture(autouse=True)
def no_runtime_left_behind():
    yield
    disable_apply()


@pytest.fixture
def store(swept, tmp_path: Path) -> Path:
    """A copy of the swept store of this test's own, with no promotions yet."""
    shutil.copytree(swept[1], tmp_path / "store")
    return tmp_path / "store"


def promote(store: Path, dataset: Path, stages: dict[str, Stage], environment: dict | None = None) -> None:
    ds = load_dataset(dataset, require_blobs=False)
    rows = []
    for name, stage in stages.items():
        art = artifact_of(ds.solutions[f"{D}_{name}"], environment)
        rows.append(PromotionRecord(
            artifact_id=art.artifact_id, definition=D, solution=art.solution, solution_hash=art.solution_hash,
            recipe_hash=art.recipe_hash, environment_key=art.environment_key, environment=art.environment,
            stage=stage, gate=Gate.ROLLOUT, outcome=Outcome.PASSED, actor="tests"))
    PromotionLog(store).append(rows)


def runtime(store: Path, dataset: Path, **config: object):
    config.setdefault("compiled_dispatch", False)
    return enable_apply(store, dataset, config=ApplyConfig(definitions=[D], require_promotion=True, **config))


def counting(calls: list):
    def fallback(x, w):
        calls.append(1)
        return x * w
    return fallback


def test_only_promoted_artifacts_serve(swept, store) -> None:
    promote(store, swept[0], {"steady": Stage.DEFAULT})
    rt = runtime(store, swept[0], compiled_dispatch=True)
    f = apply(D)(scale)
    f(*inputs(SIZES[0]))
    s = rt.stats()
    assert s.solution_calls == {f"{D}_steady": 1}  # the faster torch solution PASSED but was never promoted
    assert s.not_promoted[f"{D}_torch"].startswith("no promotion record")


def test_without_promotion_records_every_call_uses_the_fallback(swept, store) -> None:
    rt = runtime(store, swept[0])
    calls: list = []
    apply(D)(counting(calls))(*inputs(SIZES[0]))
    assert calls == [1] and rt.stats().solution_calls == {}


@pytest.mark.parametrize("stage", [Stage.VALIDATED, Stage.CANDIDATE, Stage.REJECTED, Stage.DEMOTED])
def test_artifacts_not_in_a_serving_stage_do_not_serve(swept, store, stage) -> None:
    promote(store, swept[0], {"torch": stage})
    rt = runtime(store, swept[0])
    apply(D)(scale)(*inputs(SIZES[0]))
    assert rt.stats().solution_calls == {} and rt.stats().not_promoted[f"{D}_torch"].endswith(f"is {stage.value}")


@pytest.mark.parametrize("field", ["hardware", "driver", "cuda", "torch", "triton"])
def test_an_environment_change_makes_earlier_artifacts_ineligible(swept, store, field) -> None:
    promote(store, swept[0], {"torch": Stage.DEFAULT}, {**running_environment_record(), field: "upgraded"})
    rt = runtime(store, swept[0])
    apply(D)(scale)(*inputs(SIZES[0]))
    assert rt.stats().solution_calls == {} and f"{D}_torch" in rt.stats().not_promoted


def test_shadow_runs_beside_the_fallback_and_the_fallback_answers(swept, store) -> None:
    promote(store, swept[0], {"torch": Stage.SHADOW})
    rt = runtime(store, swept[0])
    answers = []
    f = apply(D)(lambda x, w: answers.append(x * w) or answers[-1])
    for seed in range(5):
        assert f(*inputs(SIZES[1], seed=seed)) is answers[-1]
    (art,) = rt.stats().artifacts.values()
    assert (art.stage, art.calls, art.counters.shadow_calls, art.counters.compared, art.demoted) == ("shadow", 0, 5, 5, None)


def test_shadow_mismatch_demotes_it_and_records_a_demoted_row(swept, store) -> None:
    promote(store, swept[0], {"shifty": Stage.SHADOW})
    rt = runtime(store, swept[0])
    f = apply(D)(scale)
    x, w = inputs(SIZES[1], magnitude=BIG)
    assert torch.equal(f(x, w), x * w)
    f(x, w)
    (art,) = rt.stats().artifacts.values()
    assert art.demoted.startswith("mismatch: output 0") and art.counters.shadow_calls == 1  # not run again
    row = PromotionLog(store).latest()[art.artifact_id]
    assert (row.stage, row.gate, row.outcome, art.demotion_recorded) == (Stage.DEMOTED, Gate.RUNTIME, Outcome.FAILED, True)
    assert row.reason == art.demoted and row.actor.startswith("apply@")


def test_canary_answers_its_fraction_of_calls_the_same_way_every_run(swept, store) -> None:
    promote(store, swept[0], {"torch": Stage.CANARY})
    served = []
    for _ in range(2):
        rt = runtime(store, swept[0], canary_fraction=0.25, canary_compare_first=0, canary_compare_fraction=0.0)
        calls: list = []
        f = apply(D)(counting(calls))
        pattern = []
        for i in range(400):
            before = len(calls)
            f(*inputs(SIZES[0], seed=i))
            pattern.append(len(calls) == before)
        (art,) = rt.stats().artifacts.values()
        assert art.counters.served == sum(pattern) and 90 <= sum(pattern) <= 110
        served.append(pattern)
        disable_apply()
    assert served[0] == served[1]


def test_canary_mismatch_on_a_compared_call_demotes_it_and_the_caller_gets_the_baseline(swept, store) -> None:
    promote(store, swept[0], {"shifty": Stage.CANARY, "steady": Stage.DEFAULT})
    rt = runtime(store, swept[0], canary_fraction=1.0)
    f = apply(D)(scale)
    x, w = inputs(SIZES[1], magnitude=BIG)
    assert torch.equal(f(x, w), x * w)  # steady (the default) answered: the canary was off by 1%
    s = rt.stats()
    shifty = next(a for a in s.artifacts.values() if a.solution == f"{D}_shifty")
    assert shifty.demoted.startswith("mismatch") and shifty.counters.mismatches == 1
    f(x, w)
    assert rt.stats().solution_calls[f"{D}_steady"] == 2


def test_canary_exception_demotes_it_and_the_caller_gets_the_baseline(swept, store) -> None:
    promote(store, swept[0], {"raises": Stage.CANARY})
    rt = runtime(store, swept[0], canary_fraction=1.0)
    x, w = inputs(SIZES[1], magnitude=BIG)
    assert torch.equal(apply(D)(scale)(x, w), x * w)
    (art,) = rt.stats().artifacts.values()
    assert art.demoted == "raised ValueError: range not supported" and art.counters.exceptions == 1


def test_non_finite_canary_output_demotes_it(swept, store) -> None:
    promote(store, swept[0], {"overflows": Stage.CANARY})
    rt = runtime(store, swept[0], canary_fraction=1.0)
    x, w = inputs(SIZES[1], magnitude=BIG)
    assert torch.equal(apply(D)(scale)(x, w), x * w)
    (art,) = rt.stats().artifacts.values()
    assert art.demoted == "returned non-finite outputs" and art.counters.non_finite == 1


def test_p99_latency_worse_than_the_baseline_over_a_window_demotes_it(swept, store) -> None:
    promote(store, swept[0], {"laggy": Stage.SHADOW})
    rt = runtime(store, swept[0], latency_window=8)
    f = apply(D)(scale)
    for seed in range(12):
        f(*inputs(SIZES[1], magnitude=BIG, seed=seed))
    (art,) = rt.stats().artifacts.values()
    assert art.demoted and art.demoted.startswith("P99 latency") and art.counters.shadow_calls == 8
    assert art.counters.p99_ms > 5 > art.counters.baseline_p99_ms


def test_a_default_that_fails_while_serving_is_demoted_and_recorded(swept, store) -> None:
    promote(store, swept[0], {"raises": Stage.DEFAULT})
    rt = runtime(store, swept[0])
    x, w = inputs(SIZES[1], magnitude=BIG)
    assert torch.equal(apply(D)(scale)(x, w), x * w)
    (art,) = rt.stats().artifacts.values()
    assert art.demoted.startswith("raised ValueError") and art.demotion_recorded is True
    assert PromotionLog(store).stages()[art.artifact_id] is Stage.DEMOTED


def test_a_demotion_the_store_cannot_take_is_still_counted(swept, store) -> None:
    promote(store, swept[0], {"raises": Stage.DEFAULT})
    rt = runtime(store, swept[0])
    shutil.rmtree(store / "_promotions")
    (store / "_promotions").write_text("no longer a folder")  # the store became unwritable there
    apply(D)(scale)(*inputs(SIZES[1], magnitude=BIG))
    (art,) = rt.stats().artifacts.values()
    assert art.demoted and art.demotion_recorded is False


def test_a_destination_passing_caller_of_a_shadow_gets_the_fallbacks_outputs(swept, store) -> None:
    promote(store, swept[0], {"shifty": Stage.SHADOW})
    rt = runtime(store, swept[0])
    f = apply(D)(lambda x, w, y: torch.mul(x, w, out=y))
    x, w = inputs(SIZES[1], magnitude=BIG)
    y = torch.empty_like(x)
    assert f(x, w, y) is y and torch.equal(y, x * w)
    assert next(iter(rt.stats().artifacts.values())).demoted.startswith("mismatch")


def test_prometheus_export_has_per_artifact_and_per_definition_counters(swept, store) -> None:
    promote(store, swept[0], {"torch": Stage.SHADOW})
    rt = runtime(store, swept[0])
    f = apply(D)(scale)
    for seed in range(3):
        f(*inputs(SIZES[0], seed=seed))
    text = prometheus_text(rt.stats())
    (art,) = rt.stats().artifacts
    assert f'fibray_apply_artifact_calls_total{{artifact="{art}",definition="{D}",solution="{D}_torch",stage="shadow",kind="shadow"}} 3' in text
    assert f'fibray_apply_artifact_demoted{{artifact="{art}",definition="{D}",solution="{D}_torch",stage="shadow"}} 0' in text
    assert "# TYPE fibray_apply_calls_total counter" in text
    assert all(line.startswith("#") or len(line.rsplit(" ", 1)) == 2 for line in text.strip().splitlines())
