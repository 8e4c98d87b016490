"""Tracing: live calls of decorated functions become a FlashInfer Trace dataset, deduplicated by policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _apply_fixtures import RAGGED, inputs, ragged_center, ragged_inputs, scale, write_toy_dataset

from fibray.apply import apply
from fibray.dataset import load_dataset
from fibray.evaluate.inputs import materialize
from fibray.schema import Definition, RandomInput, SafetensorsInput, ScalarInput
from fibray.tracing import Tracer, TracingError, trace

WORKLOAD_SET = "traced"


def traced_workloads(root: Path, definition: str) -> list:
    return load_dataset(root, definitions=[definition], workload_set=WORKLOAD_SET).workloads.get(definition, [])


@pytest.fixture()
def toy_defs(tmp_path: Path) -> Path:
    return write_toy_dataset(tmp_path / "toy")


@pytest.fixture()
def ragged_defs() -> dict[str, Definition]:
    return {RAGGED["name"]: Definition.model_validate(RAGGED)}


def test_calls_with_the_same_var_axes_become_one_workload(toy_defs, tmp_path):
    f = apply("scale_h64")(scale)
    out = tmp_path / "traced"
    with trace(out, toy_defs, workload_set=WORKLOAD_SET) as tracer:
        for n in (4, 4, 8, 4):
            x, w = inputs(n, seed=n)
            assert torch.equal(f(x, w), x * w)    # tracing never changes what the program computes
    assert sorted(w.axes["n"] for w in traced_workloads(out, "scale_h64")) == [4, 8]
    assert (tracer.stats.recorded, tracer.stats.duplicates) == (2, 2)


def test_attention_calls_are_deduplicated_by_average_lengths(ragged_defs, tmp_path):
    f = apply(RAGGED["name"])(ragged_center)
    out = tmp_path / "traced"
    with trace(out, ragged_defs, workload_set=WORKLOAD_SET):
        f(*ragged_inputs([4, 4]))        # 2 sequences, 4 tokens on average
        f(*ragged_inputs([4, 4, 4]))     # more tokens, same average: a duplicate
        f(*ragged_inputs([10, 2]))       # 6 on average: new
    totals = sorted(w.axes["total_q"] for w in traced_workloads(out, RAGGED["name"]))
    assert totals == [8, 12]


def test_structured_inputs_are_saved_and_replayed_exactly(ragged_defs, tmp_path):
    f = apply(RAGGED["name"])(ragged_center)
    out = tmp_path / "traced"
    x, indptr, scale_value = ragged_inputs([3, 7, 2])
    with trace(out, ragged_defs, workload_set=WORKLOAD_SET):
        f(x, indptr, scale_value)
    (workload,) = traced_workloads(out, RAGGED["name"])
    assert isinstance(workload.inputs["qo_indptr"], SafetensorsInput)
    assert isinstance(workload.inputs["x"], RandomInput)
    assert workload.inputs["scale"] == ScalarInput(value=scale_value)
    args = materialize(ragged_defs[RAGGED["name"]], workload, root=out, seed=0, trial=0, device=torch.device("cpu"))
    assert torch.equal(args[1], indptr) and args[2] == scale_value and args[0].shape == x.shape


def test_tracing_the_same_calls_again_adds_no_workloads(toy_defs, tmp_path):
    f = apply("scale_h64")(scale)
    out = tmp_path / "traced"
    with trace(out, toy_defs, workload_set=WORKLOAD_SET) as first:
        f(*inputs(4))
    with trace(out, toy_defs, workload_set=WORKLOAD_SET) as second:
        f(*inputs(4, seed=1))            # other values, same axes; float inputs are not saved
    assert (first.stats.written, second.stats.written) == (1, 0)
    assert len(traced_workloads(out, "scale_h64")) == 1


def test_calls_that_do_not_fit_their_definition_are_skipped_without_raising(toy_defs, tmp_path):
    f = apply("scale_h64")(scale)
    with trace(tmp_path / "traced", toy_defs, workload_set=WORKLOAD_SET) as tracer:
        x, w = torch.randn(4, 32), torch.randn(32)      # h is 64 in the definition
        assert torch.equal(f(x, w), x * w)
    assert (tracer.stats.mismatched, tracer.stats.recorded) == (1, 0)


def test_traced_definitions_are_written_beside_the_workloads(toy_defs, tmp_path):
    f = apply("scale_h64")(scale)
    out = tmp_path / "traced"
    with trace(out, toy_defs, workload_set=WORKLOAD_SET):
        f(*inputs(4))
    written = json.loads((out / "definitions" / "scale" / "scale_h64.json").read_text())
    original = load_dataset(toy_defs, definitions=["scale_h64"]).definitions["scale_h64"]
    assert written == original.to_json_dict()


def test_tracer_refuses_a_folder_with_a_different_definition_of_the_same_name(toy_defs, tmp_path):
    out = tmp_path / "traced"
    Tracer(out, toy_defs)                                  # writes the definitions
    changed = load_dataset(toy_defs).definitions["scale_h64"].model_copy(update={"description": "changed"})
    with pytest.raises(TracingError, match="scale_h64"):
        Tracer(out, {"scale_h64": changed})
