"""Materialise a workload's inputs on a device: seeded random tensors, scalars, safetensors blobs.

Random inputs depend only on (eval seed, the sweep's input key, workload, trial, input name,
distribution), so every solution of a workload in a sweep sees the same data and references
can be reused, while no candidate can know them before the sweep's secret salt is drawn. A
blob that is missing or does not match the definition is an InputError, never random data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

import torch

from fibray.schema import Definition, DType, Job, RandomInputSpec, SafetensorsInput, ScalarInput, Workload

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT8_E4M3FN: torch.float8_e4m3fn,
    DType.FLOAT8_E5M2: torch.float8_e5m2,
    DType.FLOAT4_E2M1: getattr(torch, "float4_e2m1fn_x2", torch.uint8),
    DType.INT64: torch.int64,
    DType.INT32: torch.int32,
    DType.INT16: torch.int16,
    DType.INT8: torch.int8,
    DType.BOOL: torch.bool,
}
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""The fp8 dtypes a definition can name: floating point, but without arithmetic in torch."""
_INT_RANGES = {torch.int8: (-128, 128), torch.int16: (-1024, 1024), torch.int32: (-1024, 1024), torch.int64: (-1024, 1024)}


class InputError(ValueError):
    """A workload input cannot be materialised (missing blob, key, wrong shape or dtype)."""


def torch_dtype(dtype: DType) -> torch.dtype:
    return TORCH_DTYPES[dtype]


DISTRIBUTIONS = ("normal", "outliers", "mixed")
"""eval.input_distribution values."""
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DEFAULT_SPEC = RandomInputSpec()


def input_seed(seed: int, workload_uuid: str, trial: int, name: str, key: str = "") -> int:
    """Deterministic 63-bit seed of one random input (`key`: the sweep's input key, or none)."""
    text = f"{seed}:{workload_uuid}:{trial}:{name}" if not key else f"{seed}:{key}:{workload_uuid}:{trial}:{name}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def draws_outliers(distribution: str, trial: int) -> bool:
    """Whether a trial's random floats take outliers: always, never, or on odd trials (mixed)."""
    if distribution not in DISTRIBUTIONS:
        raise InputError(f"eval.input_distribution: {distribution!r} is not one of {list(DISTRIBUTIONS)}")
    return distribution == "outliers" or (distribution == "mixed" and trial % 2 == 1)


def _add_outliers(x: torch.Tensor, dtype: torch.dtype, spec: RandomInputSpec, gen: torch.Generator) -> torch.Tensor:
    """Scale a random `outlier_fraction` of x (fp32 N(0,1) values) by log-uniform factors in
    `outlier_scale`, kept within half the target dtype's largest finite value."""
    flat = x.view(-1)
    k = max(1, round(spec.outlier_fraction * flat.numel())) if flat.numel() else 0
    if not k:
        return x
    idx = torch.randint(0, flat.numel(), (k,), generator=gen, device=x.device)  # a repeat only makes fewer
    lo, hi = spec.outlier_scale
    u = torch.rand(k, generator=gen, device=x.device, dtype=torch.float32)
    factor = torch.exp(torch.log(torch.tensor(lo)) + u * (torch.log(torch.tensor(hi)) - torch.log(torch.tensor(lo))))
    big = flat[idx] * factor
    limit = torch.finfo(dtype).max / 2
    flat[idx] = big.clamp_(-limit, limit)
    return x


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int,
                  outliers: Optional[RandomInputSpec] = None) -> torch.Tensor:
    """A dtype-appropriate random tensor: N(0,1) floats (fp8 clamped to [-2, 2]), small ints,
    bools; with `outliers`, a fraction of a float tensor's values scaled into outliers."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if dtype in _FLOATS:
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return (_add_outliers(x, dtype, outliers, gen) if outliers is not None else x).to(dtype)
    if dtype in FP8_DTYPES:
        x = torch.randn(shape, generator=gen, device=device).clamp_(-2.0, 2.0)
        return (_add_outliers(x, dtype, outliers, gen) if outliers is not None else x).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen, device=device, dtype=torch.bool)
    if dtype in _INT_RANGES:
        lo, hi = _INT_RANGES[dtype]
        return torch.randint(lo, hi, shape, generator=gen, device=device, dtype=dtype)
    raise InputError(f"cannot draw random values of dtype {dtype}")


class BlobCache:
    """Safetensors files loaded once per process (CPU copies), keyed by path."""

    def __init__(self) -> None:
        self._files: dict[Path, dict[str, torch.Tensor]] = {}

    def tensor(self, root: Path, src: SafetensorsInput, input_name: str) -> torch.Tensor:
        path = (root / src.path).resolve()
        if path not in self._files:
            if not path.is_file():
                raise InputError(f"workload.inputs.{input_name}.path: safetensors blob {src.path!r} not found under {root}")
            from safetensors.torch import load_file

            try:
                self._files[path] = load_file(str(path), device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise InputError(f"workload.inputs.{input_name}.path: cannot read {path}: {e}") from e
        tensors = self._files[path]
        if src.tensor_key not in tensors:
            raise InputError(
                f"workload.inputs.{input_name}.tensor_key: {src.tensor_key!r} not in {path} (keys: {sorted(tensors)})"
            )
        return tensors[src.tensor_key]


def materialize(
    definition: Definition,
    workload: Workload,
    *,
    root: Path,
    seed: int,
    trial: int,
    device: torch.device,
    blobs: Optional[BlobCache] = None,
    key: str = "",
    distribution: str = "normal",
) -> list[Any]:
    """The inputs of one trial, in definition order (`key`, `distribution`: see job_inputs)."""
    blobs = blobs or BlobCache()
    shapes = definition.input_shapes(workload.axes)
    draw = definition.random_inputs or _DEFAULT_SPEC
    outliers = draws_outliers(distribution, trial)
    args: list[Any] = []
    for name, spec in definition.inputs.items():
        src = workload.inputs.get(name)
        dtype = torch_dtype(spec.dtype)
        if isinstance(src, ScalarInput):
            args.append(src.value)
        elif isinstance(src, SafetensorsInput):
            t = blobs.tensor(root, src, name)
            if shapes[name] is not None and tuple(t.shape) != shapes[name]:
                raise InputError(f"workload.inputs.{name}: blob shape {tuple(t.shape)}, definition expects {shapes[name]}")
            if t.dtype != dtype:
                raise InputError(f"workload.inputs.{name}: blob dtype {t.dtype}, definition expects {dtype}")
            args.append(t.to(device, copy=True))
        else:
            s = input_seed(seed, workload.uuid, trial, name, key)
            if outliers:  # outlier draws get their own seed: the normal values differ too
                s = input_seed(seed, workload.uuid, trial, name + "#outliers", key)
            takes = outliers and (draw.outlier_inputs is None or name in draw.outlier_inputs)
            if shapes[name] is None:
                args.append(random_tensor((), dtype, device, s).item())
            else:
                args.append(random_tensor(shapes[name], dtype, device, s, draw if takes else None))
    return args


def job_inputs(job: Job, trial: int, device: torch.device, blobs: Optional[BlobCache] = None) -> list[Any]:
    """The inputs of one trial of a job: its seed, its sweep's input key and input distribution."""
    return materialize(job.definition, job.workload, root=Path(job.dataset_root), seed=job.settings.seed, trial=trial,
                       device=device, blobs=blobs, key=job.input_key or "", distribution=job.settings.input_distribution)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a destination buffer with NaN (floats), True (bool) or the max int, so that an
    output the candidate never writes cannot pass by inheriting stale memory."""
    if t.dtype.is_floating_point and t.element_size() >= 2:
        t.fill_(float("nan"))
    elif t.dtype is torch.bool:
        t.fill_(True)
    elif not t.dtype.is_floating_point:
        t.fill_(torch.iinfo(t.dtype).max)
    return t


def allocate_outputs(definition: Definition, axes: dict[str, int], device: torch.device) -> list[torch.Tensor]:
    """Poisoned output buffers for destination-passing style."""
    return [
        poison_(torch.empty(definition.shape_of(spec, axes) or (), dtype=torch_dtype(spec.dtype), device=device))
        for spec in definition.outputs.values()
    ]


def clone_args(args: list[Any]) -> list[Any]:
    """Fresh buffers with the same values (tensors cloned, scalars kept)."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
