"""XPU-OJ style problem package (fibray test data): y = silu(x) * alpha over a (T, H) bf16 tensor.

The convention (as in public XPU-OJ problem files): getNumOfTestcases(); getTestCaseSize() reads
the test case id from stdin and returns (argument shapes, (warmup, iters)) with () for scalars;
genTestCase(sizes, device) returns every kernel argument in order; baseline(*args) fills the
outputs in place and returns the arguments; check(...) compares; INPUT_CLASS marks each argument
INPUT or OUTPUT. The CUDA submission exports extern "C" run_kernel(args in the same order).
"""

from __future__ import annotations


def getNumOfTestcases() -> int:
    return 3


try:
    import sys
    from typing import List, Tuple, Union

    import torch

    KernelArg = Union[torch.Tensor, int, float]

    # (T, H, warmup, iters)
    _TESTCASES = [(4, 256, 5, 20), (16, 1024, 5, 20), (33, 512, 5, 20)]
    ALPHA = 0.5

    def getTestCaseSize() -> Tuple[List[Tuple[int, ...]], Tuple[int, int]]:
        testcase_id = int(input())
        if testcase_id < 1 or testcase_id > len(_TESTCASES):
            raise ValueError(f"Invalid testcase_id: {testcase_id}, must be in [1, {len(_TESTCASES)}]")
        T, H, warmup, iters = _TESTCASES[testcase_id - 1]
        return [(T, H), (T, H), (), (), ()], (warmup, iters)

    def genTestCase(testcase_sizes, device: str = "cuda") -> List[KernelArg]:
        raw = testcase_sizes[0] if isinstance(testcase_sizes, tuple) and len(testcase_sizes) == 2 else testcase_sizes
        x_shape, y_shape, _, _, _ = raw
        T, H = x_shape
        x = (torch.randn(T, H, device=device) * 3.0).to(torch.bfloat16)
        y = torch.zeros(*y_shape, dtype=torch.bfloat16, device=device)
        return [x, y, T, H, ALPHA]

    def baseline(x: torch.Tensor, y: torch.Tensor, T: int, H: int, alpha: float) -> List[KernelArg]:
        assert x.shape == (T, H) and y.shape == (T, H)
        y.copy_((torch.nn.functional.silu(x.float()) * alpha).to(torch.bfloat16))
        return [x, y, T, H, alpha]

    def check(testcase_sizes, original_input_tensors, target_kernel_input_tensors, baseline_input_tensors,
              rtol: float = 1e-2, atol: float = 1e-2) -> bool:
        y_t, y_ref = target_kernel_input_tensors[1], baseline_input_tensors[1]
        if y_t.shape != y_ref.shape or y_t.dtype != y_ref.dtype:
            print(f"[FAIL] got {tuple(y_t.shape)} {y_t.dtype}, expected {tuple(y_ref.shape)} {y_ref.dtype}", file=sys.stderr)
            return False
        ok = torch.allclose(y_t.float(), y_ref.float(), rtol=rtol, atol=atol)
        if not ok:
            print(f"[FAIL] max_abs_diff={float((y_t.float() - y_ref.float()).abs().max()):.6f}", file=sys.stderr)
        return ok
except Exception:
    pass

INPUT_CLASS = ["INPUT", "OUTPUT", "INPUT", "INPUT", "INPUT"]


def getWorkload(testcase_sizes) -> dict:
    raw = testcase_sizes[0] if isinstance(testcase_sizes, tuple) and len(testcase_sizes) == 2 else testcase_sizes
    T, H = raw[0]
    return {"flops": 5 * T * H, "memory_bytes": 4 * T * H, "dtype": "bf16"}


DESIGNED_VRAM_SIZE = 8
