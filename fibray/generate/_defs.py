"""Definition templates of the LLM kernel families (FlashInfer Trace contracts, fibray references).

Each builder returns a Definition as a JSON dict: the axes, tensors and names follow the public
FlashInfer Trace dataset, the references are our own and compute in fp32 (fp64 where an
integer dot product must stay exact). Nothing here reads or writes files.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any, Optional

from fibray.generate._refs import (
    FUSED_ADD_RMSNORM_REF, GEMM_FP8_REF, GEMM_REF, GQA_PAGED_DECODE_REF, GQA_PAGED_PREFILL_REF, GQA_RAGGED_REF,
    MLA_DECODE_REF, MOE_BF16_REF, MOE_INT8_REF, RMSNORM_REF, SAMPLING_REF,
)

__all__ = [
    "catalogue", "fused_add_rmsnorm", "gemm", "gemm_fp8_block_scale", "gqa_paged_decode",
    "gqa_paged_prefill", "gqa_ragged_prefill", "mla_paged_decode", "moe", "rmsnorm", "sampling",
]

Json = dict[str, Any]


def _t(shape: Optional[list[str]], dtype: str, description: Optional[str] = None) -> Json:
    spec: Json = {"shape": shape, "dtype": dtype}
    if description:
        spec["description"] = description
    return spec


def _const(value: int, description: Optional[str] = None) -> Json:
    return {"type": "const", "value": value, **({"description": description} if description else {})}


def _var(description: Optional[str] = None) -> Json:
    return {"type": "var", **({"description": description} if description else {})}


def _src(code: str, **consts: Any) -> str:
    """Reference source with @NAME@ placeholders replaced (braces in the code stay untouched)."""
    code = textwrap.dedent(code).strip() + "\n"
    for name, value in consts.items():
        code = code.replace(f"@{name}@", repr(value))
    left = re.findall(r"@[A-Z_]+@", code)
    if left:
        raise ValueError(f"unfilled placeholders {left} in reference")
    return code


def _definition(name: str, op_type: str, description: str, tags: list[str], axes: Json, inputs: Json,
                outputs: Json, reference: str, constraints: Optional[list[str]] = None,
                check: Optional[Json] = None) -> Json:
    d: Json = {"name": name, "op_type": op_type, "description": description, "tags": tags, "axes": axes}
    if constraints:
        d["constraints"] = constraints
    d.update(inputs=inputs, outputs=outputs, reference=reference)
    if check:
        d["check"] = check
    return d


# ---------------------------------------------------------------------------------------------
# rmsnorm
# ---------------------------------------------------------------------------------------------


def rmsnorm(hidden: int, eps: float, model: str, tag: str) -> Json:
    """RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w, in fp32, bf16 out."""
    return _definition(
        f"rmsnorm_h{hidden}", "rmsnorm",
        f"Root Mean Square Normalization with hidden_size={hidden} ({model}). Epsilon is fixed at {eps:g}.",
        ["status:verified", f"model:{tag}", "fi_api:flashinfer.norm.rmsnorm"],
        {"batch_size": _var(), "hidden_size": _const(hidden)},
        {"hidden_states": _t(["batch_size", "hidden_size"], "bfloat16"), "weight": _t(["hidden_size"], "bfloat16")},
        {"output": _t(["batch_size", "hidden_size"], "bfloat16")},
        _src(RMSNORM_REF, H=hidden, EPS=eps),
    )


def fused_add_rmsnorm(hidden: int, eps: float, model: str, tag: str) -> Json:
    """RMSNorm of (hidden_states + residual), in fp32, bf16 out."""
    return _definition(
        f"fused_add_rmsnorm_h{hidden}", "rmsnorm",
        f"Fused Add + RMSNorm with hidden_size={hidden} ({model}): y = rmsnorm(hidden_states + residual) * weight. "
        f"Epsilon is fixed at {eps:g}.",
        ["status:verified", f"model:{tag}", "fused", "fi_api:flashinfer.norm.fused_add_rmsnorm"],
        {"batch_size": _var(), "hidden_size": _const(hidden)},
        {
            "hidden_states": _t(["batch_size", "hidden_size"], "bfloat16"),
            "residual": _t(["batch_size", "hidden_size"], "bfloat16"),
            "weight": _t(["hidden_size"], "bfloat16"),
        },
        {"output": _t(["batch_size", "hidden_size"], "bfloat16")},
        _src(FUSED_ADD_RMSNORM_REF, H=hidden, EPS=eps),
    )


# ---------------------------------------------------------------------------------------------
# gemm
# ---------------------------------------------------------------------------------------------


def gemm(n: int, k: int, model: str, tag: str, dtype: str = "float16") -> Json:
    """C = A @ B.T with fp32 accumulation; fp16 keeps FlashInfer's name, bf16 is named gemm_bf16_*."""
    prefix = "gemm" if dtype == "float16" else "gemm_bf16"
    return _definition(
        f"{prefix}_n{n}_k{k}", "gemm",
        f"General matrix multiply (GEMM) C = A @ B.T in {dtype} with fp32 accumulation. {model}.",
        ["status:verified", f"model:{tag}"],
        {"M": _var(), "N": _const(n), "K": _const(k)},
        {"A": _t(["M", "K"], dtype), "B": _t(["N", "K"], dtype)},
        {"C": _t(["M", "N"], dtype)},
        _src(GEMM_REF, N=n, K=k),
    )


def gemm_fp8_block_scale(n: int, k: int, model: str, tag: str) -> Json:
    """DeepSeek-style fp8 GEMM: per-token-per-128 activation scales, 128x128 weight-block scales."""
    return _definition(
        f"gemm_fp8_block_scale_n{n}_k{k}", "gemm",
        f"FP8 (e4m3) block-scaled GEMM C = dequant(A) @ dequant(B).T, bf16 out. {model}. "
        "A is scaled per token and per 128 columns (A_scale is [K/128, M], transposed as in DeepGEMM), "
        "B per 128x128 block. Judged by the matched-ratio rule: low-bit kernels may reorder the "
        "fp32 accumulation and rescale per block.",
        ["status:verified", f"model:{tag}", "quantization:float8_e4m3fn", "block_size:128"],
        {
            "M": _var(), "N": _const(n), "K": _const(k),
            "num_k_blocks": _const(k // 128, "K / 128."), "num_n_blocks": _const(n // 128, "N / 128."),
        },
        {
            "A": _t(["M", "K"], "float8_e4m3fn", "Activations, fp8."),
            "A_scale": _t(["num_k_blocks", "M"], "float32", "Activation scales per 128 columns (transposed)."),
            "B": _t(["N", "K"], "float8_e4m3fn", "Weights, fp8."),
            "B_scale": _t(["num_n_blocks", "num_k_blocks"], "float32", "Weight scales per 128x128 block."),
        },
        {"C": _t(["M", "N"], "bfloat16")},
        _src(GEMM_FP8_REF, N=n, K=k),
        check={"kind": "matched_ratio", "atol": 0.01, "rtol": 0.05, "matched_ratio": 0.99},
    )


# ---------------------------------------------------------------------------------------------
# gqa_paged decode / prefill
# ---------------------------------------------------------------------------------------------


def _paged_kv_axes(hq: int, hkv: int, d: int, ps: int) -> Json:
    return {
        "num_qo_heads": _const(hq, "Number of query/output attention heads."),
        "num_kv_heads": _const(hkv, "Number of key-value attention heads."),
        "head_dim": _const(d, "Dimension of each attention head."),
        "num_pages": _var("Total number of allocated pages in the KV cache."),
        "page_size": _const(ps, "Number of tokens stored per page."),
        "len_indptr": _var("Length of kv_indptr array."),
        "num_kv_indices": _var("Total number of KV page indices."),
    }


def _paged_cache_inputs() -> Json:
    return {
        "k_cache": _t(["num_pages", "page_size", "num_kv_heads", "head_dim"], "bfloat16", "Paged key cache."),
        "v_cache": _t(["num_pages", "page_size", "num_kv_heads", "head_dim"], "bfloat16", "Paged value cache."),
    }


_LSE = "The 2-based log-sum-exp of attention logits."
_SM_SCALE = "Softmax scale. Default is (1/sqrt(head_dim))."


def gqa_paged_decode(hq: int, hkv: int, d: int, ps: int, model: str, tag: str, tp: int = 1) -> Json:
    """Batched GQA decode over a paged KV cache; page_size 1 has no kv_last_page_len input."""
    axes = {"batch_size": _var("Total number of query tokens."), **_paged_kv_axes(hq, hkv, d, ps)}
    inputs: Json = {"q": _t(["batch_size", "num_qo_heads", "head_dim"], "bfloat16", "Query tensor for decode."),
                    **_paged_cache_inputs(),
                    "kv_indptr": _t(["len_indptr"], "int32", "KV page offsets for each sequence."),
                    "kv_indices": _t(["num_kv_indices"], "int32", "Page IDs for KV cache lookups.")}
    if ps > 1:
        inputs["kv_last_page_len"] = _t(["batch_size"], "int32", "Number of valid tokens in the last page for each sequence.")
    inputs["sm_scale"] = _t(None, "float32", _SM_SCALE)
    ref = _src(
        GQA_PAGED_DECODE_REF.replace("@LAST_ARG@", "kv_last_page_len, " if ps > 1 else "").replace(
            "@LAST_LEN@", "int(kv_last_page_len[b])" if ps > 1 else "1"),
        HQ=hq, HKV=hkv, D=d, PS=ps,
    )
    return _definition(
        f"gqa_paged_decode_h{hq}_kv{hkv}_d{d}_ps{ps}", "gqa_paged",
        f"Batched Grouped Query Attention decode with a paged KV cache (page_size={ps}). {model}. "
        "A sequence with no pages gives a zero output and lse = -inf.",
        ["stage:decode", "status:verified", f"model:{tag}", "fi_api:flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper",
         f"tp:{tp}"],
        axes, inputs,
        {"output": _t(["batch_size", "num_qo_heads", "head_dim"], "bfloat16", "Attention output tensor."),
         "lse": _t(["batch_size", "num_qo_heads"], "float32", _LSE)},
        ref,
        constraints=["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
    )


def gqa_paged_prefill(hq: int, hkv: int, d: int, ps: int, model: str, tag: str, tp: int = 1) -> Json:
    """Batched causal GQA prefill over a paged KV cache that already holds the new tokens."""
    axes = {
        "num_qo_heads": _const(hq, "Number of query/output attention heads."),
        "num_kv_heads": _const(hkv, "Number of key-value attention heads."),
        "head_dim": _const(d, "Dimension of each attention head."),
        "page_size": _const(ps, "Number of tokens stored per page."),
        "len_indptr": _var("Length of indptr arrays. Should be the same for qo_indptr and kv_indptr (batch_size + 1)."),
        "total_q": _var("Total number of query tokens."),
        "num_kv_indices": _var("Total number of KV page indices."),
        "num_pages": _var("Total number of allocated pages in the KV cache."),
        "batch_size": _var("Number of sequences in the batch."),
    }
    inputs = {
        "q": _t(["total_q", "num_qo_heads", "head_dim"], "bfloat16", "Query tensor for prefill."),
        **_paged_cache_inputs(),
        "qo_indptr": _t(["len_indptr"], "int32", "Query offsets for each sequence."),
        "kv_indptr": _t(["len_indptr"], "int32", "KV page offsets for each sequence."),
        "kv_indices": _t(["num_kv_indices"], "int32", "Page IDs for KV cache lookups."),
        "kv_last_page_len": _t(["batch_size"], "int32", "Number of valid tokens in the last page for each sequence."),
        "sm_scale": _t(None, "float32", _SM_SCALE),
    }
    return _definition(
        f"gqa_paged_prefill_causal_h{hq}_kv{hkv}_d{d}_ps{ps}", "gqa_paged",
        f"Batched Grouped Query Attention prefill with a paged KV cache (page_size={ps}). Causal mask is applied: "
        "the queries of a sequence are its last tokens, so query i of n_q sees keys up to n_kv - n_q + i. "
        f"{model}, incremental prefill (the cache already holds the prefix and the new tokens).",
        ["stage:prefill", "status:verified", f"model:{tag}",
         "fi_api:flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper", f"tp:{tp}"],
        axes, inputs,
        {"output": _t(["total_q", "num_qo_heads", "head_dim"], "bfloat16", "Attention output tensor."),
         "lse": _t(["total_q", "num_qo_heads"], "float32", _LSE)},
        _src(GQA_PAGED_PREFILL_REF, HQ=hq, HKV=hkv, D=d, PS=ps),
        constraints=["total_q == qo_indptr[-1].item()", "num_kv_indices == kv_indptr[-1].item()"],
    )


# ---------------------------------------------------------------------------------------------
# gqa_ragged prefill
# ---------------------------------------------------------------------------------------------


def gqa_ragged_prefill(hq: int, hkv: int, dqk: int, dvo: int, model: str, tag: str, tp: int = 1) -> Json:
    """Batched causal prefill on ragged (packed) q/k/v; head_dim_qk may differ from head_dim_vo."""
    same = dqk == dvo
    dq_axis, dv_axis = ("head_dim", "head_dim") if same else ("head_dim_qk", "head_dim_vo")
    axes: Json = {"num_qo_heads": _const(hq), "num_kv_heads": _const(hkv)}
    if same:
        axes["head_dim"] = _const(dqk)
    else:
        axes["head_dim_qk"] = _const(dqk, "Query/key head dimension (e.g. 128 nope + 64 rope).")
        axes["head_dim_vo"] = _const(dvo, "Value/output head dimension.")
    axes.update({
        "len_indptr": _var("Length of indptr arrays (batch_size + 1)."),
        "total_q": _var("Total number of query tokens."),
        "total_kv": _var("Total key-value tokens across all sequences."),
    })
    name = f"gqa_ragged_prefill_causal_h{hq}_kv{hkv}_d{dqk}" if same else \
        f"gqa_ragged_prefill_causal_h{hq}_kv{hkv}_dqk{dqk}_dvo{dvo}"
    return _definition(
        name, "gqa_ragged",
        "Batched Grouped Query Attention prefill with ragged (variable-length) inputs. Causal mask is applied: "
        f"query i of n_q sees keys up to n_kv - n_q + i. {model}, head_dim_qk={dqk}, head_dim_vo={dvo}.",
        ["stage:prefill", "status:verified", f"model:{tag}",
         "fi_api:flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper", f"tp:{tp}"],
        axes,
        {
            "q": _t(["total_q", "num_qo_heads", dq_axis], "bfloat16"),
            "k": _t(["total_kv", "num_kv_heads", dq_axis], "bfloat16"),
            "v": _t(["total_kv", "num_kv_heads", dv_axis], "bfloat16"),
            "qo_indptr": _t(["len_indptr"], "int32", "Query offsets for each sequence."),
            "kv_indptr": _t(["len_indptr"], "int32", "Key-value offsets for each sequence."),
            "sm_scale": _t(None, "float32", "Softmax scale. Default is (1/sqrt(head_dim_qk))."),
        },
        {"output": _t(["total_q", "num_qo_heads", dv_axis], "bfloat16", "Attention output tensor."),
         "lse": _t(["total_q", "num_qo_heads"], "float32", _LSE)},
        _src(GQA_RAGGED_REF, HQ=hq, HKV=hkv, DQK=dqk, DVO=dvo),
        constraints=["total_q == qo_indptr[-1].item()", "total_kv == kv_indptr[-1].item()"],
    )


# ---------------------------------------------------------------------------------------------
# mla_paged decode
# ---------------------------------------------------------------------------------------------


def mla_paged_decode(h: int, model: str, tag: str, tp: int) -> Json:
    """DeepSeek MLA decode in the absorbed form: 512 compressed kv dims + 64 rope dims, page_size 1."""
    return _definition(
        f"mla_paged_decode_h{h}_ckv512_kpe64_ps1", "mla_paged",
        f"Batched Multi-head Latent Attention decode with a paged KV cache (page_size=1), absorbed form: "
        f"logits = q_nope . ckv + q_pe . kpe, output = softmax . ckv. {model} with tensor parallel size {tp}.",
        ["stage:decode", "status:verified", f"model:{tag}", "fi_api:flashinfer.mla.BatchMLAPagedAttentionWrapper",
         f"tp:{tp}"],
        {
            "batch_size": _var(),
            "num_qo_heads": _const(h, f"Number of query heads after tensor parallel split (128/{tp}={h})."),
            "head_dim_ckv": _const(512), "head_dim_kpe": _const(64), "page_size": _const(1),
            "num_pages": _var("Total number of allocated pages in the KV cache."),
            "len_indptr": _var("Length of kv_indptr array."),
            "num_kv_indices": _var("Total number of KV page indices."),
        },
        {
            "q_nope": _t(["batch_size", "num_qo_heads", "head_dim_ckv"], "bfloat16",
                         "Query tensor without positional encoding component (absorbed into the compressed space)."),
            "q_pe": _t(["batch_size", "num_qo_heads", "head_dim_kpe"], "bfloat16", "Query positional encoding component."),
            "ckv_cache": _t(["num_pages", "page_size", "head_dim_ckv"], "bfloat16", "Compressed key-value cache."),
            "kpe_cache": _t(["num_pages", "page_size", "head_dim_kpe"], "bfloat16", "Key positional encoding cache."),
            "kv_indptr": _t(["len_indptr"], "int32", "KV page offsets for each sequence."),
            "kv_indices": _t(["num_kv_indices"], "int32", "Page indices for KV cache lookups."),
            "sm_scale": _t(None, "float32", "Softmax scale. Default is 1/sqrt(128 + 64), the head dimension before absorption."),
        },
        {"output": _t(["batch_size", "num_qo_heads", "head_dim_ckv"], "bfloat16"),
         "lse": _t(["batch_size", "num_qo_heads"], "float32", _LSE)},
        _src(MLA_DECODE_REF, H=h),
        constraints=["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
    )


# ---------------------------------------------------------------------------------------------
# fused MoE
# ---------------------------------------------------------------------------------------------


def _moe_axes(e: int, topk: int, h: int, i: int) -> Json:
    return {
        "seq_len": _var("Number of input tokens."),
        "num_experts": _const(e, "Number of experts."),
        "hidden_size": _const(h, "Hidden dimension size."),
        "intermediate_size": _const(i, "MoE expert intermediate size."),
        "gemm1_out_size": _const(2 * i, "Output size of the first GEMM (up and gate): 2 * intermediate_size."),
        "top_k": _const(topk, "Number of experts selected per token."),
    }


_MOE_ROUTING = ("Routing: top-k of routing_logits, softmax over the k chosen (renormalised top-k). "
                "gemm1 rows [0, I) are 'up', rows [I, 2I) are 'gate'; activation silu(gate) * up.")


def moe(e: int, topk: int, h: int, i: int, model: str, tag: str, quant: str = "bf16") -> Json:
    """Fused MoE (router top-k + renormalise, SwiGLU experts): bf16, or int8 w8a8 with per-channel scales."""
    axes = _moe_axes(e, topk, h, i)
    if quant == "bf16":
        inputs = {
            "hidden_states": _t(["seq_len", "hidden_size"], "bfloat16", "Input hidden states."),
            "routing_logits": _t(["seq_len", "num_experts"], "float32", "Router logits."),
            "gemm1_weights": _t(["num_experts", "gemm1_out_size", "hidden_size"], "bfloat16", "FC1 weights (up+gate)."),
            "gemm2_weights": _t(["num_experts", "hidden_size", "intermediate_size"], "bfloat16", "FC2 weights (down)."),
        }
        ref = _src(MOE_BF16_REF, E=e, TOPK=topk, H=h, I=i)
        desc = f"Fused MoE in bf16 with fp32 accumulation and an fp32 intermediate. {model}. {_MOE_ROUTING}"
        tags = ["status:verified", f"model:{tag}", "fi_api:flashinfer.fused_moe.cutlass_fused_moe"]
        name = f"moe_bf16_topk{topk}_e{e}_h{h}_i{i}"
    elif quant == "int8_w8a8":
        inputs = {
            "hidden_states": _t(["seq_len", "hidden_size"], "int8", "Input hidden states, int8 quantised per token."),
            "hidden_states_scale": _t(["seq_len"], "float32", "Per-token scales of hidden_states."),
            "routing_logits": _t(["seq_len", "num_experts"], "float32", "Router logits."),
            "gemm1_weights": _t(["num_experts", "gemm1_out_size", "hidden_size"], "int8", "FC1 weights (up+gate), int8."),
            "gemm1_weights_scale": _t(["num_experts", "gemm1_out_size"], "float32", "Per-output-channel scales of FC1."),
            "gemm2_weights": _t(["num_experts", "hidden_size", "intermediate_size"], "int8", "FC2 weights (down), int8."),
            "gemm2_weights_scale": _t(["num_experts", "hidden_size"], "float32", "Per-output-channel scales of FC2."),
        }
        ref = _src(MOE_INT8_REF, E=e, TOPK=topk, H=h, I=i)
        desc = (f"Fused MoE with int8 weights and activations (w8a8): int32-exact GEMMs, per-token activation scales, "
                f"per-output-channel weight scales; the SwiGLU output is re-quantised per token (symmetric, "
                f"round half to even, scale = max|x|/127) before FC2. {model}. {_MOE_ROUTING}")
        tags = ["status:verified", f"model:{tag}", "quantization:int8_w8a8"]
        name = f"moe_int8_w8a8_topk{topk}_e{e}_h{h}_i{i}"
    else:
        raise ValueError(f"quant: expected bf16 or int8_w8a8, got {quant!r}")
    return _definition(name, "moe", desc, tags, axes, inputs,
                       {"output": _t(["seq_len", "hidden_size"], "bfloat16", "Final MoE output tensor.")}, ref)


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------

_SAMPLING_DOC = {
    "top_k": "Top-k sampling from probabilities: keep every token of which fewer than k tokens are strictly more "
             "probable (ties at the boundary are all kept), renormalise, sample. k <= 0 or k >= vocab: no filter.",
    "top_p": "Top-p (nucleus) sampling from probabilities: keep every token whose strictly-more-probable tokens "
             "hold less than top_p of the mass (ties at the boundary are all kept; the most probable token always "
             "stays), renormalise, sample. top_p >= 1: no filter.",
    "top_k_top_p": "Top-k then top-p sampling from probabilities: the top-k filter (ties kept), renormalise, then the "
                   "top-p filter on the renormalised distribution (ties kept), renormalise, sample.",
}


def sampling(kind: str, vocab: int, models: list[str], draws: int) -> Json:
    """Sampling from probabilities, judged by TVD over `draws` draws plus a hard mask (check.kind=sampling)."""
    has_k, has_p = kind in ("top_k", "top_k_top_p"), kind in ("top_p", "top_k_top_p")
    inputs: Json = {"probs": _t(["batch_size", "vocab_size"], "float32", "Probability distributions (after softmax).")}
    if has_k:
        inputs["top_k"] = _t(["batch_size"], "int32", "Number of top tokens to consider for sampling per sequence.")
    if has_p:
        inputs["top_p"] = _t(["batch_size"], "float32", "Cumulative probability threshold per sequence.")
    ref = _src(SAMPLING_REF.replace("@ARGS@", ", ".join(inputs)).replace("@HAS_K@", str(has_k))
               .replace("@HAS_P@", str(has_p)), V=vocab)
    fi = {"top_k": "top_k_sampling_from_probs", "top_p": "top_p_sampling_from_probs",
          "top_k_top_p": "top_k_top_p_sampling_from_probs"}[kind]
    return _definition(
        f"{fi}_v{vocab}", "sampling",
        f"{_SAMPLING_DOC[kind]} vocab_size={vocab}. Judged by the total variation distance between the exact "
        f"filtered distribution and {draws} draws per row; a filtered-out token is an immediate failure.",
        ["status:verified", *(f"model:{m}" for m in models), f"fi_api:flashinfer.sampling.{fi}"],
        {"batch_size": _var("Number of sequences to sample from"), "vocab_size": _const(vocab, "Vocabulary size")},
        inputs,
        {"samples": _t(["batch_size"], "int64", "Sampled token indices")},
        ref,
        check={"kind": "sampling", "draws": draws},
    )


# ---------------------------------------------------------------------------------------------
# the catalogue: real model shapes, plus the FlashInfer baseline benchmark grid
# ---------------------------------------------------------------------------------------------
_BENCH = ("FlashInfer baseline benchmark shape", "flashinfer-benchmark")


def catalogue() -> list[Json]:
    """Every definition of the LLM dataset, in a stable order."""
    out: list[Json] = []
    for h, eps, model, tag in ((2048, 1e-6, "Qwen3-30B-A3B", "qwen3-30b-a3b"), (4096, 1e-5, "Llama-3.1-8B", "llama-3.1-8b"),
                               (7168, 1e-6, "DeepSeek-V3", "deepseek-v3")):
        out += [rmsnorm(h, eps, model, tag), fused_add_rmsnorm(h, eps, model, tag)]
    llama8 = "llama-3.1-8b"
    out += [
        gemm(2048, 2048, "Llama-3.2-1B attn.o_proj", "llama-3.2-1b"),
        gemm(4096, 4096, "Llama-3.1-8B attn.o_proj", llama8),
        gemm(6144, 4096, "Llama-3.1-8B attn.qkv_proj", llama8),
        gemm(28672, 4096, "Llama-3.1-8B mlp.gate_up_proj", llama8),
        gemm(4096, 14336, "Llama-3.1-8B mlp.down_proj", llama8),
        gemm(2048, 4096, "Qwen3-30B-A3B attn.o_proj", "qwen3-30b-a3b", dtype="bfloat16"),
        gemm(5120, 2048, "Qwen3-30B-A3B attn.qkv_proj", "qwen3-30b-a3b", dtype="bfloat16"),
        gemm(8192, 8192, "Llama-3.1-70B attn.o_proj", "llama-3.1-70b", dtype="bfloat16"),
        gemm_fp8_block_scale(1024, 2048, "Qwen3-0.6B-FP8 attn.o_proj", "qwen3-0.6b-fp8"),
        gemm_fp8_block_scale(1536, 7168, "DeepSeek-V3 attn.q_a_proj", "deepseek-v3"),
        gemm_fp8_block_scale(7168, 2048, "DeepSeek-V3 moe expert down_proj", "deepseek-v3"),
        gemm_fp8_block_scale(24576, 1536, "DeepSeek-V3 attn.q_b_proj", "deepseek-v3"),
    ]
    out += [
        gqa_paged_decode(32, 8, 128, 1, "Llama-3.1-8B", llama8),
        gqa_paged_decode(32, 8, 128, 16, "Llama-3.1-8B", llama8),
        gqa_paged_decode(32, 4, 128, 16, "Llama-3.1-70B at tensor parallel 2", "llama-3.1-70b", tp=2),
        gqa_paged_decode(32, 8, 64, 16, "Llama-3.2-1B", "llama-3.2-1b"),
        gqa_paged_decode(32, 4, 64, 16, *_BENCH),
        gqa_paged_decode(32, 8, 256, 16, *_BENCH),
        gqa_paged_decode(32, 4, 256, 16, *_BENCH),
        gqa_paged_prefill(32, 8, 128, 16, "Llama-3.1-8B", llama8),
        gqa_paged_prefill(32, 4, 128, 16, "Llama-3.1-70B at tensor parallel 2", "llama-3.1-70b", tp=2),
        gqa_ragged_prefill(32, 8, 128, 128, "Llama-3.1-8B", llama8),
        gqa_ragged_prefill(16, 16, 192, 128, "DeepSeek-V3 MHA prefill (128 nope + 64 rope) at tensor parallel 8",
                           "deepseek-v3", tp=8),
        gqa_ragged_prefill(16, 8, 256, 256, "Gemma-2-9B", "gemma-2-9b"),
        mla_paged_decode(16, "DeepSeek-V3", "deepseek-v3", tp=8),
        mla_paged_decode(64, "DeepSeek-V3", "deepseek-v3", tp=2),
        mla_paged_decode(128, "DeepSeek-V3", "deepseek-v3", tp=1),
    ]
    out += [
        moe(32, 8, 1024, 128, "Granite-3.0-1B-A400M at tensor parallel 4", "granite-3.0-1b-a400m"),
        moe(32, 8, 1024, 512, "Granite-3.0-1B-A400M", "granite-3.0-1b-a400m"),
        moe(64, 8, 2048, 1024, "OLMoE-1B-7B", "olmoe-1b-7b"),
        moe(128, 8, 2048, 768, "Qwen3-30B-A3B", "qwen3-30b-a3b"),
        moe(32, 8, 1024, 128, "Granite-3.0-1B-A400M at tensor parallel 4", "granite-3.0-1b-a400m", quant="int8_w8a8"),
        moe(128, 8, 2048, 768, "Qwen3-30B-A3B", "qwen3-30b-a3b", quant="int8_w8a8"),
    ]
    for vocab, models in ((32000, ["llama-2-7b", "mistral-7b-v0.1"]), (128256, ["llama-3.1-8b", "llama-3.1-70b"]),
                          (151936, ["qwen2.5-7b", "qwen3-30b-a3b"])):
        for kind in ("top_k", "top_p", "top_k_top_p"):
            out.append(sampling(kind, vocab, models, draws=400 if vocab == 32000 else 2000))
    return out
