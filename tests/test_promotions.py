"""The promotions table: append-only files, latest stage per artifact, artifact identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fibray.dataset import load_dataset
from fibray.promote import artifact_of, environment_key, recipe_hash
from fibray.store import (
    PROMOTIONS_DIR, Gate, Outcome, PromotionLog, PromotionRecord, Stage, StoreError, TraceStore, scan,
)

REPO = Path(__file__).resolve().parents[1]
ENV = {"hardware": "NVIDIA H200", "driver": "570.86.15", "cuda": "12.8", "torch": "2.11.0+cu128", "triton": "3.6.0"}


def record(artifact: str, stage: Stage, gate: Gate = Gate.HIDDEN, outcome: Outcome = Outcome.PASSED,
           **extra: object) -> PromotionRecord:
    return PromotionRecord(artifact_id=artifact, definition="d", solution="s", solution_hash="h", recipe_hash="r",
                           environment_key="e", environment=ENV, stage=stage, gate=gate, outcome=outcome,
                           actor="tests", **extra)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_append_publishes_a_new_file_and_never_rewrites_an_old_one(tmp_path: Path) -> None:
    log = PromotionLog(tmp_path)
    first = log.append([record("a", Stage.CANDIDATE)])
    before = digest(first)
    second = log.append([record("a", Stage.REJECTED, Gate.REBENCH, Outcome.FAILED, reason="slower")])
    assert first != second and digest(first) == before
    assert log.files() == sorted([first, second]) and first.parent == tmp_path / PROMOTIONS_DIR
    assert not list((tmp_path / PROMOTIONS_DIR).glob(".*"))


def test_an_artifacts_stage_is_that_of_its_latest_row(tmp_path: Path) -> None:
    log = PromotionLog(tmp_path)
    log.append([record("a", Stage.CANDIDATE), record("a", Stage.VALIDATED, Gate.AUTOMATED)])
    log.append([record("b", Stage.REJECTED, outcome=Outcome.FAILED)])
    log.append([record("a", Stage.SHADOW, Gate.REVIEW)])
    assert log.stages() == {"a": Stage.SHADOW, "b": Stage.REJECTED}
    assert [r.stage for r in log.history("a")] == [Stage.CANDIDATE, Stage.VALIDATED, Stage.SHADOW]


def test_a_row_round_trips_with_its_evidence_and_outcome(tmp_path: Path) -> None:
    log = PromotionLog(tmp_path)
    evidence = {"sweeps": ["s-hidden"], "workloads": {"w1": {"median_ms": 0.5, "ci": [0.4, 0.6]}}}
    log.append([record("a", Stage.CANDIDATE, Gate.MEMCHECK, Outcome.NOT_RUN, reason="no GPU", evidence=evidence)])
    (row,) = log.read()
    assert (row.outcome, row.passed, row.reason, row.evidence, row.environment) == (
        Outcome.NOT_RUN, False, "no GPU", evidence, ENV)


def test_an_unwritable_store_is_a_store_error_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StoreError, match="store.root: cannot create"):
        PromotionLog(tmp_path / "file").append([record("a", Stage.CANDIDATE)])


def test_promotion_files_are_not_read_as_evaluations(tmp_path: Path) -> None:
    PromotionLog(tmp_path).append([record("a", Stage.CANDIDATE)])
    assert TraceStore(tmp_path).read().num_rows == 0
    assert scan(tmp_path).collect().height == 0


@pytest.fixture(scope="module")
def solutions() -> dict:
    return load_dataset(REPO / "datasets" / "core", solution_roots=[REPO / "solutions"], require_blobs=False).solutions


@pytest.mark.parametrize("field", ["hardware", "driver", "cuda", "torch", "triton"])
def test_any_environment_change_gives_every_solution_a_new_artifact_id(solutions, field: str) -> None:
    sol = next(iter(solutions.values()))
    assert artifact_of(sol, ENV).artifact_id != artifact_of(sol, {**ENV, field: "other"}).artifact_id
    assert environment_key(ENV) != environment_key({**ENV, field: "other"})


def test_a_cuda_solutions_recipe_changes_with_its_target_architecture(monkeypatch) -> None:
    from fibray.dataset import read_json
    from fibray.schema import Solution

    cuda = read_json(Solution, REPO / "datasets/llm/solutions/rmsnorm/rmsnorm_h4096/rmsnorm_h4096_cuda_c_abi.json")
    monkeypatch.setenv("FIBRAY_CUDA_ARCH", "90")
    sm90 = recipe_hash(cuda)
    monkeypatch.setenv("FIBRAY_CUDA_ARCH", "80")
    assert recipe_hash(cuda) != sm90


def test_the_same_solution_environment_and_recipe_give_the_same_artifact_id(solutions) -> None:
    sol = next(iter(solutions.values()))
    assert artifact_of(sol, dict(ENV)) == artifact_of(sol, json.loads(json.dumps(ENV)))
