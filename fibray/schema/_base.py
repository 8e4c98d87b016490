"""Base model shared by every stored or transmitted fibray model.

Models keep fields they do not know (``extra="allow"``) so that a FlashInfer Trace
file written by a newer tool loads and dumps back without losing anything.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NonEmptyString = Annotated[str, Field(min_length=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class Model(BaseModel):
    """Pydantic base with attribute docstrings and round-trip friendly settings."""

    model_config = ConfigDict(
        use_attribute_docstrings=True,
        extra="allow",
        ser_json_inf_nan="strings",
    )

    def to_json_dict(self) -> dict:
        """The JSON-compatible dict of the fields that were set (lossless round trip)."""
        return self.model_dump(mode="json", exclude_unset=True)
