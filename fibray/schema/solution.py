"""Solution: a candidate implementation of a definition, with inline sources.

A Solution is immutable; its ``hash`` covers everything that changes behaviour
(not its name, author or description), so identical code shares one build.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import PurePosixPath
from typing import Any, Optional

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from fibray.schema._base import Model, NonEmptyString


class Language(str, Enum):
    """Languages a solution may be written in."""

    PYTHON = "python"
    TRITON = "triton"
    CUDA = "cuda"
    CPP = "cpp"
    TILELANG = "tilelang"


class SourceFile(Model):
    """One source file: a relative path and its full text."""

    path: NonEmptyString
    """Relative path inside the solution (no absolute path, no '..')."""
    content: NonEmptyString
    """Full text of the file."""

    @model_validator(mode="after")
    def _validate_path(self) -> "SourceFile":
        p = PurePosixPath(self.path)
        if p.is_absolute() or self.path.startswith(("\\", "~")) or ":" in p.parts[0]:
            raise ValueError(f"path: absolute paths are not allowed: {self.path!r}")
        if ".." in p.parts:
            raise ValueError(f"path: '..' is not allowed: {self.path!r}")
        return self


class BuildSpec(Model):
    """How to build and call a solution."""

    language: Language
    """Source language."""
    target_hardware: list[str] = Field(min_length=1)
    """Hardware the author targets (informational)."""
    entry_point: NonEmptyString
    """'file_path::symbol' of the callable."""
    dependencies: list[NonEmptyString] = Field(default_factory=list)
    """Libraries the solution needs (cublas, cutlass, ...)."""
    destination_passing_style: bool = True
    """True: outputs are passed as the last arguments; False: outputs are returned."""
    binding: Optional[str] = None
    """For cuda/cpp: torch (extension), tvm-ffi, or c_abi (extern "C" run_kernel via ctypes)."""

    @model_validator(mode="after")
    def _validate_entry_point(self) -> "BuildSpec":
        if self.entry_point.count("::") != 1 or not all(self.entry_point.split("::")):
            raise ValueError(
                f"entry_point: expected 'file_path::symbol', got {self.entry_point!r}"
            )
        return self


class Solution(Model):
    """A candidate implementation of one definition."""

    model_config = ConfigDict(frozen=True)
    _hash: str = PrivateAttr(default="")

    name: NonEmptyString
    """Unique name of the solution."""
    definition: NonEmptyString
    """Name of the definition it implements."""
    author: NonEmptyString
    """The person or agent who wrote it."""
    spec: BuildSpec
    """Build and call specification."""
    sources: list[SourceFile] = Field(min_length=1)
    """All source files."""
    description: Optional[str] = None
    """What the solution does."""

    @model_validator(mode="after")
    def _validate_sources(self) -> "Solution":
        seen: set[str] = set()
        for i, src in enumerate(self.sources):
            if src.path in seen:
                raise ValueError(f"sources[{i}].path: duplicate source path {src.path!r}")
            seen.add(src.path)
        entry_file = self.entry_file
        if entry_file not in seen:
            raise ValueError(
                f"spec.entry_point: file {entry_file!r} is not among sources {sorted(seen)}"
            )
        return self

    def model_post_init(self, __context: Any) -> None:
        payload = {
            "definition": self.definition,
            "language": self.spec.language.value,
            "entry_point": self.spec.entry_point,
            "binding": self.spec.binding,
            "dps": self.spec.destination_passing_style,
            "dependencies": list(self.spec.dependencies),
            "sources": sorted((s.path, s.content) for s in self.sources),
        }
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        object.__setattr__(self, "_hash", digest)

    @property
    def hash(self) -> str:
        """Content hash (sha256 hex) of everything that changes behaviour."""
        return self._hash

    @property
    def entry_file(self) -> str:
        """Path of the source file holding the entry point."""
        return self.spec.entry_point.split("::")[0]

    @property
    def entry_symbol(self) -> str:
        """Name of the entry callable."""
        return self.spec.entry_point.split("::")[1]
