"""The CPU-small sweep of every LLM kernel family on Ray: each solution gets its designed verdict on every
workload, sampling included (TVD over many draws, a hard mask, ties at the boundary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import ray
import torch
from safetensors.torch import load_file

from fibray.dataset import load_dataset
from fibray.store import scan
from fibray.sweep import run_sweep, validate_config

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

LLM = Path(__file__).resolve().parents[1] / "datasets" / "llm"
FAMILIES = {
    "rmsnorm": "rmsnorm_h", "fused_add_rmsnorm": "fused_add_rmsnorm_h", "gemm_fp16": "gemm_n", "gemm_bf16": "gemm_bf16_",
    "gemm_fp8_block_scale": "gemm_fp8_block_scale_", "gqa_paged_decode_ps1": "gqa_paged_decode_h32_kv8_d128_ps1",
    "gqa_paged_decode_ps16": "gqa_paged_decode_h32_kv8_d128_ps16", "gqa_paged_prefill": "gqa_paged_prefill_causal_",
    "gqa_ragged_d128": "gqa_ragged_prefill_causal_h32_kv8_d128", "gqa_ragged_dqk192_dvo128": "gqa_ragged_prefill_causal_h16_kv16_dqk192",
    "mla_paged_decode": "mla_paged_decode_", "moe_bf16": "moe_bf16_", "moe_int8_w8a8": "moe_int8_w8a8_",
    "top_k_sampling": "top_k_sampling_", "top_p_sampling": "top_p_sampling_", "top_k_top_p_sampling": "top_k_top_p_sampling_",
}


def designed(variant: str, boundary_tie: bool) -> tuple[str, Optional[str]]:
    """The verdict each solution variant is built to get (sampling ones depend on ties at the filter boundary)."""
    if variant in ("torch", "triton"):
        return "PASSED", None
    if variant == "torch_unnormalized":  # the kept token with the least mass gets all the filtered-out mass
        return "INCORRECT_NUMERICAL", "tvd_exceeded"
    if variant == "torch_top_k_only":  # forgets top-p: samples tokens that top-p removes
        return "INCORRECT_NUMERICAL", "masked_token_sampled"
    if variant == "torch_k_plus_one":  # one token too many, unless the next token is past a kept tie group
        return ("PASSED", None) if boundary_tie else ("INCORRECT_NUMERICAL", "masked_token_sampled")
    if variant == "torch_sorted":  # a sorted prefix cuts a tie group the rule keeps whole
        return ("INCORRECT_NUMERICAL", "tvd_exceeded") if boundary_tie else ("PASSED", None)
    raise KeyError(variant)


def _boundary_tie(ds, workload) -> bool:
    src = workload.inputs.get("probs")
    if src is None or src.type != "safetensors":
        return False
    top = load_file(str(ds.root / src.path))["probs"].sort(dim=-1, descending=True).values[:, :16]
    return bool((top[:, 1:] == top[:, :-1]).any())


@pytest.fixture(scope="module")
def dataset():
    return load_dataset(LLM, workload_set="cpu_small")


@pytest.fixture(scope="module")
def sweep(dataset, tmp_path_factory):
    store = tmp_path_factory.mktemp("llm_store")
    names = sorted(n for n in dataset.solutions if "_cuda" not in n)  # CUDA solutions are judged elsewhere
    cfg = validate_config({
        "dataset": {"root": str(LLM), "workload_set": "cpu_small"},
        "solutions": {"names": names},
        "store": {"root": str(store)},
        "sweep": {"name": "llm_cpu_small", "progress": False},
        "eval": {"warmup": 0, "iterations": 1, "trials": 1, "time_reference": False},
    })
    # address="local": a new private cluster even when another one runs on this machine
    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = run_sweep(cfg)
    finally:
        ray.shutdown()
    return report, scan(store).collect(), names


def test_every_llm_solution_gets_its_designed_verdict_on_every_workload(dataset, sweep):
    report, df, names = sweep
    expected_jobs = sum(len(dataset.workloads.get(s.definition, [])) for n, s in dataset.solutions.items() if n in names)
    assert report.recorded == len(df) == report.total_jobs == expected_jobs
    uuids = {w.uuid: w for ws in dataset.workloads.values() for w in ws}
    wrong = []
    for row in df.iter_rows(named=True):
        variant = row["solution"].removeprefix(row["definition"] + "_")
        want = designed(variant, _boundary_tie(dataset, uuids[row["workload_uuid"]]))
        if (row["status"], row["reason"]) != want:
            wrong.append((row["solution"], row["workload_uuid"][:8], row["status"], row["reason"], want, (row["log"] or "")[:300]))
    assert not wrong, "\n".join(map(str, wrong))


def test_the_sweep_covers_every_family_with_a_pytorch_and_a_triton_solution(sweep):
    _, df, _ = sweep
    for family, prefix in FAMILIES.items():
        rows = df.filter(df["definition"].str.starts_with(prefix))
        assert set(rows["language"]) >= {"python", "triton"}, family
        assert set(rows.filter(rows["solution"].str.ends_with("_triton"))["status"]) == {"PASSED"}, family
    assert len(set(df["author"])) >= 2


def test_sampling_verdicts_carry_the_tvd_and_the_number_of_draws(sweep):
    _, df, _ = sweep
    sampled = df.filter(df["definition"].str.contains("sampling_from_probs") & (df["status"] == "PASSED"))
    assert len(sampled) > 0
    for row in sampled.iter_rows(named=True):
        extra = json.loads(row["correctness_extra"])
        assert extra["draws"] >= 400 and 0 <= extra["tvd"] < extra["tvd_bound"]
    biased = df.filter(df["reason"] == "tvd_exceeded")
    assert len(biased) > 0
    for row in biased.iter_rows(named=True):
        extra = json.loads(row["correctness_extra"])
        assert extra["tvd"] > extra["tvd_bound"] and "TVD" in row["log"]


def test_masked_token_failures_name_the_token(sweep):
    _, df, _ = sweep
    masked = df.filter(df["reason"] == "masked_token_sampled")
    assert len(masked) >= 3
    assert all("sampled token" in log for log in masked["log"])


def test_structured_inputs_come_from_blobs_and_dense_ones_stay_random(dataset):
    decode = dataset.workloads["gqa_paged_decode_h32_kv8_d128_ps16"][0]
    kinds = {name: src.type for name, src in decode.inputs.items()}
    assert kinds == {"q": "random", "k_cache": "random", "v_cache": "random", "kv_indptr": "safetensors",
                     "kv_indices": "safetensors", "kv_last_page_len": "safetensors", "sm_scale": "scalar"}
    assert torch.is_tensor(load_file(str(LLM / decode.inputs["kv_indices"].path))["kv_indices"])
