"""Run Triton on a machine with no GPU: the interpreter, with GPU-faithful casts.

Triton's interpreter truncates fp32->bf16 casts while GPUs round to nearest even; a
correct bf16 kernel would then miss tight tolerances on CPU only. We patch that cast.
"""

from __future__ import annotations

import os
import sys

import numpy as np

_patched = False


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16) rounded to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    rounded = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    quiet = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(nan, quiet, rounded)


def patch_interpreter_casts() -> None:
    """Make the interpreter's fp32->bf16 cast round to nearest even, like the GPU."""
    global _patched
    if _patched:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(fp32_to_bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl

    # Triton 3.9's interpreter multiplies bf16 operands as their raw uint16 bit patterns in
    # tl.dot (garbage results) and fp16 ones in numpy's slow fp16 matmul: widen both to fp32,
    # which is exact for the products, like the GPU's fp32-accumulating MMA.
    original_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widened(h):
            if h.dtype.scalar in (tl.bfloat16, tl.float16):
                return interpreter.TensorHandle(np.asarray(self.cast_impl(h, tl.float32).data, dtype=np.float32), tl.float32)
            return h
        return original_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _patched = True


def _cuda_error() -> str:
    """Why torch cannot use CUDA in this process (its first line)."""
    import torch

    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001  (the reason is all that is wanted)
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return "torch.cuda.is_available() is False"


def prepare_triton(device: str | None = None) -> None:
    """Select the interpreter when there is no GPU and patch it.

    Must run before triton is first imported: triton decorates its own standard library
    (tl.sum, tl.cdiv, ...) at import time, interpreted or compiled, once and for all.
    `device`: the device this process is to run on; for a CUDA one the interpreter is never
    selected, and CUDA unusable here is an error that says why.
    """
    if device is not None and device.startswith("cuda"):
        if not has_cuda():
            raise RuntimeError(f"this process is to run on {device}, but CUDA is unusable in it: {_cuda_error()}")
        return
    if not has_cuda() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise RuntimeError(
                "triton was imported before fibray could select its CPU interpreter; "
                "set TRITON_INTERPRET=1 in the environment or call fibray.compile.prepare_triton() first"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        patch_interpreter_casts()
