"""Pack the kernel sources of this folder into Solution files under ../solutions/ (one per definition and variant).

    /work/venv/bin/python datasets/llm/kernels/pack.py

Each solution carries its source inline as main.py (constants such as eps or top_k filled in
for its definition). Files whose name contains `_cuda` are left alone: they are written by hand.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Variant:
    """One solution of a family: which file and function, how it is called, who wrote it, what it is."""

    suffix: str
    file: str
    entry: str
    dps: bool
    author: str
    language: str
    description: str


def _variants(d: dict[str, Any]) -> list[Variant]:
    name, op = d["name"], d["op_type"]
    t = "triton"
    if op == "rmsnorm":
        fn = "fused_add_rmsnorm" if name.startswith("fused_add") else "rmsnorm"
        return [Variant("torch", "rmsnorm_torch.py", fn, False, "fibray-team", "python", "PyTorch, fp32 math."),
                Variant("triton", "rmsnorm_triton.py", fn, True, "agent-y", t, "One program per row, fp32 accumulation.")]
    if op == "gemm":
        fn = "gemm_fp8_block_scale" if name.startswith("gemm_fp8") else "gemm"
        return [Variant("torch", "gemm_torch.py", fn, False, "fibray-team", "python", "PyTorch matmul."),
                Variant("triton", "gemm_triton.py", fn, True, "agent-y", t, "Tiled Triton GEMM, fp32 accumulation.")]
    if op in ("gqa_paged", "gqa_ragged", "mla_paged"):
        fn = {"gqa_paged": "gqa_paged_prefill" if "prefill" in name else "gqa_paged_decode",
              "gqa_ragged": "gqa_ragged_prefill", "mla_paged": "mla_paged_decode"}[op]
        return [Variant("torch", "attention_torch.py", fn, False, "fibray-team", "python",
                        "PyTorch, GQA groups without KV expansion, fp32 softmax."),
                Variant("triton", "attention_triton.py", fn, True, "agent-y", t,
                        "Triton: KV streamed in blocks (pages looked up per token) with an online base-2 softmax.")]
    if op == "moe":
        fn = "moe_int8" if "int8" in name else "moe_bf16"
        return [Variant("torch", "moe_torch.py", fn, False, "fibray-team", "python", "PyTorch, one GEMM pair per expert."),
                Variant("triton", "moe_triton.py", fn, True, "agent-y", t,
                        "Triton grouped GEMM over expert-sorted slots, SwiGLU fused into the first GEMM.")]
    if op == "sampling":
        kind = name.split("_sampling_from_probs")[0]  # top_k | top_p | top_k_top_p
        fn = f"{kind}_sampling"
        out = [Variant("torch", "sampling_torch.py", fn, False, "fibray-team", "python",
                       "PyTorch: one sort, the tie-keeping filter in sorted order, an inverse-CDF draw."),
               Variant("triton", "sampling_triton.py", fn, True, "agent-y", t,
                       "Triton: sorting-free rejection sampling (pivot rounds), exact for the filtered distribution.")]
        wrong = {
            "top_k": [("torch_unnormalized", "unnormalized_top_k", "Biased on purpose: u is not scaled by the kept mass."),
                      ("torch_k_plus_one", "k_plus_one", "Wrong on purpose: keeps one token too many."),
                      ("torch_sorted", "sorted_top_k", "Breaks ties by position (a sorted prefix): wrong on boundary ties.")],
            "top_p": [("torch_unnormalized", "unnormalized_top_p", "Biased on purpose: u is not scaled by the kept mass."),
                      ("torch_sorted", "sorted_top_p", "Breaks ties by position (a sorted prefix): wrong on boundary ties.")],
            "top_k_top_p": [("torch_top_k_only", "top_k_only", "Wrong on purpose: forgets the top-p filter."),
                            ("torch_sorted", "sorted_top_k_top_p", "Breaks ties by position: wrong on boundary ties.")],
        }[kind]
        out += [Variant(sfx, "sampling_torch_wrong.py", fn_, False, "agent-y", "python", desc) for sfx, fn_, desc in wrong]
        return out
    raise ValueError(f"{name}: no kernels for op_type {op!r}")


def _constants(d: dict[str, Any]) -> dict[str, Any]:
    """Per-definition constants the sources leave as "@NAME@" placeholders."""
    consts: dict[str, Any] = {}
    if d["op_type"] == "rmsnorm":
        consts["EPS"] = float(re.search(r"torch\.rsqrt\(variance \+ ([0-9.e-]+)\)", d["reference"]).group(1))
    if d["op_type"] == "moe":
        consts["TOP_K"] = int(d["axes"]["top_k"]["value"])
    return consts


def solution(d: dict[str, Any], v: Variant) -> dict[str, Any]:
    src = (HERE / v.file).read_text(encoding="utf-8")
    for key, value in _constants(d).items():
        src = src.replace(f'"@{key}@"', repr(value))
    left = re.findall(r'"@[A-Z_]+@"', src)
    if left:
        raise ValueError(f"{d['name']}/{v.suffix}: unfilled placeholders {left} in {v.file}")
    return {
        "name": f"{d['name']}_{v.suffix}",
        "definition": d["name"],
        "author": v.author,
        "spec": {
            "language": v.language,
            "target_hardware": ["cuda", "cpu"],
            "entry_point": f"main.py::{v.entry}",
            "dependencies": [],
            "destination_passing_style": v.dps,
        },
        "sources": [{"path": "main.py", "content": src}],
        "description": f"{v.description} (from datasets/llm/kernels/{v.file})",
    }


def pack(root: Path = ROOT, only: Optional[set[str]] = None) -> list[Path]:
    """Write every solution of every definition under root/definitions; returns the paths written."""
    written = []
    for path in sorted((root / "definitions").rglob("*.json")):
        d = json.loads(path.read_text(encoding="utf-8"))
        if only and d["name"] not in only:
            continue
        folder = root / "solutions" / d["op_type"] / d["name"]
        for v in _variants(d):
            target = folder / f"{d['name']}_{v.suffix}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(solution(d, v), indent=2) + "\n", encoding="utf-8")
            written.append(target)
    return written


if __name__ == "__main__":
    paths = pack(only=set(sys.argv[1:]) or None)
    print(f"wrote {len(paths)} solutions under {ROOT / 'solutions'}")
