"""An artifact's identity: solution hash + build recipe hash + environment key.

The environment key hashes the GPU model, driver, CUDA, torch and triton versions of the
running process, so an upgrade of any of them gives every solution a new artifact id with
no promotion rows: nothing is eligible to serve until it is validated again. Light to
import (apply() uses it on a serving host): no Ray, no sweep, no Polars.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from fibray.schema import Solution, content_hash
from fibray.store.promotions import artifact_id

ENVIRONMENT_FIELDS = ("hardware", "driver", "cuda", "torch", "triton")
"""What an artifact's environment key covers."""


@dataclass(frozen=True)
class Artifact:
    """One solution built one way for one environment."""

    artifact_id: str
    solution: str
    definition: str
    solution_hash: str
    recipe_hash: str
    environment_key: str
    environment: dict[str, str | None]


@functools.cache
def driver_version() -> str | None:
    """The NVIDIA driver version through NVML, or None where there is no NVIDIA driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) != 0:
            return None
        return buf.value.decode()
    finally:
        nvml.nvmlShutdown()


def environment_record(hardware: str | None, libs: dict[str, str], driver: str | None = None) -> dict[str, str | None]:
    """The environment fields of a process that reports `hardware` and library versions `libs`."""
    return {"hardware": hardware, "driver": driver, "cuda": libs.get("cuda"), "torch": libs.get("torch"),
            "triton": libs.get("triton")}


@functools.cache
def _running() -> tuple[tuple[str, str | None], ...]:
    from fibray.compile import prepare_triton

    prepare_triton()  # environment() imports triton; on a CPU-only host it must be the interpreter
    from fibray.evaluate.environment import default_device, environment

    env = environment(default_device())
    return tuple(environment_record(env.hardware, env.libs, driver_version()).items())


def running_environment_record() -> dict[str, str | None]:
    """The environment fields of this process (computed once)."""
    return dict(_running())


def environment_key(record: dict[str, str | None]) -> str:
    """Hash of the environment fields (exact versions: any change is a new environment)."""
    return content_hash("environment", {k: record.get(k) for k in ENVIRONMENT_FIELDS})[:16]


def recipe_hash(solution: Solution) -> str:
    """Hash of how the solution is built: its language's toolchain fingerprint (nvcc, flags, arch...)."""
    import fibray.compile  # noqa: F401  (registers the compilers)
    from fibray.compile.cache import compiler_for

    language = solution.spec.language.value
    compiler = compiler_for(language)
    if compiler is None:  # python / triton: built in-process; the triton version is in the environment key
        return content_hash("recipe", language)[:16]
    return content_hash("recipe", language, compiler[1](solution))[:16]


def artifact_of(solution: Solution, environment: dict[str, str | None] | None = None) -> Artifact:
    """The artifact of a solution in an environment (default: this process's)."""
    env = environment if environment is not None else running_environment_record()
    key, recipe = environment_key(env), recipe_hash(solution)
    return Artifact(artifact_id(solution.hash, recipe, key), solution.name, solution.definition, solution.hash,
                    recipe, key, dict(env))
