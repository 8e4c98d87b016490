"""apply(): dispatch from a real sweep's store, bucketing, compatibility, circuit breaker, switches.

One real Ray sweep of the toy dataset (tests/_apply_fixtures.py) feeds every test; each test
builds its own runtime from that store, so breakers and counters never leak between tests.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from _apply_fixtures import (
    MISSING_DEP_ENV, WORKLOAD_SIZES, inputs, scale, scale_into, sweep_toy, write_toy_dataset,
)

from fibray.apply import (
    DISABLE_ENV, ApplyConfig, apply, build_index, build_runtime, disable_apply, enable_apply, read_rows,
)
from fibray.apply.compat import running_environment
from fibray.dataset import load_dataset
from fibray.store import TraceStore

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(dataset, store) after one real sweep of the toy dataset."""
    root = tmp_path_factory.mktemp("apply")
    dataset, store = write_toy_dataset(root / "dataset"), root / "store"
    counts = sweep_toy(dataset, store)
    assert counts.get("PASSED", 0) > 0, counts
    return dataset, store


@pytest.fixture(autouse=True)
def no_runtime_left_behind():
    yield
    disable_apply()


def runtime(toy: tuple[Path, Path], *definitions: str, **config: object):
    dataset, store = toy
    return enable_apply(store, dataset, config=ApplyConfig(definitions=list(definitions), **config))


def fastest(store: Path, definition: str, n: int, among: set[str] | None = None) -> str:
    """The PASSED solution with the lowest median latency at n, read straight from the store."""
    rows = [r for r in TraceStore(store).read().to_pylist()
            if r["definition"] == definition and json.loads(r["axes"]) == {"n": n} and r["status"] == "PASSED"
            and (among is None or r["solution"] in among)]
    by_solution: dict[str, list[float]] = {}
    for r in rows:
        by_solution.setdefault(r["solution"], []).append(r["latency_ms"])
    return min(by_solution, key=lambda s: statistics.median(by_solution[s]))


def test_hit_runs_the_fastest_verified_solution_and_counts_it(toy):
    rt = runtime(toy, "scale_h64", max_atol=1e-2)
    f = apply("scale_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[0])
    assert torch.allclose(f(x, w), x * w, atol=1e-2, rtol=1e-2)
    s = rt.stats()
    winner = fastest(toy[1], "scale_h64", WORKLOAD_SIZES[0])
    assert (s.hits, s.misses, s.fallbacks) == (1, 0, 0)
    assert s.solution_calls[winner] == 1


def test_failed_solution_is_never_in_the_index(toy):
    rt = runtime(toy, "scale_h64", candidates_per_key=10)
    ranked = rt.dispatchers["scale_h64"].ranked
    assert all("scale_h64_wrong" not in {s.name for s in states} for states in ranked.values())
    assert rt.report.rejected["failed"] == len(WORKLOAD_SIZES)


def test_unseen_key_goes_to_fallback_when_policy_is_fallback(toy):
    rt = runtime(toy, "scale_h64", on_miss="fallback")
    calls = []
    f = apply("scale_h64")(lambda x, w: calls.append(1) or scale(x, w))
    x, w = inputs(5)
    assert torch.equal(f(x, w), x * w)
    assert calls == [1]
    assert (rt.stats().misses, rt.stats().hits, rt.stats().bucketed) == (1, 0, 0)


def test_unseen_key_is_served_by_the_winner_of_the_nearest_measured_key(toy):
    rt = runtime(toy, "bucket_h64")
    f = apply("bucket_h64")(scale)
    small, large = WORKLOAD_SIZES
    clean = {"bucket_h64_slow_small", "bucket_h64_slow_large"}
    f(*inputs(small + 1))   # nearest measured key: small
    f(*inputs(large - 8))   # nearest measured key: large
    calls = rt.stats().solution_calls
    assert fastest(toy[1], "bucket_h64", small, clean) != fastest(toy[1], "bucket_h64", large, clean)
    assert calls[fastest(toy[1], "bucket_h64", small, clean)] == 1
    assert calls[fastest(toy[1], "bucket_h64", large, clean)] == 1
    assert rt.stats().bucketed == 2


def test_solution_that_failed_at_a_measured_key_serves_only_keys_where_it_passed(toy):
    rt = runtime(toy, "bucket_h64")
    f = apply("bucket_h64")(scale)
    small = WORKLOAD_SIZES[0]
    assert fastest(toy[1], "bucket_h64", small) == "bucket_h64_small_only"
    f(*inputs(small))       # measured there: it passed, it is the fastest
    f(*inputs(small + 1))   # unmeasured: it failed at another key, so it is not extrapolated to
    assert rt.stats().solution_calls["bucket_h64_small_only"] == 1
    assert (rt.stats().hits, rt.stats().bucketed) == (1, 1)


def test_wrong_const_axis_is_a_miss_even_with_nearest_policy(toy):
    rt = runtime(toy, "scale_h64")
    f = apply("scale_h64")(scale)
    x, w = torch.randn(WORKLOAD_SIZES[0], 32), torch.randn(32)
    assert torch.equal(f(x, w), x * w)
    assert (rt.stats().misses, rt.stats().hits, rt.stats().bucketed) == (1, 0, 0)


@pytest.mark.parametrize("unlike", ["dtype", "non_contiguous", "autograd"])
def test_inputs_unlike_the_verified_ones_go_to_the_fallback(toy, unlike):
    rt = runtime(toy, "scale_h64")
    f = apply("scale_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[0])
    if unlike == "dtype":
        x, w = x.double(), w.double()
    elif unlike == "non_contiguous":
        x = torch.randn(x.shape[1], x.shape[0]).t()
    else:
        x.requires_grad_(True)
    y = f(x, w)
    assert torch.equal(y, x * w)
    assert (rt.stats().misses, rt.stats().hits) == (1, 0)


def rows_of(store: Path, definition: str) -> int:
    return sum(1 for r in read_rows(store) if r["definition"] == definition)


def rewritten_store(toy: tuple[Path, Path], tmp: Path, **columns: object) -> Path:
    """A copy of the toy store whose rows claim other values for some columns."""
    rows = TraceStore(toy[1]).read().to_pylist()
    for r in rows:
        r.update(columns)
        if "torch_version" in columns:
            r["libs"] = json.dumps({**json.loads(r["libs"]), "torch": columns["torch_version"]})
    TraceStore(tmp / "store").append(rows)
    return tmp / "store"


def test_rows_measured_on_other_hardware_are_not_used(toy, tmp_path):
    store = rewritten_store(toy, tmp_path, hardware="NVIDIA H200")
    rt = enable_apply(store, toy[0], config=ApplyConfig(definitions=["scale_h64"]))
    f = apply("scale_h64")(scale)
    f(*inputs(WORKLOAD_SIZES[0]))
    assert rt.dispatchers == {}
    assert rt.report.rejected["incompatible_hardware"] == rows_of(store, "scale_h64") > 0
    assert (rt.stats().misses, rt.stats().hits) == (1, 0)


def test_rows_measured_with_another_torch_version_are_not_used(toy, tmp_path):
    store = rewritten_store(toy, tmp_path, torch_version="1.13.1")
    rt = enable_apply(store, toy[0], config=ApplyConfig(definitions=["scale_h64"]))
    assert rt.dispatchers == {}
    assert rt.report.rejected["incompatible_torch"] == rows_of(store, "scale_h64") > 0


def test_rows_judged_looser_than_the_configured_tolerance_are_not_used(toy):
    strict = runtime(toy, "scale_h64", max_atol=1e-6, max_rtol=1e-6, candidates_per_key=10)
    names = {s.name for states in strict.dispatchers["scale_h64"].ranked.values() for s in states}
    assert "scale_h64_approx" not in names   # fp16 products: errors ~1e-3, judged with atol 1e-2
    assert "scale_h64_torch" in names         # exact: its measured max error (0) proves the bound
    assert strict.report.rejected["outside_tolerance"] == len(WORKLOAD_SIZES)


def test_rows_of_a_since_changed_definition_are_not_used(toy):
    dataset, store = toy
    ds = load_dataset(dataset, definitions=["scale_h64"], require_blobs=False)
    new_reference = "import torch\n\ndef run(x, w):\n    return w * x\n"
    changed = ds.definitions["scale_h64"].model_copy(update={"reference": new_reference})
    index, report = build_index(read_rows(store), {"scale_h64": changed}, ds.solutions.values(),
                                running_environment(), ApplyConfig())
    assert "scale_h64" not in index
    assert report.rejected["stale"] == rows_of(store, "scale_h64")


def test_exception_falls_back_for_that_call_and_switches_the_solution_off(toy):
    rt = runtime(toy, "fragile_h64")
    f = apply("fragile_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[0], magnitude=1000.0)
    assert torch.equal(f(x, w), x * w)                     # the raising winner never reaches the caller
    f(*inputs(WORKLOAD_SIZES[0]))                         # ordinary inputs: the runner-up now serves
    s = rt.stats()
    assert s.fallbacks == 1 and "fragile_h64_raises" in s.switched_off
    assert s.solution_calls == {"fragile_h64_raises": 0, "fragile_h64_steady": 1}


def test_non_finite_output_falls_back_for_that_call_and_switches_the_solution_off(toy):
    rt = runtime(toy, "overflow_h64")
    f = apply("overflow_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[0], magnitude=1000.0)     # products ~1e6 overflow float16
    y = f(x, w)
    assert torch.isfinite(y).all() and torch.equal(y, x * w)
    s = rt.stats()
    assert s.fallbacks == 1 and s.switched_off["overflow_h64_fp16"] == "returned non-finite outputs"
    f(*inputs(WORKLOAD_SIZES[0]))
    assert rt.stats().solution_calls["overflow_h64_steady"] == 1


def test_environment_switch_disables_every_substitution(toy, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    rt = runtime(toy, "scale_h64")
    calls = []
    f = apply("scale_h64")(lambda x, w: calls.append(1) or scale(x, w))
    f(*inputs(WORKLOAD_SIZES[0]))
    assert not rt.active and rt.disabled_reason and calls == [1]
    assert (rt.stats().hits, rt.stats().misses) == (0, 0)


def test_disable_apply_sends_every_later_call_to_the_fallback(toy):
    rt = runtime(toy, "scale_h64")
    f = apply("scale_h64")(scale)
    f(*inputs(WORKLOAD_SIZES[0]))
    disable_apply()
    f(*inputs(WORKLOAD_SIZES[0]))
    assert not rt.active and rt.stats().hits == 1


def test_winner_whose_build_fails_is_dropped_and_the_runner_up_serves(toy, monkeypatch):
    monkeypatch.setenv(MISSING_DEP_ENV, "1")
    rt = runtime(toy, "portable_h64")
    f = apply("portable_h64")(scale)
    f(*inputs(WORKLOAD_SIZES[0]))
    s = rt.stats()
    assert "portable_h64_needs_dep" in s.dropped_builds
    assert s.solution_calls == {"portable_h64_plain": 1}


def test_destination_passing_winner_gets_outputs_allocated_from_the_definition(toy):
    rt = runtime(toy, "scale_h64", candidates_per_key=10)
    rt.switch_off("scale_h64_torch")
    rt.switch_off("scale_h64_approx")
    f = apply("scale_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[1])
    y = f(x, w)
    assert torch.equal(y, x * w) and y.dtype == torch.float32
    assert rt.stats().solution_calls["scale_h64_dps"] == 1


def test_destination_passing_caller_gets_its_outputs_written(toy):
    rt = runtime(toy, "scale_h64")
    f = apply("scale_h64")(scale_into)
    x, w = inputs(WORKLOAD_SIZES[1])
    y = torch.full_like(x, float("nan"))
    f(x, w, y)
    assert torch.allclose(y, x * w, atol=1e-2, rtol=1e-2)
    assert rt.stats().hits == 1


def test_keyword_arguments_dispatch_like_positional_ones(toy):
    rt = runtime(toy, "scale_h64")
    f = apply("scale_h64")(scale)
    x, w = inputs(WORKLOAD_SIZES[0])
    assert torch.allclose(f(x, w=w), x * w, atol=1e-2, rtol=1e-2)
    assert rt.stats().hits == 1


def test_resolver_names_the_definition_from_the_arguments(toy):
    rt = runtime(toy, "scale_h64")
    f = apply(lambda x, w: f"scale_h{x.shape[-1]}")(scale)
    f(*inputs(WORKLOAD_SIZES[0]))
    f(torch.randn(2, 16), torch.randn(16))            # names scale_h16: no such definition
    s = rt.stats()
    assert (s.hits, s.misses) == (1, 1) and s.definitions["scale_h16"].misses == 1


def test_function_form_dispatches_like_the_decorator(toy):
    rt = runtime(toy, "scale_h64")
    x, w = inputs(WORKLOAD_SIZES[0])
    y = apply("scale_h64", args=(x, w), fallback=scale)
    assert torch.allclose(y, x * w, atol=1e-2, rtol=1e-2) and rt.stats().hits == 1


def test_index_is_built_from_the_store_without_polars(toy, monkeypatch):
    monkeypatch.setitem(sys.modules, "polars", None)   # any `import polars` now raises ImportError
    rt = build_runtime(toy[1], toy[0], config=ApplyConfig(definitions=["scale_h64"]))
    assert rt.dispatchers["scale_h64"].ranked


def test_a_process_that_served_winners_leaves_no_build_directory_behind(toy, tmp_path):
    """The winners' builds live in a directory of the process's own, which outlives no process."""
    import subprocess

    dataset, store = toy
    script = ("import torch\nfrom fibray.apply import ApplyConfig, enable_apply\n"
              f"rt = enable_apply({str(store)!r}, {str(dataset)!r}, config=ApplyConfig(definitions=['scale_h64']))\n"
              "assert rt.dispatchers['scale_h64'].ranked and rt._builds.root.is_dir() and any(rt._builds.root.iterdir())\n"
              "print(rt._builds.root)\n")
    env = {**__import__("os").environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    built = Path(out.stdout.strip().splitlines()[-1])
    assert built.parent == tmp_path and built.name.startswith("fibray-apply-")
    assert not built.exists() and not list(tmp_path.glob("fibray-apply-*"))
