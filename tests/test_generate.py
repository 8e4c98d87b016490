"""The serving-trace workload generator: determinism, the awkward cases it must produce, dedup, GPU coverage."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fibray.dataset import load_dataset
from fibray.generate._defs import catalogue
from fibray.generate._trace import TIE_MARGIN, mass_above, page_table, routing_skew
from fibray.generate import CPU_SMALL, Draft, dedup, drafts_for, generate, main

REPO = Path(__file__).resolve().parents[1]
LLM = REPO / "datasets" / "llm"
DEFS = {d["name"]: d for d in catalogue()}


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llm")
    assert main(["--out", str(out), "--set", "cpu_small", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def ds(generated):
    return load_dataset(generated, workload_set="cpu_small")


def _blobs(ds, name: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for w in ds.workloads[name]:
        paths = {src.path for src in w.inputs.values() if src.type == "safetensors"}
        assert len(paths) == 1, "one blob per workload"
        out.append(load_file(str(ds.root / paths.pop())))
    return out


def test_same_seed_writes_the_same_bytes(generated, tmp_path):
    generate(tmp_path, "cpu_small", seed=0)
    assert _digest(tmp_path) == _digest(generated)


def test_another_seed_writes_other_workloads(generated, tmp_path):
    generate(tmp_path, "cpu_small", seed=1)
    a, b = _digest(generated / "blob"), _digest(tmp_path / "blob")
    assert a and b and not set(a.values()) & set(b.values())


def test_committed_cpu_small_set_is_what_the_generator_writes(generated):
    for sub in ("definitions", "workloads/cpu_small", "blob/cpu_small"):
        assert _digest(LLM / sub) == _digest(generated / sub), f"datasets/llm/{sub} is stale: regenerate it"


def test_committed_cpu_small_set_fits_the_size_policy():
    files = [p for sub in ("workloads/cpu_small", "blob/cpu_small") for p in (LLM / sub).rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 4 << 20
    assert max(p.stat().st_size for p in files) < 1 << 20


def test_every_cpu_small_definition_has_workloads_and_loads(ds):
    assert set(ds.workloads) == CPU_SMALL
    assert set(CPU_SMALL) <= set(ds.definitions)


def test_paged_batches_have_empty_length_one_and_partly_filled_last_pages(ds):
    name = "gqa_paged_decode_h32_kv8_d128_ps16"
    ps = DEFS[name]["axes"]["page_size"]["value"]
    mix = max(_blobs(ds, name), key=lambda b: b["kv_indptr"].numel())
    pages = (mix["kv_indptr"][1:] - mix["kv_indptr"][:-1]).tolist()
    last = mix["kv_last_page_len"].tolist()
    tokens = [(n - 1) * ps + l if n else 0 for n, l in zip(pages, last)]
    assert 0 in tokens and 1 in tokens
    assert any(0 < l < ps and n > 1 for n, l in zip(pages, last)), "a multi-page sequence with a partial last page"
    assert all((l == 0) == (n == 0) and 0 <= l <= ps for n, l in zip(pages, last))


def test_page_tables_point_at_distinct_pages_inside_the_cache(ds):
    for name in ("gqa_paged_decode_h32_kv8_d128_ps1", "gqa_paged_decode_h32_kv8_d128_ps16",
                 "gqa_paged_prefill_causal_h32_kv8_d128_ps16", "mla_paged_decode_h16_ckv512_kpe64_ps1"):
        for w, blob in zip(ds.workloads[name], _blobs(ds, name)):
            idx = blob["kv_indices"]
            assert idx.numel() == int(blob["kv_indptr"][-1]) == w.axes["num_kv_indices"]
            assert idx.unique().numel() == idx.numel() and int(idx.max()) < w.axes["num_pages"]


def test_prefill_batches_have_empty_and_length_one_queries_over_longer_prefixes(ds):
    for name in ("gqa_paged_prefill_causal_h32_kv8_d128_ps16", "gqa_ragged_prefill_causal_h32_kv8_d128"):
        blob = _blobs(ds, name)[0]
        q = (blob["qo_indptr"][1:] - blob["qo_indptr"][:-1]).tolist()
        assert 0 in q and 1 in q
    rag = _blobs(ds, "gqa_ragged_prefill_causal_h32_kv8_d128")[0]
    q = rag["qo_indptr"][1:] - rag["qo_indptr"][:-1]
    kv = rag["kv_indptr"][1:] - rag["kv_indptr"][:-1]
    assert bool((kv >= q).all()) and bool((kv > q).any())


def test_skewed_workloads_route_most_tokens_to_a_few_experts():
    d = DEFS["moe_bf16_topk8_e128_h2048_i768"]
    by_len = {}
    for dr in drafts_for(d, "gpu", 0):
        by_len.setdefault(dr.axes["seq_len"], []).append(routing_skew(dr.tensors["routing_logits"], 8))
    balanced, skewed = sorted(by_len[8192])
    assert balanced < 1.3 and skewed > 3.0


def test_top_p_falls_inside_a_group_of_tied_probabilities(ds):
    for name in ("top_p_sampling_from_probs_v32000", "top_k_top_p_sampling_from_probs_v32000"):
        blobs = _blobs(ds, name)
        tied = [b for b in blobs if _has_boundary_tie(b["probs"][0])]
        assert tied, f"{name}: no ties workload"
        for b in tied:
            p = b["probs"][0].double()
            if "top_k" in b:  # renormalised after top-k
                k = int(b["top_k"][0])
                above_count = p.numel() - torch.searchsorted(p.sort().values, p, right=True)
                p = torch.where(above_count < k, p, 0.0)
                p = p / p.sum()
            vals, counts = torch.unique(p[p > 0], return_counts=True)
            group = vals[counts >= 6].max()
            above = float(p[p > group].sum())
            top_p = float(b["top_p"][0])
            # the rule keeps the whole group (less than top_p above it); a sorted prefix would cut it
            assert above < top_p < above + 5 * float(group)


def test_top_p_never_sits_within_the_margin_of_a_token_mass(ds):
    for name in ("top_p_sampling_from_probs_v32000",):
        for b in _blobs(ds, name):
            for row, tp in zip(b["probs"].numpy(), b["top_p"].tolist()):
                assert np.abs(mass_above(row) - tp).min() >= TIE_MARGIN * 0.99


def test_top_k_boundary_cuts_a_tie_group_in_the_ties_workload(ds):
    tied = [b for b in _blobs(ds, "top_k_sampling_from_probs_v32000") if _has_boundary_tie(b["probs"][0])]
    assert tied
    p, k = tied[0]["probs"][0], int(tied[0]["top_k"][0])
    kth = p.sort(descending=True).values[k - 1]
    assert int((p == kth).sum()) > 1 and int((p > kth).sum()) < k < int((p >= kth).sum())


def test_drafts_with_the_same_performance_key_are_dropped():
    a, b, c = Draft({"M": 1}, (1,)), Draft({"M": 1}, (1,)), Draft({"M": 2}, (2,))
    assert dedup([a, b, c]) == [a, c]


def test_gpu_drafts_have_unique_keys_for_every_definition():
    for d in catalogue():
        if d["op_type"] in ("gqa_paged", "mla_paged", "gqa_ragged", "gemm", "rmsnorm"):
            keys = [dr.key for dr in drafts_for(d, "gpu", 0)]
            assert len(keys) == len(set(keys)), d["name"]


def test_gpu_set_covers_the_flashinfer_baseline_benchmark_shapes():
    decode = [d for d in catalogue() if d["name"].startswith("gqa_paged_decode")]
    heads = {(d["axes"]["num_qo_heads"]["value"], d["axes"]["num_kv_heads"]["value"], d["axes"]["head_dim"]["value"])
             for d in decode if d["axes"]["page_size"]["value"] == 16}
    assert {(32, kv, hd) for kv in (8, 4) for hd in (64, 128, 256)} <= heads
    main_decode = drafts_for(DEFS["gqa_paged_decode_h32_kv8_d128_ps16"], "gpu", 0)
    uniform = {(dr.axes["batch_size"], dr.key[2]) for dr in main_decode}
    for b in (1, 16, 64, 128):
        for n in (512, 2048, 8192, 16384):
            assert (b, round(np.log2(n + 1) * 2) / 2) in uniform
    ragged = {(d["axes"].get("head_dim", d["axes"].get("head_dim_qk"))["value"],
               d["axes"].get("head_dim", d["axes"].get("head_dim_vo"))["value"])
              for d in catalogue() if d["op_type"] == "gqa_ragged"}
    assert {(128, 128), (192, 128), (256, 256)} <= ragged
    assert any(d["name"].startswith("gqa_paged_prefill") and d["axes"]["page_size"]["value"] == 16 for d in catalogue())
    mla_heads = {d["axes"]["num_qo_heads"]["value"] for d in catalogue() if d["op_type"] == "mla_paged"}
    assert {64, 128} <= mla_heads
    for name in ("mla_paged_decode_h64_ckv512_kpe64_ps1", "mla_paged_decode_h128_ckv512_kpe64_ps1",
                 "gqa_paged_prefill_causal_h32_kv8_d128_ps16", "gqa_ragged_prefill_causal_h16_kv8_d256"):
        assert drafts_for(DEFS[name], "gpu", 0), name


def test_page_table_last_page_holds_the_remainder():
    pt = page_table(np.random.default_rng(0), [0, 1, 16, 17, 40], page_size=16)
    assert (pt.kv_indptr[1:] - pt.kv_indptr[:-1]).tolist() == [0, 1, 1, 2, 3]
    assert pt.kv_last_page_len.tolist() == [0, 1, 16, 1, 8]


def test_an_unknown_set_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--set", "tpu"])
    assert "invalid choice" in capsys.readouterr().err


def _has_boundary_tie(row: torch.Tensor) -> bool:
    top = row.sort(descending=True).values[:16]
    return bool((top[1:] == top[:-1]).any())
