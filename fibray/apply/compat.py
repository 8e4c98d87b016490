"""Is an evaluation recorded elsewhere valid here? Hardware and library-version matching.

A verdict (and a latency) holds for the GPU model and the library versions it was
measured with; apply() must never trust a row measured on another GPU or stack.
"""

from __future__ import annotations

import re
from typing import Literal

from fibray.schema import Environment

_VERSION = re.compile(r"^\s*v?(\d+)(?:\.(\d+))?")


def running_environment() -> Environment:
    """Hardware name and library versions of this process, as a sweep worker would record them."""
    from fibray.compile import prepare_triton

    prepare_triton()  # environment() imports triton; on a CPU-only host it must be the interpreter
    from fibray.evaluate.environment import default_device, environment

    return environment(default_device())


def same_version(recorded: str | None, running: str | None, mode: Literal["exact", "minor"]) -> bool:
    """Whether two versions of a library match: exactly, or in major.minor ('2.11.0+cu128' ~ '2.11.1')."""
    if recorded is None or running is None:
        return recorded is None and running is None
    if mode == "exact":
        return recorded == running
    a, b = _VERSION.match(recorded), _VERSION.match(running)
    if a is None or b is None:
        return recorded == running
    return (a.group(1), a.group(2) or "0") == (b.group(1), b.group(2) or "0")


def incompatibility(
    hardware: str | None,
    libs: dict[str, str],
    running: Environment,
    *,
    want_hardware: str | None,
    match_libs: list[str],
    version_match: Literal["exact", "minor"],
) -> str | None:
    """Why a row recorded on (hardware, libs) does not hold here, or None when it does."""
    if hardware != (want_hardware or running.hardware):
        return "incompatible_hardware"
    for lib in match_libs:
        if not same_version(libs.get(lib), running.libs.get(lib), version_match):
            return f"incompatible_{lib}"
    return None
