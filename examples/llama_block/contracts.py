"""The block's kernel contracts (definitions) and candidates (solutions), for any block shape.

GEMM and RMSNorm candidates are the repository's bundled solutions (solutions/), whose
sources do not depend on the shape, re-targeted to the block's definitions; attention
candidates live in kernels/. `write_dataset` lays them out as a FlashInfer Trace folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from examples.llama_block.block import BlockConfig
from examples.llama_block.ops import attention_name, gemm_name, rmsnorm_name
from fibray.schema import Definition, Solution

REPO = Path(__file__).resolve().parents[2]
KERNELS = Path(__file__).resolve().parent / "kernels"

BUNDLED_RMSNORM = ["rmsnorm_h4096_torch", "rmsnorm_h4096_triton", "rmsnorm_h4096_triton_big_eps"]
"""Bundled RMSNorm candidates swept on the block (the last one must fail: wrong epsilon)."""
BUNDLED_GEMM = ["gemm_n4096_k4096_torch", "gemm_n4096_k4096_triton", "gemm_n4096_k4096_torch_fp32_out"]
"""Bundled GEMM candidates swept on the block (the last one must fail: float32 output)."""
ATTENTION_KERNELS = {
    "sdpa_loop": ("fibray-team", "Per-sequence SDPA with a causal mask, value-returning."),
    "sdpa_padded": ("fibray-team", "One batched SDPA over padded sequences, value-returning."),
    "sdpa_not_causal": ("agent-x", "Forgets the causal mask: must be INCORRECT_NUMERICAL."),
}

RMSNORM_REFERENCE = """import torch

def run(hidden_states, weight):
    x = hidden_states.to(torch.float32)
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
    return ((x * inv_rms) * weight.to(torch.float32)).to(hidden_states.dtype)
"""

GEMM_REFERENCE = """import torch

def run(A, B):
    return (A.to(torch.float32) @ B.to(torch.float32).T).to(A.dtype)
"""

ATTENTION_REFERENCE = """import torch

def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        qb = q[q0:q1].float().transpose(0, 1)
        kb = k[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qb @ kb.transpose(1, 2)) * sm_scale
        causal = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril((k1 - k0) - (q1 - q0))
        scores = scores.masked_fill(~causal, float("-inf"))
        out[q0:q1] = (scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
    return out
"""


def _tensor(shape: list[str] | None, dtype: str) -> dict:
    return {"shape": shape, "dtype": dtype}


def definitions(c: BlockConfig) -> list[Definition]:
    """The block's contracts: one RMSNorm, four GEMMs, one ragged causal GQA attention."""
    dt = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[c.dtype]
    tag = f"Llama-style block, hidden {c.hidden}, {c.dtype}."
    out = [Definition.model_validate({
        "name": rmsnorm_name(c.hidden, c.torch_dtype), "op_type": "rmsnorm",
        "description": f"RMSNorm, epsilon 1e-5. {tag}",
        "axes": {"batch_size": {"type": "var"}, "hidden_size": {"type": "const", "value": c.hidden}},
        "inputs": {"hidden_states": _tensor(["batch_size", "hidden_size"], dt), "weight": _tensor(["hidden_size"], dt)},
        "outputs": {"output": _tensor(["batch_size", "hidden_size"], dt)},
        "reference": RMSNORM_REFERENCE,
    })]
    qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
    for n, k, role in ((qkv, c.hidden, "qkv_proj"), (c.hidden, c.heads * c.head_dim, "o_proj"),
                       (2 * c.intermediate, c.hidden, "gate_up_proj"), (c.hidden, c.intermediate, "down_proj")):
        out.append(Definition.model_validate({
            "name": gemm_name(n, k, c.torch_dtype), "op_type": "gemm",
            "description": f"C = A @ B.T ({role}). {tag}",
            "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": n}, "K": {"type": "const", "value": k}},
            "inputs": {"A": _tensor(["M", "K"], dt), "B": _tensor(["N", "K"], dt)},
            "outputs": {"C": _tensor(["M", "N"], dt)},
            "reference": GEMM_REFERENCE,
        }))
    out.append(Definition.model_validate({
        "name": attention_name(c.heads, c.kv_heads, c.head_dim, c.torch_dtype), "op_type": "gqa_ragged",
        "description": f"Causal GQA prefill over ragged sequences (indptr bounds). {tag}",
        "axes": {
            "total_q": {"type": "var"}, "total_kv": {"type": "var"}, "len_indptr": {"type": "var"},
            "num_qo_heads": {"type": "const", "value": c.heads}, "num_kv_heads": {"type": "const", "value": c.kv_heads},
            "head_dim": {"type": "const", "value": c.head_dim},
        },
        "inputs": {
            "q": _tensor(["total_q", "num_qo_heads", "head_dim"], dt),
            "k": _tensor(["total_kv", "num_kv_heads", "head_dim"], dt),
            "v": _tensor(["total_kv", "num_kv_heads", "head_dim"], dt),
            "qo_indptr": _tensor(["len_indptr"], "int32"),
            "kv_indptr": _tensor(["len_indptr"], "int32"),
            "sm_scale": _tensor(None, "float32"),
        },
        "outputs": {"o": _tensor(["total_q", "num_qo_heads", "head_dim"], dt)},
        "reference": ATTENTION_REFERENCE,
    }))
    return out


def _bundled(name: str) -> Solution:
    op = "gemm" if name.startswith("gemm") else "rmsnorm"
    matches = sorted((REPO / "solutions" / op).glob(f"**/{name}.json"))
    if not matches:
        raise FileNotFoundError(f"bundled solution {name!r} not found under {REPO / 'solutions' / op}")
    return Solution.model_validate(json.loads(matches[0].read_text(encoding="utf-8")))


def _retarget(solution: Solution, definition: str, prefix: str) -> Solution:
    raw = solution.model_dump(mode="json", exclude_unset=True)
    raw["name"] = definition + solution.name.removeprefix(prefix)
    raw["definition"] = definition
    return Solution.model_validate(raw)


def solutions(c: BlockConfig) -> list[Solution]:
    """Candidates for every definition of the block."""
    out: list[Solution] = []
    for d in definitions(c):
        if d.op_type == "rmsnorm":
            out += [_retarget(_bundled(n), d.name, "rmsnorm_h4096") for n in BUNDLED_RMSNORM]
        elif d.op_type == "gemm":
            out += [_retarget(_bundled(n), d.name, "gemm_n4096_k4096") for n in BUNDLED_GEMM]
        else:
            for kernel, (author, description) in ATTENTION_KERNELS.items():
                out.append(Solution.model_validate({
                    "name": f"{d.name}_{kernel}", "definition": d.name, "author": author, "description": description,
                    "spec": {"language": "python", "target_hardware": ["cuda", "cpu"], "entry_point": "main.py::run",
                             "destination_passing_style": False},
                    "sources": [{"path": "main.py",
                                 "content": (KERNELS / f"attention_{kernel}.py").read_text(encoding="utf-8")}],
                }))
    return out


def write_dataset(root: Path, c: BlockConfig) -> Path:
    """Definitions and solutions of the block as a FlashInfer Trace folder (workloads come from tracing)."""
    root = Path(root)
    for d in definitions(c):
        path = root / "definitions" / d.op_type / f"{d.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d.to_json_dict(), indent=2) + "\n", encoding="utf-8")
    for s in solutions(c):
        path = root / "solutions" / s.definition / f"{s.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(s.to_json_dict(), indent=2) + "\n", encoding="utf-8")
    return root
