"""Generate the LLM kernel dataset: definitions plus seeded serving-trace workloads with safetensors blobs.

    python -m fibray.generate --out datasets/llm --set cpu_small|gpu --seed 0

The same command writes the same bytes. Structured inputs (page tables, offsets, routing,
probabilities) are stored as blobs beside the JSONL; dense tensors stay `random`. Workloads
whose performance key (the axes and length statistics that change a kernel's speed) repeats
are dropped. It writes only under --out, and there only definitions/, workloads/<set>/ and blob/<set>/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from fibray.generate import _trace as st
from fibray.generate._defs import catalogue

__all__ = ["CPU_SMALL", "Draft", "SETS", "dedup", "drafts_for", "generate", "main"]

SETS = ("cpu_small", "gpu")

CPU_SMALL = frozenset({
    "rmsnorm_h2048", "rmsnorm_h4096", "rmsnorm_h7168",
    "fused_add_rmsnorm_h2048", "fused_add_rmsnorm_h4096", "fused_add_rmsnorm_h7168",
    "gemm_n2048_k2048", "gemm_bf16_n2048_k4096", "gemm_fp8_block_scale_n1024_k2048",
    "gqa_paged_decode_h32_kv8_d128_ps1", "gqa_paged_decode_h32_kv8_d128_ps16",
    "gqa_paged_prefill_causal_h32_kv8_d128_ps16",
    "gqa_ragged_prefill_causal_h32_kv8_d128", "gqa_ragged_prefill_causal_h16_kv16_dqk192_dvo128",
    "mla_paged_decode_h16_ckv512_kpe64_ps1",
    "moe_bf16_topk8_e32_h1024_i128", "moe_int8_w8a8_topk8_e32_h1024_i128",
    "top_k_sampling_from_probs_v32000", "top_p_sampling_from_probs_v32000",
    "top_k_top_p_sampling_from_probs_v32000",
})
"""Definitions with CPU-small workloads (small enough for PyTorch on CPU and the Triton interpreter)."""

_NAMESPACE = uuid.UUID("6f1b0c3e-7a51-4d0e-9d6a-2f4e8b1c9a77")


@dataclass
class Draft:
    """One workload before it is written: var axes, scalars, and the structured tensors of its blob."""

    axes: dict[str, int]
    key: tuple
    """Performance key: two drafts with equal keys of one definition are duplicates."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)


Family = Callable[[dict, str, np.random.Generator], list[Draft]]
_FAMILIES: dict[tuple[str, Optional[str]], Family] = {}


def _family(op_type: str, stage: Optional[str] = None) -> Callable[[Family], Family]:
    """Register the workload generator of an op_type (and stage tag, for attention)."""

    def deco(fn: Family) -> Family:
        _FAMILIES[(op_type, stage)] = fn
        return fn

    return deco


def _stage(definition: dict) -> Optional[str]:
    return next((t.split(":", 1)[1] for t in definition.get("tags", []) if t.startswith("stage:")), None)


def _bucket(x: float) -> float:
    """Half-octave bucket of a length statistic (what a kernel's speed is sensitive to)."""
    return round(math.log2(x + 1) * 2) / 2


def _const(definition: dict, axis: str) -> int:
    return int(definition["axes"][axis]["value"])


# ---------------------------------------------------------------------------------------------
# families
# ---------------------------------------------------------------------------------------------
@_family("rmsnorm")
def _rmsnorm(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    sizes = [1, 7] if wset == "cpu_small" else [1, 7, 64, 256, 1024, 4096, 8192]
    return [Draft({"batch_size": b}, (b,)) for b in sizes]


@_family("gemm")
def _gemm(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    if wset == "cpu_small":
        sizes = [3] if "num_k_blocks" in d["axes"] or _const(d, "N") * _const(d, "K") > 4e6 else [1, 7]
    else:
        sizes = [1, 7, 16, 64, 128, 512, 1000, 4096]
    return [Draft({"M": m}, (m,)) for m in sizes]


def _decode_key(lens: np.ndarray, ps: int) -> tuple:
    live = lens[lens > 0]
    return (len(lens), _bucket(live.mean() if live.size else 0), _bucket(live.max() if live.size else 0),
            bool((lens == 0).any()), bool((lens % ps != 0).any()) if ps > 1 else False)


def _decode_batches(wset: str, rng: np.random.Generator, primary: bool, head_dim: int) -> list[tuple[np.ndarray, str]]:
    """(kv lengths, how) per workload: serving mixes with edge cases, and the benchmark grid of uniform batches.

    The largest cell (batch 128 x 16384 tokens) is left out at head_dim 256: its KV cache alone is
    about 19 GB per input set, and the evaluator keeps several sets on each side of a job.
    """
    if wset == "cpu_small":
        return [(st.decode_lengths(rng, 5, 8, 48, edge_cases=True), "mix"), (np.array([33]), "single")]
    grid_b, grid_l = ([1, 16, 64, 128], [512, 2048, 8192, 16384]) if primary else ([1, 64, 128], [512, 4096, 16384])
    out = [(np.full(b, n), "grid") for b in grid_b for n in grid_l if not (head_dim > 128 and b * n > 64 * 16384)]
    out += [(st.decode_lengths(rng, b, 64, 16384, edge_cases=True), "mix") for b in (32, 128)]
    return out


@_family("gqa_paged", "decode")
def _gqa_decode(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    ps, hd = _const(d, "page_size"), _const(d, "head_dim")
    primary = _const(d, "num_kv_heads") == 8 and hd == 128
    drafts = []
    for lens, _ in _decode_batches(wset, rng, primary, hd):
        pt = st.page_table(rng, lens, ps)
        tensors = {"kv_indptr": pt.kv_indptr, "kv_indices": pt.kv_indices}
        if ps > 1:
            tensors["kv_last_page_len"] = pt.kv_last_page_len
        drafts.append(Draft(
            {"batch_size": len(lens), "num_pages": pt.num_pages, "len_indptr": len(lens) + 1,
             "num_kv_indices": int(pt.kv_indptr[-1])},
            _decode_key(lens, ps), tensors, {"sm_scale": 1.0 / math.sqrt(hd)}))
    return drafts


@_family("mla_paged", "decode")
def _mla_decode(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    if wset == "cpu_small":
        batches = [st.decode_lengths(rng, 4, 8, 48, edge_cases=True)]
    else:
        batches = [np.full(b, n) for b in (1, 16, 64, 128) for n in (1024, 4096, 16384)]
        batches += [st.decode_lengths(rng, b, 64, 16384, edge_cases=True) for b in (32, 128)]
    drafts = []
    for lens in batches:
        pt = st.page_table(rng, lens, 1)
        drafts.append(Draft(
            {"batch_size": len(lens), "num_pages": pt.num_pages, "len_indptr": len(lens) + 1,
             "num_kv_indices": int(pt.kv_indptr[-1])},
            _decode_key(lens, 1), {"kv_indptr": pt.kv_indptr, "kv_indices": pt.kv_indices},
            {"sm_scale": 1.0 / math.sqrt(128 + 64)}))
    return drafts


def _prefill_batches(wset: str, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(q lengths, kv lengths): serving mixes with empty and length-1 queries, and uniform benchmark batches."""
    if wset == "cpu_small":
        return [st.prefill_lengths(rng, 4, 4, 24, 20, edge_cases=True)]
    out = [(np.full(b, n), np.full(b, n)) for b, n in ((1, 1024), (1, 4096), (1, 8192), (4, 2048), (16, 512), (16, 2048))]
    out += [st.prefill_lengths(rng, b, 16, 2048, 4096, edge_cases=True) for b in (8, 32)]
    return out


def _prefill_key(q: np.ndarray, kv: np.ndarray) -> tuple:
    return (len(q), _bucket(q.sum()), _bucket(kv.sum()), _bucket(q.max()), _bucket(kv.max()), bool((q == 0).any()))


@_family("gqa_paged", "prefill")
def _gqa_paged_prefill(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    ps, hd = _const(d, "page_size"), _const(d, "head_dim")
    drafts = []
    for q, kv in _prefill_batches(wset, rng):
        pt = st.page_table(rng, kv, ps)
        qo = st.ragged_indptr(q, kv).qo_indptr
        drafts.append(Draft(
            {"len_indptr": len(q) + 1, "total_q": int(q.sum()), "num_kv_indices": int(pt.kv_indptr[-1]),
             "num_pages": pt.num_pages, "batch_size": len(q)},
            _prefill_key(q, kv),
            {"qo_indptr": qo, "kv_indptr": pt.kv_indptr, "kv_indices": pt.kv_indices,
             "kv_last_page_len": pt.kv_last_page_len},
            {"sm_scale": 1.0 / math.sqrt(hd)}))
    return drafts


@_family("gqa_ragged", "prefill")
def _gqa_ragged(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    axes = d["axes"]
    dqk = int((axes.get("head_dim") or axes["head_dim_qk"])["value"])
    drafts = []
    for q, kv in _prefill_batches(wset, rng):
        rb = st.ragged_indptr(q, kv)
        drafts.append(Draft(
            {"len_indptr": len(q) + 1, "total_q": int(q.sum()), "total_kv": int(kv.sum())},
            _prefill_key(q, kv), {"qo_indptr": rb.qo_indptr, "kv_indptr": rb.kv_indptr},
            {"sm_scale": 1.0 / math.sqrt(dqk)}))
    return drafts


@_family("moe")
def _moe(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    e, topk = _const(d, "num_experts"), _const(d, "top_k")
    h, i = _const(d, "hidden_size"), _const(d, "intermediate_size")
    int8 = d["inputs"]["hidden_states"]["dtype"] == "int8"
    plan = [(1, 0.0), (5, 1.5)] if wset == "cpu_small" else \
        [(1, 0.0), (8, 0.0), (64, 0.0), (64, 1.2), (512, 0.0), (512, 1.2), (2048, 1.2), (8192, 0.0), (8192, 1.2)]
    drafts = []
    for t, zipf in plan:
        logits = st.routing_logits(rng, t, e, zipf)
        tensors = {"routing_logits": logits}
        if int8:
            # realistic magnitudes: dequantised activations ~O(1), weights ~1/sqrt(fan_in)
            tensors["hidden_states_scale"] = torch.from_numpy(rng.uniform(0.5, 1.5, t).astype(np.float32) * (3 / 127))
            tensors["gemm1_weights_scale"] = torch.from_numpy(
                rng.uniform(0.5, 1.5, (e, 2 * i)).astype(np.float32) / (74 * math.sqrt(h)))
            tensors["gemm2_weights_scale"] = torch.from_numpy(
                rng.uniform(0.5, 1.5, (e, h)).astype(np.float32) / (74 * math.sqrt(i)))
        skew = st.routing_skew(logits, topk) if t * topk >= e else 0.0
        drafts.append(Draft({"seq_len": t}, (t, round(skew)), tensors))
    return drafts


@_family("sampling")
def _sampling(d: dict, wset: str, rng: np.random.Generator) -> list[Draft]:
    vocab = _const(d, "vocab_size")
    kind = "top_k_top_p" if {"top_k", "top_p"} <= set(d["inputs"]) else ("top_k" if "top_k" in d["inputs"] else "top_p")
    plan = [("plain", 1), ("ties", 1)] if wset == "cpu_small" else [("plain", 1), ("plain", 16), ("plain", 64), ("ties", 8)]
    drafts = []
    for scenario, batch in plan:
        probs, top_k, top_p = st.sampling_rows(rng, vocab, batch, scenario, kind)
        tensors = {"probs": probs}
        if "top_k" in d["inputs"]:
            tensors["top_k"] = top_k
        if "top_p" in d["inputs"]:
            tensors["top_p"] = top_p
        drafts.append(Draft({"batch_size": batch}, (batch, scenario), tensors))
    return drafts


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def drafts_for(definition: dict, wset: str, seed: int) -> list[Draft]:
    """The deduplicated drafts of one definition; the generator is seeded per (seed, set, definition)."""
    fn = _FAMILIES.get((definition["op_type"], _stage(definition))) or _FAMILIES.get((definition["op_type"], None))
    if fn is None:
        raise ValueError(f"{definition['name']}: no workload family for op_type {definition['op_type']!r}")
    digest = hashlib.sha256(f"{seed}:{wset}:{definition['name']}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return dedup(fn(definition, wset, rng))


def dedup(drafts: Iterable[Draft]) -> list[Draft]:
    """Keep the first draft of each performance key."""
    seen: set[tuple] = set()
    out = []
    for dr in drafts:
        if dr.key not in seen:
            seen.add(dr.key)
            out.append(dr)
    return out


def _blob_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in sorted(tensors.items())})


def _workload_line(definition: dict, draft: Draft, wset: str, seed: int, blob: Optional[str]) -> str:
    inputs: dict[str, dict] = {}
    for name in definition["inputs"]:
        if name in draft.tensors:
            inputs[name] = {"type": "safetensors", "path": blob, "tensor_key": name}
        elif name in draft.scalars:
            inputs[name] = {"type": "scalar", "value": draft.scalars[name]}
        else:
            inputs[name] = {"type": "random"}
    ident = uuid.uuid5(_NAMESPACE, json.dumps([definition["name"], wset, seed, draft.axes, list(draft.key), blob],
                                              default=str))
    workload = {"uuid": str(ident), "axes": draft.axes, "inputs": inputs}
    return json.dumps({"definition": definition["name"], "solution": None, "workload": workload, "evaluation": None})


def write_definitions(out: Path, names: Optional[Sequence[str]] = None) -> list[Path]:
    """Write definitions/<op_type>/<name>.json for the catalogue (or the named subset)."""
    paths = []
    for d in catalogue():
        if names is not None and d["name"] not in names:
            continue
        path = out / "definitions" / d["op_type"] / f"{d['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def generate(out: Path, wset: str, seed: int = 0, names: Optional[Sequence[str]] = None) -> dict[str, int]:
    """Write definitions and one workload set (replacing workloads/<set>/ and blob/<set>/); returns counts per definition."""
    if wset not in SETS:
        raise ValueError(f"--set: expected one of {SETS}, got {wset!r}")
    out = Path(out)
    defs = [d for d in catalogue() if (wset != "cpu_small" or d["name"] in CPU_SMALL) and (names is None or d["name"] in names)]
    if names is not None:
        unknown = sorted(set(names) - {d["name"] for d in catalogue()})
        if unknown:
            raise ValueError(f"--only: unknown definitions {unknown}")
    write_definitions(out)
    for sub in (out / "workloads" / wset, out / "blob" / wset):
        if sub.exists() and names is None:
            shutil.rmtree(sub)
    counts: dict[str, int] = {}
    for d in defs:
        lines = []
        for draft in drafts_for(d, wset, seed):
            blob = None
            if draft.tensors:
                data = _blob_bytes(draft.tensors)
                blob = f"blob/{wset}/{d['op_type']}/{d['name']}/{d['name']}_{hashlib.sha256(data).hexdigest()[:16]}.safetensors"
                path = out / blob
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    path.write_bytes(data)
            lines.append(_workload_line(d, draft, wset, seed, blob))
        target = out / "workloads" / wset / d["op_type"] / f"{d['name']}.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts[d["name"]] = len(lines)
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fibray.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="dataset root to write (e.g. datasets/llm)")
    parser.add_argument("--set", required=True, choices=SETS, dest="wset", help="workload set")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--only", nargs="+", default=None, metavar="DEFINITION", help="generate these definitions only")
    args = parser.parse_args(argv)
    try:
        counts = generate(args.out, args.wset, args.seed, args.only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(counts.values())
    print(f"{args.out}: {total} {args.wset} workloads for {len(counts)} definitions (seed {args.seed})")
    return 0
