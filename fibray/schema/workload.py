"""Workload: one concrete instance of a definition (var-axis values and input sources)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from fibray.schema._base import Model, NonEmptyString, NonNegativeInt


class RandomInput(Model):
    """Input drawn at random, seeded from the job."""

    type: Literal["random"] = "random"
    """Discriminator."""


class ScalarInput(Model):
    """Input given as a literal scalar."""

    type: Literal["scalar"] = "scalar"
    """Discriminator."""
    value: Union[bool, int, float]
    """The value passed to the kernel."""


class SafetensorsInput(Model):
    """Input read from a safetensors blob; never re-randomised."""

    type: Literal["safetensors"] = "safetensors"
    """Discriminator."""
    path: NonEmptyString
    """Blob path, relative to the dataset root."""
    tensor_key: NonEmptyString
    """Key of the tensor inside the blob."""


InputSpec = Annotated[Union[RandomInput, ScalarInput, SafetensorsInput], Field(discriminator="type")]


class Workload(Model):
    """Values of the var axes and the source of every input."""

    axes: dict[str, NonNegativeInt]
    """Var-axis name -> size."""
    inputs: dict[str, InputSpec]
    """Input name -> how to materialise it."""
    uuid: NonEmptyString
    """Unique id of this workload."""
