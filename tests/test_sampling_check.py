"""The sampling checker: exact filtered distribution, TVD bound, hard mask, and the draw plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

from fibray.check import Draws, Tolerance, checker_for, collect_draws, draw_plan, wants_draws
from fibray.check.sampling import _expected_tvd, filtered_distribution, tvd_bound
from fibray.generate._defs import sampling
from fibray.schema import Definition

VOCAB = 32000
TOL = Tolerance(atol=0.0, rtol=0.0)


@pytest.fixture(scope="module")
def top_k_def() -> Definition:
    return Definition.model_validate(sampling("top_k", VOCAB, ["llama-2-7b"], draws=600))


@pytest.fixture(scope="module")
def top_p_def() -> Definition:
    return Definition.model_validate(sampling("top_p", VOCAB, ["llama-2-7b"], draws=600))


def _row(seed: int = 0) -> torch.Tensor:
    """One next-token-like row: 20 candidates decaying by 0.8 holding 70% of the mass, then a flat tail."""
    g = torch.Generator().manual_seed(seed)
    head = 0.8 ** torch.arange(20, dtype=torch.float64)
    head = head / head.sum() * 0.7
    tail = torch.full((VOCAB - 20,), 0.3 / (VOCAB - 20), dtype=torch.float64)
    p = torch.cat([head, tail])[torch.randperm(VOCAB, generator=g)]
    return (p / p.sum()).to(torch.float32)[None, :]


def _judge(definition: Definition, inputs: list[Any], samples: torch.Tensor):
    first = samples[:1].reshape(-1)
    draws = Draws(definition, inputs, samples[1:])
    ref = [torch.zeros(samples.shape[1], dtype=torch.int64)]
    return checker_for("sampling")([first], ref, ["samples"], TOL, draws=draws)


def test_sampling_checker_is_registered_and_asks_for_draws():
    assert wants_draws(checker_for("sampling"))
    assert not wants_draws(checker_for("elementwise"))


def test_exact_draws_from_the_filtered_distribution_pass(top_k_def):
    probs, k = _row(), torch.tensor([8], dtype=torch.int32)
    q = filtered_distribution(probs, k, None).probs
    torch.manual_seed(1)
    samples = torch.multinomial(q.float(), 601, replacement=True).T
    result = _judge(top_k_def, [probs, k], samples)
    assert result.ok, result.message
    assert result.extra["draws"] == 601 and result.extra["tvd"] < result.extra["tvd_bound"]


def test_a_biased_sampler_fails_on_tvd_without_sampling_a_filtered_token(top_k_def):
    probs, k = _row(), torch.tensor([8], dtype=torch.int32)
    q = filtered_distribution(probs, k, None).probs
    sharpened = q**3 / (q**3).sum()  # same support, wrong weights
    torch.manual_seed(2)
    samples = torch.multinomial(sharpened.float(), 601, replacement=True).T
    result = _judge(top_k_def, [probs, k], samples)
    assert (result.status.value, result.reason) == ("INCORRECT_NUMERICAL", "tvd_exceeded")
    assert result.extra["tvd"] > result.extra["tvd_bound"]


def test_one_filtered_token_fails_at_once_even_among_correct_draws(top_k_def):
    probs, k = _row(), torch.tensor([8], dtype=torch.int32)
    q = filtered_distribution(probs, k, None).probs
    torch.manual_seed(3)
    samples = torch.multinomial(q.float(), 601, replacement=True).T
    outside = int(torch.nonzero(q[0] == 0)[0])
    samples[300, 0] = outside
    result = _judge(top_k_def, [probs, k], samples)
    assert (result.status.value, result.reason) == ("INCORRECT_NUMERICAL", "masked_token_sampled")
    assert str(outside) in result.message


def test_a_token_id_outside_the_vocabulary_counts_as_masked(top_k_def):
    probs, k = _row(), torch.tensor([8], dtype=torch.int32)
    samples = torch.full((5, 1), VOCAB, dtype=torch.int64)
    result = _judge(top_k_def, [probs, k], samples)
    assert result.reason == "masked_token_sampled" and "outside the vocabulary" in result.message


def test_a_single_call_without_samples_is_judged_by_the_mask_only(top_k_def):
    probs, k = _row(), torch.tensor([8], dtype=torch.int32)
    q = filtered_distribution(probs, k, None).probs
    inside, outside = int(torch.argmax(q)), int(torch.nonzero(q[0] == 0)[0])
    ref = [torch.zeros(1, dtype=torch.int64)]
    check = checker_for("sampling")
    ok = check([torch.tensor([inside])], ref, ["samples"], TOL, draws=Draws(top_k_def, [probs, k], None))
    bad = check([torch.tensor([outside])], ref, ["samples"], TOL, draws=Draws(top_k_def, [probs, k], None))
    assert ok.ok and "tvd" not in ok.extra
    assert bad.reason == "masked_token_sampled"


def test_ties_at_the_top_p_boundary_are_all_kept():
    # 2 head tokens (0.2 each) then 6 tied tokens (0.05 each); top_p = 0.47 cuts inside the group
    p = torch.tensor([[0.2, 0.2] + [0.05] * 6 + [0.3 / 92] * 92], dtype=torch.float32)
    dist = filtered_distribution(p, None, torch.tensor([0.47]))
    kept = dist.probs[0] > 0
    assert kept[:8].all() and not kept[8:].any()
    assert torch.allclose(dist.probs[0, :8].sum(), torch.tensor(1.0, dtype=torch.float64))


def test_top_k_keeps_every_token_tied_with_the_kth():
    p = torch.tensor([[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05]])
    kept = filtered_distribution(p, torch.tensor([3]), None).probs[0] > 0
    assert kept.tolist() == [True, True, True, True, True, True, False, False]


def test_top_p_after_top_k_uses_the_renormalised_mass():
    # top-2 keeps {0.4, 0.3} (mass 0.7); top_p 0.5 of that is 0.35, so 0.3 (with 0.4 above it) goes
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    both = filtered_distribution(p, torch.tensor([2]), torch.tensor([0.5])).probs[0] > 0
    p_only = filtered_distribution(p, None, torch.tensor([0.5])).probs[0] > 0
    assert both.tolist() == [True, False, False, False]
    assert p_only.tolist() == [True, True, False, False]


def test_unfiltered_rows_keep_the_whole_distribution():
    p = _row()
    for k, tp in ((torch.tensor([0]), None), (torch.tensor([VOCAB]), None), (None, torch.tensor([1.0]))):
        dist = filtered_distribution(p, k, tp)
        assert torch.allclose(dist.probs, p.double() / p.double().sum())
        assert not dist.forbidden.any()


def test_expected_tvd_matches_a_simulation():
    q = filtered_distribution(_row(), torch.tensor([12]), None).probs
    n = 400
    torch.manual_seed(4)
    sims = []
    for _ in range(300):
        counts = torch.bincount(torch.multinomial(q.float(), n, replacement=True)[0], minlength=VOCAB).double()
        sims.append(0.5 * (counts / n - q[0]).abs().sum())
    simulated = float(torch.stack(sims).mean())
    assert float(_expected_tvd(q, n)[0]) == pytest.approx(simulated, rel=0.05)


def test_the_tvd_bound_shrinks_with_more_draws():
    q = filtered_distribution(_row(), torch.tensor([12]), None).probs
    small, large = float(tvd_bound(q, 500)[0]), float(tvd_bound(q, 5000)[0])
    assert large < small / 2 and small < 0.3


@dataclass
class _Call:
    """What the candidate side's call returns: outputs, or a failure."""

    outputs: list[Any] = field(default_factory=list)
    failure: Optional[str] = None


def test_draw_plan_tiles_the_batch_within_the_byte_budget(top_p_def):
    probs = torch.rand(3, VOCAB)
    args = [probs, torch.full((3,), 0.9)]
    plan = draw_plan(top_p_def, args)
    assert plan is not None and plan.batch == 3 and plan.batch_axis == "batch_size"
    assert plan.calls * plan.reps >= 600
    assert plan.reps * 3 * (VOCAB * 4 + 4) <= 32 << 20


@pytest.mark.slow
def test_collect_draws_stacks_the_tiled_calls_of_a_real_sampler(top_p_def):
    probs = _row().repeat(2, 1)
    args = [probs, torch.tensor([0.5, 0.9])]
    plan = draw_plan(top_p_def, args)
    seen_axes = []

    def call(a, axes):
        seen_axes.append(axes["batch_size"])
        q = filtered_distribution(a[0], None, a[1]).probs
        return _Call([torch.multinomial(q.float(), 1).squeeze(-1)])

    samples = collect_draws(top_p_def, plan, args, {"batch_size": 2}, call)
    assert samples.shape == (plan.calls * plan.reps, 2)
    assert set(seen_axes) == {2 * plan.reps}
    assert _judge(top_p_def, args, torch.cat([samples[:1], samples])).ok


def test_collect_draws_returns_the_first_failed_call(top_p_def):
    args = [_row(), torch.tensor([0.9])]
    plan = draw_plan(top_p_def, args)
    failed = _Call(failure="RUNTIME_ERROR")
    assert collect_draws(top_p_def, plan, args, {"batch_size": 1}, lambda a, ax: failed) is failed


def test_a_wrong_sized_draw_is_judged_wrong_shape(top_p_def):
    args = [_row(), torch.tensor([0.9])]
    plan = draw_plan(top_p_def, args)
    samples = collect_draws(top_p_def, plan, args, {"batch_size": 1},
                            lambda a, ax: _Call([torch.zeros(3, dtype=torch.int64)]))
    one = [torch.zeros(1, dtype=torch.int64)]
    result = checker_for("sampling")(one, one, ["samples"], TOL, draws=Draws(top_p_def, args, samples))
    assert (result.status.value, result.reason) == ("INCORRECT_SHAPE", "wrong_shape")


def test_definitions_without_a_sampling_check_need_no_draws():
    d = Definition.model_validate({
        "name": "noop", "op_type": "x", "axes": {"n": {"type": "var"}},
        "inputs": {"x": {"shape": ["n"], "dtype": "float32"}}, "outputs": {"y": {"shape": ["n"], "dtype": "float32"}},
        "reference": "def run(x):\n    return x\n",
    })
    assert draw_plan(d, [torch.zeros(3)]) is None
