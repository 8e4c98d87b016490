"""The roofline floor from a definition's axes and dtypes, on a fake device (CPU): bytes, FLOPs,
inputs a kernel may read in part, and the verdict for a latency below it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from fibray.dataset import load_dataset
from fibray.evaluate import Evaluator
from fibray.schema import EvalSettings, Job
from fibray.timing.roofline import DeviceCaps, below_floor, floor_ms, min_bytes, min_flops
from _sweep_helpers import REPO

FAKE = DeviceCaps(name="fake", hbm_bytes_per_s=1e12, matmul_flops_per_s=1e14)
"""1 TB/s and 100 TFLOP/s: round numbers, so the floors below are exact."""


def _defs(root: str, *names: str):
    ds = load_dataset(REPO / "datasets" / root, definitions=list(names), workload_set="cpu_small", solution_roots=[])
    return ds.definitions


def test_gemm_floor_counts_operands_result_and_flops():
    d = _defs("llm", "gemm_bf16_n2048_k4096")["gemm_bf16_n2048_k4096"]
    axes = {"M": 1024}
    assert min_bytes(d, axes) == 2 * (1024 * 4096 + 2048 * 4096 + 1024 * 2048)
    assert min_flops(d, axes) == 2.0 * 1024 * 2048 * 4096
    # compute-bound here: 17.2 GFLOP at 2 x 100 TFLOP/s = 85.9 us > 29.4 MB at 1 TB/s = 29.4 us
    assert floor_ms(d, axes, FAKE) == pytest.approx(2.0 * 1024 * 2048 * 4096 / 2e14 * 1e3)


def test_block_scaled_fp8_gemm_contracts_over_k_only():
    d = _defs("llm", "gemm_fp8_block_scale_n1024_k2048")["gemm_fp8_block_scale_n1024_k2048"]
    assert min_flops(d, {"M": 64}) == 2.0 * 64 * 1024 * 2048  # not x num_k_blocks (the scales share it)


def test_rmsnorm_floor_is_its_bytes():
    d = _defs("core", "rmsnorm_h4096")["rmsnorm_h4096"]
    assert min_flops(d, {"batch_size": 8}) is None
    assert min_bytes(d, {"batch_size": 8}) == 2 * (8 * 4096 + 4096 + 8 * 4096)


def test_paged_kv_caches_and_expert_weights_may_be_read_in_part():
    defs = _defs("llm", "gqa_paged_decode_h32_kv8_d128_ps16", "moe_bf16_topk8_e32_h1024_i128")
    gqa = defs["gqa_paged_decode_h32_kv8_d128_ps16"]
    axes = {"batch_size": 2, "num_pages": 10_000, "len_indptr": 3, "num_kv_indices": 8}
    assert min_bytes(gqa, axes) == min_bytes(gqa, {**axes, "num_pages": 10})  # the page pool is not counted
    moe = defs["moe_bf16_topk8_e32_h1024_i128"]
    small = min_bytes(moe, {"seq_len": 1})
    assert small < 32 * 1024 * 128 * 2  # not every expert's weights


def test_a_latency_below_the_floor_is_reported_and_one_above_is_not():
    d = _defs("core", "rmsnorm_h4096")["rmsnorm_h4096"]
    floor = floor_ms(d, {"batch_size": 8}, FAKE)
    assert below_floor(0.5 * floor, d, {"batch_size": 8}, FAKE) is not None
    assert below_floor(0.9 * floor, d, {"batch_size": 8}, FAKE) is None
    assert below_floor(0.0, d, {"batch_size": 8}, None) is None  # no device capabilities: no floor (CPU)


def test_a_passing_candidate_faster_than_the_devices_floor_is_below_roofline():
    """On a device slower than any kernel's real latency here (a fake 1 MB/s), the honest torch
    RMSNorm cannot be as fast as it reports: the verdict is below_roofline, never PASSED."""
    ds = load_dataset(REPO / "datasets" / "core", definitions=["rmsnorm_h4096"], solution_roots=[REPO / "solutions"],
                      solutions=["rmsnorm_h4096_torch"], workload_set="cpu_small")
    job = Job(job_id="roofline", sweep="t", definition=ds.definitions["rmsnorm_h4096"],
              workload=ds.workloads["rmsnorm_h4096"][1], solution=ds.solutions["rmsnorm_h4096_torch"],
              settings=EvalSettings(warmup=1, iterations=3, trials=1), dataset_root=str(ds.root))
    slow = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-roof-")), torch.device("cpu"))
    slow.judge.caps = DeviceCaps(name="slow-fake", hbm_bytes_per_s=1e6, matmul_flops_per_s=1e6)
    ev = slow.evaluate(job)
    assert (ev.status.value, ev.reason) == ("RUNTIME_ERROR", "below_roofline"), ev.log
    assert "roofline floor" in ev.log and ev.performance is None
    fast = Evaluator(Path(tempfile.mkdtemp(prefix="fibray-roof-")), torch.device("cpu"))
    fast.judge.caps = FAKE
    assert fast.evaluate(job).status.value == "PASSED"
