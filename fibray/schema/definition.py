"""Definition: the operator contract (axes, tensors, reference), FlashInfer Trace compatible.

fibray adds one optional field, ``check``, that says how outputs are judged; files
without it load unchanged and flashinfer-bench ignores it.
"""

from __future__ import annotations

import ast
from enum import Enum
from functools import cached_property
from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from fibray.schema._base import Model, NonEmptyString, NonNegativeInt


class DType(str, Enum):
    """Tensor element types of the FlashInfer Trace format."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    FLOAT4_E2M1 = "float4_e2m1"
    INT64 = "int64"
    INT32 = "int32"
    INT16 = "int16"
    INT8 = "int8"
    BOOL = "bool"


class AxisConst(Model):
    """An axis whose size is fixed by the definition."""

    type: Literal["const"] = "const"
    """Discriminator."""
    value: NonNegativeInt
    """The fixed size of this axis."""
    description: Optional[str] = None
    """What the axis means."""


class AxisVar(Model):
    """An axis whose size is given by each workload."""

    type: Literal["var"] = "var"
    """Discriminator."""
    description: Optional[str] = None
    """What the axis means."""


Axis = Union[AxisConst, AxisVar]


class TensorSpec(Model):
    """One input or output: its shape in axis names (None for a scalar) and dtype."""

    shape: Optional[list[NonEmptyString]]
    """Axis names, outermost first; None for a scalar."""
    dtype: DType
    """Element type."""
    description: Optional[str] = None
    """What the tensor holds."""


class CheckSpec(Model):
    """How fibray judges outputs against the reference (a fibray extension)."""

    kind: NonEmptyString = "elementwise"
    """Name of a registered checker: elementwise, matched_ratio, sampling."""
    atol: Optional[float] = Field(default=None, ge=0)
    """Absolute tolerance; None uses the sweep's eval.atol."""
    rtol: Optional[float] = Field(default=None, ge=0)
    """Relative tolerance; None uses the sweep's eval.rtol."""
    matched_ratio: Optional[float] = Field(default=None, gt=0, le=1)
    """Fraction of elements that must be within tolerance (matched_ratio kind), in (0, 1]."""


class RandomInputSpec(Model):
    """How outlier draws apply to a definition's random inputs (a fibray extension)."""

    outlier_inputs: Optional[list[NonEmptyString]] = None
    """Floating-point inputs that take outliers under eval.input_distribution=outliers|mixed; None
    means all of them, [] none (probabilities, scales and other inputs a real model keeps in range)."""
    outlier_fraction: float = Field(default=0.01, gt=0, le=1)
    """Fraction of an input's elements that are scaled into outliers, in (0, 1]."""
    outlier_scale: tuple[float, float] = (1e2, 1e3)
    """Outliers are N(0,1) values times a log-uniform factor in this range (clamped to half the dtype's max)."""

    @model_validator(mode="after")
    def _validate_outlier_scale(self) -> "RandomInputSpec":
        lo, hi = self.outlier_scale
        if not 0 < lo <= hi:
            raise ValueError(f"random_inputs.outlier_scale: expected 0 < low <= high, got {list(self.outlier_scale)}")
        return self


class Definition(Model):
    """The operator contract: what a kernel computes, on which shapes and dtypes."""

    name: NonEmptyString
    """Unique name of the definition."""
    op_type: NonEmptyString
    """Operator family (gemm, rmsnorm, gqa_paged, ...)."""
    axes: dict[NonEmptyString, Axis]
    """Symbolic dimensions: const with a value, or var (given by a workload)."""
    inputs: dict[NonEmptyString, TensorSpec]
    """Inputs, in call order."""
    outputs: dict[NonEmptyString, TensorSpec]
    """Outputs, in return (or destination) order."""
    reference: NonEmptyString
    """Python source defining a top-level ``run`` that computes the outputs."""
    tags: list[NonEmptyString] = Field(default_factory=list)
    """Free-form tags."""
    description: Optional[str] = None
    """What the operator does."""
    constraints: list[NonEmptyString] = Field(default_factory=list)
    """Python expressions over axis names that every workload satisfies."""
    check: Optional[CheckSpec] = None
    """How outputs are judged (fibray extension); None means elementwise with sweep tolerances."""
    random_inputs: Optional[RandomInputSpec] = None
    """Which random inputs take outlier draws, how many and how large (fibray extension); None: defaults."""

    @model_validator(mode="after")
    def _validate_reference(self) -> "Definition":
        try:
            module = ast.parse(self.reference, mode="exec")
        except SyntaxError as e:
            raise ValueError(f"reference: not valid Python ({e.msg}, line {e.lineno})") from e
        if not any(
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "run"
            for node in module.body
        ):
            raise ValueError("reference: must define a top-level function 'run'")
        return self

    @model_validator(mode="after")
    def _validate_tensor_names(self) -> "Definition":
        overlap = set(self.inputs) & set(self.outputs)
        if overlap:
            raise ValueError(f"outputs: names {sorted(overlap)} are also inputs")
        return self

    @model_validator(mode="after")
    def _validate_shapes(self) -> "Definition":
        for kind, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            for tensor, spec in tensors.items():
                for axis in spec.shape or ():
                    if axis not in self.axes:
                        raise ValueError(
                            f"{kind}.{tensor}.shape: axis '{axis}' is not defined in axes "
                            f"(defined: {sorted(self.axes)})"
                        )
        return self

    @model_validator(mode="after")
    def _validate_random_inputs(self) -> "Definition":
        names = self.random_inputs.outlier_inputs if self.random_inputs else None
        unknown = sorted(set(names or ()) - set(self.inputs))
        if unknown:
            raise ValueError(f"random_inputs.outlier_inputs: {unknown} are not inputs (inputs: {sorted(self.inputs)})")
        return self

    @model_validator(mode="after")
    def _validate_constraints(self) -> "Definition":
        for i, expr in enumerate(self.constraints):
            try:
                ast.parse(expr, mode="eval")
            except SyntaxError as e:
                raise ValueError(f"constraints[{i}]: not a Python expression: {expr!r}") from e
        return self

    @cached_property
    def const_axes(self) -> dict[str, int]:
        """Const axis name -> value."""
        return {n: a.value for n, a in self.axes.items() if isinstance(a, AxisConst)}

    @cached_property
    def var_axes(self) -> list[str]:
        """Var axis names in declaration order."""
        return [n for n, a in self.axes.items() if isinstance(a, AxisVar)]

    def shape_of(self, spec: TensorSpec, axes: dict[str, int]) -> Optional[tuple[int, ...]]:
        """Concrete shape of a tensor given the var-axis values of a workload."""
        if spec.shape is None:
            return None
        values = {**axes, **self.const_axes}
        missing = [a for a in spec.shape if a not in values]
        if missing:
            raise ValueError(f"missing values for var axes {missing}")
        return tuple(int(values[a]) for a in spec.shape)

    def input_shapes(self, axes: dict[str, int]) -> dict[str, Optional[tuple[int, ...]]]:
        """Concrete input shapes, in input order."""
        return {n: self.shape_of(s, axes) for n, s in self.inputs.items()}

    def output_shapes(self, axes: dict[str, int]) -> dict[str, Optional[tuple[int, ...]]]:
        """Concrete output shapes, in output order."""
        return {n: self.shape_of(s, axes) for n, s in self.outputs.items()}
