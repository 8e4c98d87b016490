"""`python -m fibray.promote` on the CPU: the hidden gate, the re-benchmark gate, the sanitizer and
shared-memory poison gates' not_run path, reviews, rollout steps and the stage table, over real Ray sweeps."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from _apply_fixtures import _solution
from _promote_fixtures import DEFINITION, SOLUTIONS, shared_ray, sweep_config, write_split_dataset

from fibray.promote.__main__ import main
from fibray.promote.gates import interval
from fibray.store import Gate, Outcome, PromotionLog, Stage, TraceStore
from fibray.sweep import run_sweep, validate_config

EVAL = {"warmup": 2, "iterations": 10, "trials": 1, "flush_l2": False}


def drifting(mark: Path) -> dict:
    """Honest and fast in the sweep; ten times slower once `mark` exists (as a kernel tuned to
    conditions that do not last would be): the re-benchmark must catch it."""
    return _solution(DEFINITION, "drifting", f"time.sleep(0.1 if os.path.exists({str(mark)!r}) else 0.002)\nreturn x * w",
                     header="import os\nimport time\nimport torch\n")


@pytest.fixture(scope="module")
def promoted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("promote")
    # where the candidate (an unprivileged user when the tests run as root) can see it: pytest's
    # own temporary folders are private to their user
    shared = Path(tempfile.mkdtemp(prefix="fibray-drift-"))
    shared.chmod(0o755)
    mark = shared / "drift"
    dataset = write_split_dataset(root / "d", [*SOLUTIONS, drifting(mark)])
    store = root / "store"
    with shared_ray():
        yield from _gated(dataset, store, mark)
    shutil.rmtree(shared, ignore_errors=True)


def _gated(dataset: Path, store: Path, mark: Path):
    run_sweep(validate_config(sweep_config(dataset, store, "base", dataset={"split": "public"}, eval=EVAL)))
    mark.write_text("")
    # a wide floor: two cores shared with other work stretch a 2 ms sleep's median up to 3x; the
    # drifting candidate moves 50x
    args = ["--store", str(store), "--dataset", str(dataset), "--workload-set", "toy", "--num-gpus", "1",
            "--ci-floor", "5", "--actor", "tests"]
    rc = main([*args, "--sweep", "base", "--solutions", f"{DEFINITION}_steady,{DEFINITION}_overfit,{DEFINITION}_drifting"])
    yield {"store": store, "dataset": dataset, "args": args, "rc": rc}


def history(store: Path, solution: str) -> list:
    return [r for r in PromotionLog(store).read() if r.solution == f"{DEFINITION}_{solution}"]


def gates(store: Path, solution: str) -> dict:
    return {r.gate: r for r in history(store, solution)}


@pytest.mark.slow
def test_overfitted_candidate_is_rejected_by_the_hidden_gate_and_skips_the_rest(promoted) -> None:
    rows = gates(promoted["store"], "overfit")
    assert promoted["rc"] == 0
    assert rows[Gate.HIDDEN].outcome is Outcome.FAILED and "2/2 hidden workloads failed" in rows[Gate.HIDDEN].reason
    assert Gate.MEMCHECK not in rows and Gate.REBENCH not in rows
    assert history(promoted["store"], "overfit")[-1].stage is Stage.REJECTED


@pytest.mark.slow
def test_hidden_results_are_stored_under_their_own_sweep_with_the_hidden_split(promoted) -> None:
    rows = TraceStore(promoted["store"]).read(sweep="base.hidden", columns=["solution", "split", "status"]).to_pylist()
    assert rows and {r["split"] for r in rows} == {"hidden"}
    assert {r["status"] for r in rows if r["solution"].endswith("overfit")} == {"INCORRECT_NUMERICAL"}


@pytest.mark.slow
def test_honest_candidate_passes_hidden_and_rebench_and_the_gpu_gates_are_not_run_on_cpu(promoted) -> None:
    rows = gates(promoted["store"], "steady")
    assert rows[Gate.HIDDEN].outcome is Outcome.PASSED and rows[Gate.REBENCH].outcome is Outcome.PASSED
    for g in (Gate.MEMCHECK, Gate.RACECHECK, Gate.INITCHECK, Gate.SYNCCHECK, Gate.SMEM_POISON):
        assert rows[g].outcome is Outcome.NOT_RUN and not rows[g].passed and rows[g].reason.startswith("not_run: ")
    last = history(promoted["store"], "steady")[-1]
    assert (last.gate, last.stage) == (Gate.AUTOMATED, Stage.CANDIDATE)  # never validated with a gate not run


@pytest.mark.slow
def test_rebench_runs_in_fresh_processes_and_rejects_a_candidate_whose_median_left_the_interval(promoted) -> None:
    rebench = TraceStore(promoted["store"]).read(sweep="base.rebench", columns=["isolation"]).to_pylist()
    row = gates(promoted["store"], "drifting")[Gate.REBENCH]
    assert rebench and {r["isolation"] for r in rebench} == {"isolated"}
    assert row.outcome is Outcome.FAILED and "outside" in row.reason
    assert all(w["verdict"] == "outside" for w in row.evidence["workloads"].values())
    assert history(promoted["store"], "drifting")[-1].stage is Stage.REJECTED


@pytest.mark.slow
def test_rejected_artifact_cannot_be_approved(promoted, capsys) -> None:
    assert main([*promoted["args"], "--approve", f"{DEFINITION}_overfit"]) == 2
    assert "is rejected" in capsys.readouterr().err


@pytest.mark.slow
def test_review_must_waive_gates_that_did_not_run_then_rollout_moves_forward_only(promoted, capsys) -> None:
    name = f"{DEFINITION}_steady"
    assert main([*promoted["args"], "--approve", name]) == 2
    assert "did not run (initcheck, memcheck, racecheck, smem_poison, synccheck)" in capsys.readouterr().err
    assert main([*promoted["args"], "--approve", name, "--waive", "memcheck,racecheck,initcheck,synccheck,smem_poison",
                 "--note", "CPU-only path; sanitizers and smem_poison waived"]) == 0
    review = history(promoted["store"], "steady")[-1]
    assert (review.gate, review.stage, review.actor) == (Gate.REVIEW, Stage.SHADOW, "tests")
    assert main([*promoted["args"], "--stage", name, "default"]) == 0
    assert main([*promoted["args"], "--stage", name, "canary"]) == 2
    assert "is default; it may go to demoted" in capsys.readouterr().err
    assert [r.stage for r in history(promoted["store"], "steady")][-2:] == [Stage.SHADOW, Stage.DEFAULT]
    # a serving artifact is not re-gated by accident
    assert main([*promoted["args"], "--sweep", "base", "--solutions", name, "--gates", "hidden"]) == 0
    assert "is default; gates not re-run" in capsys.readouterr().out
    assert history(promoted["store"], "steady")[-1].stage is Stage.DEFAULT


@pytest.mark.slow
def test_report_prints_a_stage_table_per_definition(promoted, capsys) -> None:
    assert main(["--store", str(promoted["store"]), "--report"]) == 0
    out = capsys.readouterr().out
    assert f"definition {DEFINITION}" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(DEFINITION + "_")}
    assert "rejected" in lines[f"{DEFINITION}_overfit"] and "FAILED" in lines[f"{DEFINITION}_overfit"]
    assert "not_run" in lines[f"{DEFINITION}_steady"]


def test_unknown_gate_is_an_error_naming_it(tmp_path: Path, capsys) -> None:
    assert main(["--store", str(tmp_path), "--dataset", str(tmp_path), "--sweep", "s", "--gates", "hidden,lint"]) == 2
    assert "--gates: unknown gate(s) lint" in capsys.readouterr().err


def test_interval_is_k_standard_errors_of_the_median_or_the_floor() -> None:
    row = {"latency_ms": 1.0, "latency_mean_ms": 1.0, "latency_cv": 0.2, "n_samples": 100}
    lo, hi = interval(row, k=3.0, floor=0.0)
    assert (lo, hi) == pytest.approx((1 - 3 * 1.2533 * 0.02, 1 + 3 * 1.2533 * 0.02))
    assert interval(row, k=3.0, floor=0.25) == pytest.approx((0.75, 1.25))
    assert interval({**row, "latency_ms": None}, 3.0, 0.1) is None




def test_a_bad_gate_sweep_tag_is_an_error_naming_it(tmp_path: Path, capsys) -> None:
    assert main(["--store", str(tmp_path), "--dataset", str(tmp_path), "--sweep", "s", "--tag", "a b"]) == 2
    assert "tag" in capsys.readouterr().err


def test_gate_sweeps_are_named_after_the_sweep_and_the_tag() -> None:
    from fibray.promote.gates import PromoteOptions, gate_sweep

    base = {"store": "s", "dataset": "d", "sweep": "nightly", "actor": "tests"}
    assert gate_sweep(PromoteOptions(**base), "hidden") == "nightly.hidden"
    assert gate_sweep(PromoteOptions(**base, tag="r2"), "rebench") == "nightly.rebench.r2"
