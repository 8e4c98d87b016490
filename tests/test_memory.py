"""A job's memory: the sample of timed calls is large enough, the region is shared and laid out
without overlaps, the changes between timed calls touch every row, and the supervisor's checks
run on its own mapping (a candidate rebinding fibray's functions in its process changes nothing)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

import fibray.evaluate.memory as memory

from fibray.evaluate.memory import (
    FLIP_WEIGHT, GUARD_BYTES, GUARD_PATTERN, HostRegion, InputChanges, JobMemory, TimedSample, judged_calls,
    own_buffer_calls, plan_layout, sample_size, timed_output_bytes,
)
from fibray.schema import Definition, EvalSettings, Job, Solution, Workload


def _miss(n: int, k: int, w: int) -> float:
    """P(a sample of k of n calls, drawn without replacement, misses all w wrong ones)."""
    return math.comb(n - w, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 16, 40, 52, 53, 64, 70, 100, 333, 1000])
def test_the_timed_sample_misses_a_kernel_wrong_one_call_in_eight_at_most_once_in_a_thousand(n):
    k, w = sample_size(n), max(1, n // 8)
    assert k <= n and _miss(n, k, w) <= 1e-3
    if k > 1:
        assert _miss(n, k - 1, w) > 1e-3  # the smallest such sample


def test_the_sample_size_tends_to_the_with_replacement_bound():
    assert sample_size(100_000) == math.ceil(math.log(1e-3) / math.log(7 / 8)) == 52


def _layout(kind: str = "host", dps: bool = True, snapshots: bool = True):
    sets = [[torch.zeros(3, 5), 2.0, torch.zeros(7, dtype=torch.int32)] for _ in range(3)]
    return plan_layout(kind, "cpu", sets, [(torch.bfloat16, (3, 5)), (torch.float32, ())], trials=2, dps=dps,
                       timed_buffers=4, snapshots=snapshots), sets


def test_the_layout_keeps_every_tensor_and_guard_apart():
    layout, _ = _layout()
    spans = [(a.place.off, a.place.off + a.place.nbytes) for row in layout.inputs for a in row if a.place]
    spans += [(p.off - GUARD_BYTES, p.off + p.nbytes + GUARD_BYTES) for row in layout.outputs for p in row]
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.size
    assert len(layout.outputs) == 2 + 2 + 4 * 2 and layout.inputs[0][1].value == 2.0
    assert len(set(layout.timed) | set(layout.snapshots) | {layout.recheck, layout.scratch}) == 10


def test_where_every_timed_call_needs_buffers_of_its_own_a_job_makes_as_many_calls_as_fit():
    """Judge.own_buffers (a GPU): iterations go first, input sets only where one call of each would not
    fit; the trials' sets always stay; none fit at all is None (the calls then share buffers)."""
    from fibray.timing.timer import calls_after_warmup

    def calls_of(iterations: int, sets: int) -> int:  # both passes, as on a GPU
        return calls_after_warmup(iterations, sets, torch.device("cuda"), True)

    assert calls_of(10, 16) == 176
    assert own_buffer_calls(176, 10, 16, 3, calls_of) == (10, 16)  # all fit: nothing changes
    assert own_buffer_calls(100, 10, 16, 3, calls_of) == (5, 16)  # 5 x 16 + 8 of the device-wide pass
    assert own_buffer_calls(20, 10, 16, 3, calls_of) == (1, 15)  # 15 + 5: one call of each set that fits
    assert own_buffer_calls(8, 10, 16, 3, calls_of) == (1, 3)  # the trials' sets once each, and 5
    assert own_buffer_calls(7, 10, 16, 3, calls_of) is None
    for fit in range(8, 200):
        iterations, sets = own_buffer_calls(fit, 10, 16, 3, calls_of)
        assert calls_of(iterations, sets) <= fit and 3 <= sets <= 16 and 1 <= iterations <= 10
        assert sets == 16 or calls_of(1, sets + 1) > fit  # no set dropped that could have stayed
        assert iterations == 10 or calls_of(iterations + 1, sets) > fit


def test_a_gpus_timed_buffers_take_an_eighth_of_its_memory_a_quarter_of_what_is_free_and_at_least_1_gib(monkeypatch):
    """The budget's arithmetic, with the device's answer to "how much is free" given (no GPU here; the
    figures of an H100 and an H200 run in benchmarks/RESULTS.md, section 31)."""
    gib = 1 << 30
    assert timed_output_bytes(torch.device("cpu")) == gib
    for (free, total), want in [((79 * gib, 80 * gib), 10 * gib), ((139 * gib, 141 * gib), 16 * gib),
                                ((20 * gib, 80 * gib), 5 * gib), ((2 * gib, 80 * gib), gib)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, _f=free, _t=total: (_f, _t))
        memory._MEMORY_INFO.clear()  # the driver's last answer stands for FREE_MEMORY_TTL_S
        assert timed_output_bytes(torch.device("cuda", 0)) == want, (free, total)


def test_a_gpus_free_memory_is_asked_of_the_driver_at_most_once_a_second(monkeypatch):
    """cudaMemGetInfo took 3.7 ms a call on an H100 (benchmarks/RESULTS.md, section 33), asked every job: its
    answer now stands for FREE_MEMORY_TTL_S, per device, and a later question asks the driver again."""
    gib, asked, clock = 1 << 30, [], [100.0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (20 * gib, 80 * gib))
    monkeypatch.setattr(memory, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    memory._MEMORY_INFO.clear()
    for _ in range(5):
        assert timed_output_bytes(torch.device("cuda", 0)) == 5 * gib
    assert asked == [0]
    timed_output_bytes(torch.device("cuda", 1))
    assert asked == [0, 1]  # per device
    clock[0] += memory.FREE_MEMORY_TTL_S / 2
    timed_output_bytes(torch.device("cuda", 0))
    assert asked == [0, 1]
    clock[0] += memory.FREE_MEMORY_TTL_S
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (2 * gib, 80 * gib))
    assert timed_output_bytes(torch.device("cuda", 0)) == gib  # asked again: less is free now
    assert asked == [0, 1, 0]
    memory._MEMORY_INFO.clear()


def test_timed_buffers_rotate_and_the_last_writer_is_judged():
    assert judged_calls(list(range(10)), 4) == {0: 8, 1: 9, 2: 6, 3: 7}
    assert judged_calls([0, 1, 2, 12, 13], 4) == {0: 12, 1: 13, 2: 2}  # an adaptive stop, then the device-wide pass


def test_where_calls_outnumber_their_buffers_a_secret_uniform_sample_of_them_is_kept_as_each_is_final():
    """Only the last call on each buffer is left to judge once the calls outnumber their buffers, and a
    candidate can tell which calls those are: the supervisor keeps its own copies of a uniform random
    sample of all the calls, each as its buffer holds it, with the same copy for a call it does not keep."""
    outs = [[torch.zeros(8)] for _ in range(4)]
    assert not TimedSample(outs, 4)._slots  # a buffer a call: every call is judged from its own
    calls, seen = 100, [0] * 100
    for _ in range(300):
        sample = TimedSample(outs, calls)
        copies = []
        for i in range(calls):
            outs[i % 4][0].fill_(float(i))  # call i's outputs, final in its buffer
            sample.take(i)
            copies.append(sum(int(torch.equal(slot[0], outs[i % 4][0])) for slot in sample._slots))
        assert len(sample.kept) == sample_size(calls) and all(copies)  # one copy every call, kept or not
        for i, kept in sample.kept.items():
            assert torch.equal(kept[0], torch.full((8,), float(i)))  # what call i left, not what overwrote it
            seen[i] += 1
    share = sample_size(calls) / calls  # each call is kept with the same chance, early or late
    assert all(abs(n / 300 - share) < 0.2 for n in seen), seen
    assert abs(sum(seen[:50]) - sum(seen[50:])) < 0.1 * sum(seen)


def test_another_process_sees_the_region_through_its_descriptor(tmp_path):
    region = HostRegion.create(1 << 16)
    region.bytes()[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    code = ("import os, sys, torch\nfrom fibray.evaluate.memory import HostRegion\n"
            "r = HostRegion(int(sys.argv[1]), 1 << 16)\nb = r.bytes()\nassert b[:4].tolist() == [1, 2, 3, 4]\n"
            "b[4:8].fill_(9)\nr.close()\n")
    os.set_inheritable(region.fd, True)
    subprocess.run([sys.executable, "-c", code, str(region.fd)], check=True, pass_fds=(region.fd,),
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert region.bytes()[4:8].tolist() == [9, 9, 9, 9]
    region.close()


def test_the_shared_memory_an_executor_holds_cannot_be_shrunk_under_its_supervisor():
    """The job's region and the reply arena are files the executor holds. Another process (the
    executor) that shrinks one would make the supervisor fault (SIGBUS) on its next read there
    (`offender_truncates_shared_memory` killed its slot's supervisor three times); sealed, the file
    keeps its size, both sides still write, and no write seal can be added to stop the supervisor."""
    import fcntl

    from fibray.workers.process.arena import Arena

    region, arena = HostRegion.create(1 << 16), Arena.create(1 << 16)
    code = ("import fcntl, os, sys\nfd = int(sys.argv[1])\n"
            "for act in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 1 << 20),\n"
            "            lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):\n"
            "    try:\n        act()\n    except PermissionError:\n        continue\n"
            "    sys.exit('the shared file changed size or took a seal')\n"
            "os.pwrite(fd, b'ok', 0)\n")
    for fd, size in ((region.fd, region.size), (arena.fd, arena.size)):
        os.set_inheritable(fd, True)
        subprocess.run([sys.executable, "-c", code, str(fd)], check=True, pass_fds=(fd,))
        assert os.fstat(fd).st_size == size
        assert os.pread(fd, 2, 0) == b"ok"
    assert region.bytes()[:2].tolist() == list(b"ok")
    assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    region.close()
    arena.close()


def test_guards_poison_and_input_checks_run_on_the_supervisors_mapping():
    layout, sets = _layout()
    mem = JobMemory(HostRegion.create(layout.size), layout)
    for i, s in enumerate(sets):
        mem.write_inputs(i, s)
    mem.prepare_outputs(list(range(len(layout.outputs))))
    out = mem.outputs(0)[0]
    assert torch.isnan(out).all() and mem.guards_intact(0)
    raw = mem.region.bytes()
    raw[layout.outputs[0][0].off + layout.outputs[0][0].nbytes] = 0  # one byte past the output
    assert not mem.guards_intact(0) and mem.guards_intact(1)
    assert mem.changed_input(1, sets[1]) is None
    assert mem.changed_inputs(dict(enumerate(sets))) is None
    mem.inputs(1)[2][3] = 5
    assert mem.changed_input(1, sets[1]) == 2
    assert mem.changed_inputs(dict(enumerate(sets))) == (1, 2)  # all sets at once: the first that differs
    mem.inputs(0)[2][0] += 1
    assert mem.changed_inputs(dict(enumerate(sets))) == (0, 2) and mem.changed_inputs({1: sets[1]}) == (1, 2)
    mem.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_the_change_before_a_timed_call_flips_a_dense_random_half_of_every_float_input(dtype):
    """Every row changes, about half the elements, each by 6-25% within its binade; zeros,
    infinities, NaNs and fp8 e4m3's largest value never; integer inputs never; the same seed makes
    the same change on another copy (the supervisor's), and a set never returns to a state it held."""
    torch.manual_seed(0)
    x = (torch.randn(64, 96) * 4).to(dtype)
    special = [0.0, float("nan"), 448.0, -448.0] if dtype == torch.float8_e4m3fn else \
        [0.0, float("inf"), float("-inf"), float("nan")]  # e4m3fn has no infinity; a flip of 448 is NaN
    x[:, :len(special)] = torch.tensor(special).to(dtype)
    ours, theirs, x, twin, idx = _two_copies([x, torch.arange(64), 3.0])
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    seen = {x.view(bits).numpy().tobytes()}
    before = x.clone()
    for seed in (11, 12, 13):
        ours.apply(seed)
        theirs.apply(seed)
        assert torch.equal(x.view(bits), twin.view(bits))  # the supervisor's copy: same bytes
        state = x.view(bits).numpy().tobytes()
        assert state not in seen
        seen.add(state)
    diff = (before.view(bits) ^ x.view(bits))
    body = diff[:, len(special):]
    assert len(set(diff.unique().tolist()) - {0}) == 1  # one mantissa bit, the same everywhere
    normal = (before.float().abs() >= torch.finfo(dtype).tiny)[:, len(special):] & (body != 0)
    rel = ((x.float() - before.float()).abs() / before.float().abs())[:, len(special):][normal]
    assert rel.min() >= 0.06 and rel.max() <= 0.26  # far outside a tolerance, inside the binade (subnormals
    # move by less than the smallest normal)
    assert torch.equal(x.float().sign()[:, len(special):][normal], before.float().sign()[:, len(special):][normal])
    assert (body != 0).any(1).all()  # every row
    assert 0.4 < (body != 0).float().mean() < 0.6  # flipped an odd number of times in three: half
    assert not diff[:, :len(special)].any()  # zeros, infinities, NaNs (and e4m3's largest) as they were
    assert torch.equal(idx, torch.arange(64))  # structured (integer) inputs are never changed


def _may_change(a: torch.Tensor) -> torch.Tensor:
    """The rule InputChanges follows, on values: a nonzero finite value whose flip is finite."""
    bits = a.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()])
    flip = 1 << max(0, round(-math.log2(torch.finfo(a.dtype).eps)) - FLIP_WEIGHT)
    value, flipped = a.to(torch.float64), torch.bitwise_xor(bits, flip).view(a.dtype).to(torch.float64)
    return (value != 0) & value.isfinite() & flipped.isfinite()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.float32, torch.float64])
def test_the_flip_mask_made_on_bits_follows_the_rule_on_values_for_every_pattern(dtype):
    """flip_mask decides on integer bits (magnitude above zero, below the first pattern that is not
    finite or flips to one): every bit pattern of the 8- and 16-bit floats, and for float32/64 a million
    random ones with the edges (both zeros, infinities, NaN, the largest, the smallest normal and subnormal)."""
    from fibray.evaluate.memory import flip_mask, flip_rule

    bits_dtype, flip, _, _ = flip_rule(dtype)
    n = torch.finfo(dtype).bits
    if n <= 16:
        pattern = torch.arange(1 << n, dtype=torch.int64)
        x = (pattern if n == 8 else pattern - (1 << 15)).to(bits_dtype).view(dtype)
    else:
        info = torch.finfo(dtype)
        edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, info.max, -info.max, info.tiny, -info.tiny,
                              info.smallest_normal / 4, 5e-324 if n == 64 else 1e-45, 1.0], dtype=dtype)
        drawn = torch.randint(-(1 << 62), 1 << 62, (1 << 20,), generator=torch.Generator().manual_seed(5))
        x = torch.cat([drawn.to(bits_dtype).view(dtype), edges])
    out = torch.full((x.numel() * x.element_size(),), 0x5A, dtype=torch.uint8)
    flip_mask(x, out)
    want = _may_change(x)
    assert torch.equal(out.view(bits_dtype), want.to(bits_dtype) * flip)
    assert 0 < int(want.sum()) < x.numel()


def test_a_float_whose_negative_zero_is_a_nan_has_no_flip_rule():
    from fibray.evaluate.memory import flip_rule

    with pytest.raises(ValueError, match="no rule for torch.float8_e4m3fnuz"):
        flip_rule(torch.float8_e4m3fnuz)


def _two_copies(args: list) -> tuple:
    """InputChanges on a region holding `args` (as a job's first input set) and on the supervisor's
    copy of it (inputs_copy): the changes and each side's first tensor, and the region's second one."""
    from fibray.evaluate.memory import LocalRegion, args_of, inputs_copy

    layout = plan_layout("local", "cpu", [args], [(torch.float32, (1,))], trials=1, dps=True, timed_buffers=1,
                         snapshots=False)
    region = LocalRegion(layout.size, torch.device("cpu"))
    JobMemory(region, layout).write_inputs(0, args)
    copy = inputs_copy(layout, [args], torch.device("cpu"))
    ours, theirs = args_of(region, layout.inputs[0]), args_of(copy, layout.inputs[0])
    return (InputChanges.of_layout(layout, region)[0], InputChanges.of_layout(layout, copy)[0], ours[0], theirs[0],
            ours[1])


def test_flip_masks_kept_for_a_workloads_sets_make_the_changes_made_without_them(monkeypatch):
    """The supervisor keeps each set's flip mask per workload (Judge._timed): a fresh copy of the same
    sets changed with the kept masks ends byte for byte where one whose masks are made anew ends, and
    no mask is made twice."""
    from fibray.evaluate.memory import args_of, inputs_copy

    torch.manual_seed(3)
    sets = [[torch.randn(16, 64).bfloat16(), torch.arange(4), torch.randn(64).half()] for _ in range(3)]
    layout = plan_layout("local", "cpu", sets, [(torch.float32, (1,))], trials=3, dps=True, timed_buffers=1,
                         snapshots=False)
    masks: dict = {}
    made = []
    real = memory.flip_mask
    monkeypatch.setattr(memory, "flip_mask", lambda a, out: (made.append(a.dtype), real(a, out)))
    ends = []
    for kept in (masks, masks, None):
        copy = inputs_copy(layout, sets, torch.device("cpu"))
        changes = InputChanges.of_layout(layout, copy, kept)
        for i, seed in enumerate([5, 6, 7, 8, 9, 10, 11]):
            changes[i % 3].apply(seed)
        ends.append([bytes(t.contiguous().view(torch.uint8).numpy()) for row in layout.inputs for t in args_of(copy, row)])
    assert ends[0] == ends[1] == ends[2]
    assert ends[0] != [bytes(t.contiguous().view(torch.uint8).numpy()) for s in sets for t in s]  # they did change
    assert len(made) == 2 * 6 and len(masks) == 3  # two float inputs a set: once kept, once anew


def test_a_change_costs_three_operations_a_set_however_many_inputs_it_has():
    """The change is made to the set's span of bytes at once (an AND of a window of random words with
    the flip mask, an XOR), not input by input: on a GPU each operation is a launch of host time
    inside a timed call's budget. Counted with torch's dispatch log: three, for a set of four tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ours, *_ = _two_copies([torch.randn(8, 32), torch.randn(32).half(), torch.arange(5), torch.randn(3, 3).bfloat16()])
    ours.apply(1)  # the first change draws the pool
    with Count() as count:
        ours.apply(2)
    assert count.ops == ["aten.slice.Tensor", "aten.bitwise_and.Tensor_out", "aten.bitwise_xor_.Tensor"], count.ops


def test_a_candidate_that_updates_its_last_answer_for_what_changed_must_compute_in_full():
    """Between two uses of a set, the inputs of a matmul differ in most columns of most rows: no
    low-rank update of the previous answer is exact (the attack of offender_incremental_update)."""
    changes, _, a, _, b = _two_copies([torch.randn(32, 256), torch.randn(16, 256)])
    before_a, before_b = a.clone(), b.clone()
    changes.apply(5)
    assert (a != before_a).any(0).float().mean() > 0.9 and (b != before_b).any(0).float().mean() > 0.9


def _job(src: str, dps: bool = True) -> Job:
    d = Definition.model_validate({
        "name": "scale", "op_type": "scale", "axes": {"n": {"type": "var"}},
        "inputs": {"x": {"shape": ["n"], "dtype": "float32"}, "k": {"shape": None, "dtype": "float32"}},
        "outputs": {"y": {"shape": ["n"], "dtype": "float32"}}, "reference": "def run(x, k):\n    return x * k\n"})
    w = Workload.model_validate({"uuid": "w", "axes": {"n": 64}, "inputs": {"x": {"type": "random"}, "k": {"type": "scalar", "value": 3.0}}})
    sol = Solution.model_validate({
        "name": "cand", "definition": "scale", "author": "t",
        "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "main.py::run", "destination_passing_style": dps},
        "sources": [{"path": "main.py", "content": "import sys, threading, time, torch\n" + src}]})
    return Job(job_id="j", sweep="t", definition=d, workload=w, solution=sol,
               settings=EvalSettings(warmup=1, iterations=12, trials=2), dataset_root=".")


_TIMED = ("def _timed():\n    f = sys._getframe(1)\n    while f is not None:\n"
          "        if f.f_code.co_name == 'time_calls':\n            return True\n        f = f.f_back\n    return False\n")


def _evaluate(src: str, dps: bool = True):
    from fibray.evaluate import Evaluator

    return Evaluator(Path(tempfile.mkdtemp(prefix="fibray-mem-")), torch.device("cpu")).evaluate(_job(src, dps))


def test_an_output_finished_by_a_thread_after_the_call_returned_is_caught():
    """The work of call i is handed to a thread joined at call i+1: at the end mark of call i its
    buffer was still poisoned (the copy taken as call i+1 was prepared), later it is right."""
    src = _TIMED + ("_pending = []\n"
                    "def run(x, k, y):\n"
                    "    while _pending:\n        _pending.pop().join()\n"
                    "    if not _timed():\n        y.copy_(x * k)\n        return\n"
                    "    t = threading.Thread(target=lambda: (time.sleep(0.02), y.copy_(x * k)))\n"
                    "    t.start()\n    _pending.append(t)\n")
    ev = _evaluate(src)
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "output_changed_after_return"), ev.log


def test_a_kernel_wrong_on_one_timed_call_in_eight_is_caught():
    src = _TIMED + ("_n = [0]\n"
                    "def run(x, k, y):\n"
                    "    if _timed():\n        _n[0] += 1\n"
                    "        if _n[0] % 8 == 0:\n            y.zero_()\n            return\n"
                    "    y.copy_(x * k)\n")
    ev = _evaluate(src)
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "wrong_while_timed"), ev.log


def test_a_cache_used_only_outside_timing_is_caught_by_the_recheck():
    src = _TIMED + ("_cache = {}\n"
                    "def run(x, k, y):\n"
                    "    if _timed():\n        y.copy_(x * k)\n        return\n"
                    "    key = x.data_ptr()\n    if key not in _cache:\n        _cache[key] = x * k\n"
                    "    y.copy_(_cache[key])\n")
    ev = _evaluate(src)
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "stale_output"), ev.log


def test_a_returned_tensor_subclass_is_refused():
    src = "class T(torch.Tensor):\n    pass\ndef run(x, k):\n    return (x * k).as_subclass(T)\n"
    ev = _evaluate(src, dps=False)
    assert (ev.status.value, ev.reason) == ("INCORRECT_SHAPE", "not_a_plain_tensor"), ev.log


def test_a_returned_tensor_on_another_device_dtype_or_shape_is_refused():
    ev = _evaluate("def run(x, k):\n    return (x * k).double()\n", dps=False)
    assert (ev.status.value, ev.reason) == ("INCORRECT_DTYPE", "wrong_dtype"), ev.log
    ev = _evaluate("def run(x, k):\n    return (x * k)[:-1]\n", dps=False)
    assert (ev.status.value, ev.reason) == ("INCORRECT_SHAPE", "wrong_shape"), ev.log


def test_inputs_left_unchanged_by_a_rebound_executor_timer_fail_the_timing(monkeypatch):
    """The changes between timed calls are made by the candidate's side; one that skips them
    (here the candidate rebinds the function that makes them) leaves inputs the supervisor sees
    differ from what the changes leave."""
    import fibray.evaluate.candidate as fc

    monkeypatch.setattr(fc, "_change_inputs", fc._change_inputs)  # in this one process: undone after the test
    src = ("import fibray.evaluate.candidate as fc\nfc._change_inputs = lambda changes, seed: None\n"
           "def run(x, k, y):\n    y.copy_(x * k)\n")
    ev = _evaluate(src)
    assert (ev.status.value, ev.reason) == ("INCORRECT_NUMERICAL", "mutated_inputs"), ev.log


@pytest.mark.parametrize("outs", [
    [(torch.bfloat16, (3, 5)), (torch.float32, ()), (torch.int32, (7,)), (torch.bool, (2, 3))],
    [(torch.float8_e4m3fn, (4, 4)), (torch.float32, (2,))],  # fp8 bodies are not poisoned: set by set
])
def test_poisoning_many_output_sets_at_once_writes_what_poisoning_each_does(outs):
    """prepare_outputs copies the first set prepared over the others (one strided copy for the timed
    buffers): every guard and body must end as the buffer-by-buffer way leaves it."""
    from fibray.evaluate.memory import LocalRegion

    sets = [[torch.randn(4, 8)] for _ in range(3)]
    layout = plan_layout("local", "cpu", sets, outs, trials=2, dps=True, timed_buffers=9, snapshots=True)
    ks = [layout.scratch, *layout.timed, *layout.snapshots]
    fast, slow = (JobMemory(LocalRegion(layout.size, torch.device("cpu")), layout) for _ in range(2))
    noise = torch.randint(0, 256, (layout.size,), dtype=torch.uint8)
    fast.region.bytes().copy_(noise)
    slow.region.bytes().copy_(noise)
    fast.prepare_outputs(ks)
    for k in ks:
        slow._prepare_one(k)
    for k in ks:
        lo, hi = fast._span(k)
        for p in layout.outputs[k]:  # guards and bodies; the padding between buffers is nobody's
            a, b = p.off - GUARD_BYTES, p.off + p.nbytes + GUARD_BYTES
            assert torch.equal(fast.region.bytes()[a:b], slow.region.bytes()[a:b]), (k, p)
        assert all(fast.guards_intact_many(ks))
    untouched = torch.ones(layout.size, dtype=torch.bool)
    for k in ks:
        lo, hi = fast._span(k)
        untouched[lo:hi] = False
    assert torch.equal(fast.region.bytes()[untouched], noise[untouched])  # nothing outside the sets written


def test_a_layouts_flip_masks_are_cut_from_one_allocation():
    """The executor's changes of a layout's sets (no kept masks) take their flip masks from one zeroed
    allocation, not one each: in a fresh process on a GPU each allocation went to the driver. The sets'
    masks lie one after another in it, and the changes they make are those the kept-mask test checks."""
    from fibray.evaluate.memory import LocalRegion

    sets = [[torch.randn(8, 64).bfloat16(), torch.arange(4), torch.randn(64).half()] for _ in range(4)]
    layout = plan_layout("local", "cpu", sets, [(torch.float32, (1,))], trials=3, dps=True, timed_buffers=1,
                         snapshots=False)
    region = LocalRegion(layout.size, torch.device("cpu"))
    for i, values in enumerate(sets):
        JobMemory(region, layout).write_inputs(i, values)
    changes = InputChanges.of_layout(layout, region)
    storages = {c._flips.untyped_storage().data_ptr() for c in changes}
    assert len(storages) == 1
    offsets = [c._flips.storage_offset() * 8 for c in changes]
    spans = [memory.set_span(row)[1] for row in layout.inputs]
    assert offsets == [sum(spans[:i]) for i in range(len(spans))]


def test_the_executors_job_path_warm_up_changes_every_float_input_and_fails_when_one_does_not(monkeypatch):
    """An executor runs the job path's operations once as it starts (warm_job_path: on a GPU, CUDA's lazy
    module loads and the caching allocator's growth fall there, not in a job's timing). It checks what it
    ran: with input changes that change nothing, it raises instead of starting an executor whose changes
    do nothing."""
    from fibray.evaluate.candidate import warm_job_path

    warm_job_path(torch.device("cpu"))
    monkeypatch.setattr(InputChanges, "apply", lambda self, seed: None)
    with pytest.raises(RuntimeError, match="did not change"):
        warm_job_path(torch.device("cpu"))


def test_a_layout_is_planned_once_for_the_same_shapes_and_settings_and_anew_for_others():
    """plan_layout keeps what it planned by the inputs' dtypes and shapes (a scalar's value) and the settings:
    the jobs of one workload share one layout; another shape, scalar or setting gets its own."""
    def sets(n, eps=1e-6):
        return [[torch.randn(n, 64).bfloat16(), torch.randn(64).bfloat16(), eps] for _ in range(3)]

    specs = [(torch.bfloat16, (4, 64))]
    a = plan_layout("local", "cpu", sets(4), specs, 3, False, 4, False)
    assert plan_layout("local", "cpu", sets(4), specs, 3, False, 4, False) is a
    assert plan_layout("local", "cpu", sets(4), specs, 3, False, 4, False) == _fresh_layout(sets(4), specs, 4)
    others = [plan_layout("local", "cpu", sets(8), specs, 3, False, 4, False),
              plan_layout("local", "cpu", sets(4, 1e-5), specs, 3, False, 4, False),
              plan_layout("local", "cpu", sets(4), specs, 3, True, 4, False),
              plan_layout("local", "cpu", sets(4), specs, 3, False, 5, False),
              plan_layout("local", "cpu", sets(4), [(torch.float32, (4, 64))], 3, False, 4, False)]
    assert all(o is not a and o != a for o in others)
    assert others[1].inputs[0][2].value == 1e-5
    zero = plan_layout("local", "cpu", sets(4, 0.0), specs, 3, False, 4, False)
    minus = plan_layout("local", "cpu", sets(4, -0.0), specs, 3, False, 4, False)
    assert minus is not zero and math.copysign(1.0, minus.inputs[0][2].value) == -1.0  # a scalar is passed as it is


def _fresh_layout(input_sets, specs, buffers):
    return memory._plan_layout("local", "cpu", input_sets, specs, 3, False, buffers, False)
