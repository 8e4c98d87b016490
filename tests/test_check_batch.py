"""The judged sample of timed calls is compared in batches: each call's verdict must be the one the
elementwise rule gives for that call alone, written here element by element in plain Python, and
the guard bytes of many output sets read at once must say what each set's own read says."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from fibray.check import Tolerance, checker_for, judge_calls
from fibray.check import base as check_base
from fibray.check import elementwise
from fibray.check.fused import BLOCK, STEPS, fused_rows, wide_type
from fibray.evaluate.memory import HostRegion, JobMemory, plan_layout
from fibray.schema.reasons import Reason

TOL = Tolerance(atol=1e-2, rtol=1e-2, matched_ratio=0.9)


def _by_hand(outs: list, refs: list[torch.Tensor], names: list[str], required: float) -> tuple:
    """(reason or None, max_abs, max_rel, matched_ratio) for one call, element by element."""
    max_abs = max_rel = 0.0
    ratio = 1.0
    failed = None
    for out, ref, name in zip(outs, refs, names):
        if not isinstance(out, torch.Tensor):
            return Reason.NOT_A_TENSOR, None, None, None
        if tuple(out.shape) != tuple(ref.shape):
            return Reason.WRONG_SHAPE, None, None, None
        if out.dtype != ref.dtype:
            return Reason.WRONG_DTYPE, None, None, None
        o = [float(v) for v in out.reshape(-1).tolist()]
        r = [float(v) for v in ref.reshape(-1).tolist()]
        if out.dtype.is_floating_point:
            bad = [a for a, b in zip(o, r) if not math.isfinite(a) and not (a == b or (math.isnan(a) and math.isnan(b)))]
            if bad:
                value = math.nan if any(math.isnan(a) for a in bad) else math.inf
                return Reason.NON_FINITE_OUTPUT, value, value, None
        diffs = [abs(a - b) if math.isfinite(b) else 0.0 for a, b in zip(o, r)]
        rels = [d / (abs(b) + 1e-8) for d, b in zip(diffs, r)]
        within = sum(1 for d, b in zip(diffs, r) if d <= TOL.atol + TOL.rtol * abs(b))
        a = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
        e = math.nan if any(math.isnan(x) for x in rels) else max(rels, default=0.0)
        m = within / len(o) if o else 1.0
        max_abs = math.nan if math.isnan(max_abs) or math.isnan(a) else max(max_abs, a)
        max_rel = math.nan if math.isnan(max_rel) or math.isnan(e) else max(max_rel, e)
        ratio = min(ratio, m)
        if failed is None and m < required:
            failed = Reason.TOLERANCE_EXCEEDED
    return failed, max_abs, max_rel, ratio


def _same(x, y) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and (x == y or (math.isnan(x) and math.isnan(y))))


def _near(x, y) -> bool:
    return _same(x, y) or (x is not None and y is not None and math.isclose(x, y, rel_tol=2.0 ** -22))


def _calls(seed: int, n: int = 40):
    """n calls of two outputs (a bf16 [4, 8] and a float32 [5]) with every kind of fault mixed in."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    calls, refs = [], []
    for _ in range(n):
        ry = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        rz = torch.randn(5, generator=g) * 100
        if rng.random() < 0.2:
            rz[rng.randrange(5)] = math.inf
        y = ry.clone()
        z = (rz + torch.randn(5, generator=g) * 0.01).where(torch.isfinite(rz), rz)
        fault = rng.choice(["none", "none", "none", "small", "big", "nan", "inf", "shape", "dtype", "tuple", "refnan"])
        if fault == "small":
            y.view(-1)[rng.randrange(32)] += 0.05
        elif fault == "big":
            y.view(-1)[: rng.randrange(1, 32)] += 1.0
        elif fault == "nan":
            z[rng.randrange(5)] = math.nan
        elif fault == "inf":
            y.view(-1)[rng.randrange(32)] = -math.inf
        elif fault == "shape":
            z = z[:4]
        elif fault == "dtype":
            y = y.float()
        elif fault == "tuple":
            y = (1, 2)
        elif fault == "refnan":
            ry.view(-1)[3] = y.view(-1)[3] = math.nan
        calls.append([y, z])
        refs.append([ry, rz])
    return calls, refs


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # inf - inf in the interpreter's numpy
# fused: the GPU's Triton kernel (interpreted here; the two checkers share it, so one of them) or torch
@pytest.mark.parametrize("kind,required,fused", [("elementwise", 1.0, False), ("matched_ratio", 0.9, False),
                                                 ("elementwise", 1.0, True)])
@pytest.mark.parametrize("batch", [1 << 24, 40])  # 40 elements: a few calls per batch, and a remainder
def test_each_call_of_a_batch_gets_the_verdict_of_the_elementwise_rule_on_its_own(monkeypatch, kind, required, batch,
                                                                                   fused):
    monkeypatch.setattr(check_base, "BATCH_ELEMENTS", batch)
    monkeypatch.setattr(elementwise, "output_stats", functools.partial(check_base.output_stats, fused=fused))
    names = ["y", "z"]
    seen = set()
    for seed in range(5):
        calls, refs = _calls(seed)
        batched = judge_calls(checker_for(kind), calls, refs, names, TOL)
        assert len(batched) == len(calls)
        for outs, rs, got in zip(calls, refs, batched):
            want = _by_hand(outs, rs, names, required)
            one = checker_for(kind)(outs, rs, names, TOL)
            assert (got.reason, got.status) == (one.reason, one.status)
            assert got.reason == want[0], (outs, rs, got.message)
            seen.add(got.reason)
            if want[1] is not None:
                # outputs of 16 bits or fewer are compared in float32: their differences exactly, a relative
                # error's quotient to its rounding (two float32 ulps), where by hand it is float64's
                assert _same(got.max_abs, want[1]) and _near(got.max_rel, want[2])
            if want[3] is not None:
                assert got.extra["matched_ratio"] == want[3]
    # every kind of verdict came up, so the rule was compared on each
    assert {None, Reason.NON_FINITE_OUTPUT, Reason.WRONG_SHAPE, Reason.WRONG_DTYPE, Reason.NOT_A_TENSOR} <= seen
    assert Reason.TOLERANCE_EXCEEDED in seen


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # inf - inf in the interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.uint8])
def test_the_fused_kernel_gives_the_torch_paths_figures_to_the_bit(dtype):
    """fibray.check.fused (a GPU's check) against output_stats' torch path: the same counts and maxima,
    bit for bit, over rows that span several of the kernel's programs, with values on either side of
    the tolerance's edge and every non-finite case (Triton's interpreter here: IEEE arithmetic, as the
    kernel asks of the GPU with no fused multiply-add and correctly rounded division)."""
    g = torch.Generator().manual_seed(7)
    n = 2 * BLOCK * STEPS + 37  # three spans a row, the last one short
    refs, outs = [], []
    for i in range(6):
        if dtype.is_floating_point:
            r = (torch.randn(n, generator=g) * 10 ** (i - 2)).to(dtype)
            edge = (r.float() + (TOL.atol + TOL.rtol * r.float().abs()) * (1 + (torch.rand(n, generator=g) - 0.5) * 1e-3))
            o = torch.where(torch.rand(n, generator=g) < 0.5, edge, r.float() + torch.randn(n, generator=g) * 1e-3).to(dtype)
            if i % 2:
                for k, (a, b) in enumerate([(math.nan, 1.0), (math.inf, 1.0), (-math.inf, -math.inf), (math.nan, math.nan),
                                            (1.0, math.inf), (2.0, math.nan), (math.inf, -math.inf)]):
                    o[k * 1000 + i], r[k * 1000 + i] = a, b
        else:
            r = torch.randint(0, 100, (n,), generator=g).to(dtype)
            o = (r + torch.randint(0, 2, (n,), generator=g).to(dtype)) if i % 2 else r.clone()
        refs.append(r)
        outs.append(o)
    wide = wide_type(dtype)
    got = fused_rows(outs, refs, wide, TOL.atol, TOL.rtol, shape=(BLOCK, STEPS))  # a GPU's geometry
    want = check_base._torch_rows(outs, refs, wide, dtype.is_floating_point, TOL)
    assert got is not None and got.dtype == want.dtype == torch.float64
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), (got, want)
    assert 0 < want[:, 4].min() < n  # some elements on each side of the edge: the count was compared where it matters


def test_outputs_the_fused_kernel_does_not_read_take_the_torch_path():
    flags = [torch.tensor([True, False, True])]
    assert fused_rows(flags, flags, torch.float64, 0.0, 0.0) is None
    got = check_base.output_stats(flags, [torch.tensor([True, True, True])], TOL, fused=True)
    assert got[0].matched_ratio == 2 / 3 and got[0].max_abs == 1.0


def test_empty_and_integer_outputs_are_judged_as_one_call_at_a_time():
    ints = [[torch.tensor([1, 2, 3])], [torch.tensor([1, 2, 4])], [torch.zeros(0)]]
    refs = [[torch.tensor([1, 2, 3])], [torch.tensor([1, 2, 3])], [torch.zeros(0)]]
    got = judge_calls(checker_for("elementwise"), ints, refs, ["y"], TOL)
    assert [r.reason for r in got] == [None, Reason.TOLERANCE_EXCEEDED, None]
    assert got[1].max_abs == 1.0 and got[1].extra["matched_ratio"] == 2 / 3 and got[2].extra["matched_ratio"] == 1.0


def test_a_checker_without_a_batch_form_is_called_once_per_call():
    seen = []

    def plain(outputs, refs, names, tol):
        seen.append(outputs[0].item())
        return checker_for("elementwise")(outputs, refs, names, tol)

    calls = [[torch.tensor(float(i))] for i in range(3)]
    got = judge_calls(plain, calls, [[torch.tensor(0.0)]] * 3, ["y"], TOL)
    assert seen == [0.0, 1.0, 2.0] and [r.ok for r in got] == [True, False, False]


def test_the_guards_of_many_output_sets_read_at_once_are_each_sets_own():
    sets = [[torch.zeros(3, 5)] for _ in range(2)]
    layout = plan_layout("host", "cpu", sets, [(torch.bfloat16, (3, 5)), (torch.float32, ())], trials=2, dps=True,
                         timed_buffers=6, snapshots=False)
    mem = JobMemory(HostRegion.create(layout.size), layout)
    mem.prepare_outputs(list(range(len(layout.outputs))))
    raw = mem.region.bytes()
    broken = {layout.timed[1]: (0, -1), layout.timed[4]: (1, 0), layout.timed[5]: (0, 0)}  # set: (output, byte)
    for k, (o, at) in broken.items():
        p = layout.outputs[k][o]
        raw[p.off - 1 if at < 0 else p.off + p.nbytes + at] = 0  # just before, or just past, the buffer
    everything = list(range(len(layout.outputs)))
    assert mem.guards_intact_many(everything) == [mem.guards_intact(k) for k in everything]
    assert [k for k in everything if not mem.guards_intact(k)] == sorted(broken)
    assert mem.guards_intact_many([]) == []
    mem.close()
