"""The CUDA/C++ toolchain: target architectures, nvcc and the host compiler, and running one
compiler command under a deadline in its own process group (BuildError with the bounded output).
Never needs a GPU.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from fibray import deadlines
from fibray.compile.base import BuildError
from fibray.schema.reasons import Reason

__all__ = ["bound_output", "cuda_arch", "cuda_home", "gencode_flags", "host_compiler", "nvcc", "nvcc_or_name",
           "run_compiler", "tool_version"]

_LOG_LIMIT = 12000
"""Characters of a compiler's output kept in a BuildError."""


def cuda_arch() -> list[str]:
    """Target architectures: FIBRAY_CUDA_ARCH ("90", "sm_90a", "8.0,9.0") or 90."""
    raw = os.environ.get("FIBRAY_CUDA_ARCH", "90")
    archs = [a.strip().lower().removeprefix("sm_").removeprefix("compute_").replace(".", "") for a in raw.split(",")]
    if not archs or not all(a[:-1].isdigit() if a.endswith("a") else a.isdigit() for a in archs):
        raise BuildError(f"FIBRAY_CUDA_ARCH: expected e.g. '90', '90a' or '80,90', got {raw!r}", Reason.BAD_CUDA_ARCH)
    return archs


def gencode_flags() -> list[str]:
    """nvcc -gencode flags for the target architectures."""
    return [f for a in cuda_arch() for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]


@functools.cache
def cuda_home() -> Optional[Path]:
    """The CUDA toolkit: CUDA_HOME / CUDA_PATH, else nvcc's, else /usr/local/cuda; None without one."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            return Path(os.environ[env])
    found = shutil.which("nvcc")
    if found:
        home = Path(os.path.realpath(found)).parent.parent
        if (home / "include" / "cuda_runtime.h").is_file():
            return home
    return Path("/usr/local/cuda") if Path("/usr/local/cuda/include/cuda_runtime.h").is_file() else None


def nvcc() -> str:
    """The nvcc to run: $NVCC, else CUDA_HOME's, else nvcc on PATH; BuildError nvcc_missing."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)", Reason.NVCC_MISSING)
    return found


def host_compiler() -> str:
    """The host C++ compiler: $CXX, else c++ on PATH, else g++."""
    return os.environ.get("CXX") or shutil.which("c++") or "g++"


@functools.cache
def tool_version(tool: str) -> str:
    """A compiler's version line (part of the build-cache key); "missing" where it cannot run."""
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=deadlines.TOOL_VERSION_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "missing"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return (lines[-1] if "nvcc" in tool else lines[0]) if lines else "unknown"


def nvcc_or_name() -> str:
    """nvcc's path, or the bare name where there is none (for the cache key)."""
    try:
        return nvcc()
    except BuildError:
        return "nvcc"


def run_compiler(cmd: Sequence[str], cwd: Path, timeout_s: float, reason: str) -> None:
    """Run one compiler command in its own process group; BuildError with its output on failure."""
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
    except OSError as e:
        raise BuildError(f"cannot run {cmd[0]}: {e.strerror}", reason) from None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise BuildError(f"{Path(cmd[0]).name} did not finish within {timeout_s:.0f}s\n{bound_output(out)}",
                         Reason.COMPILE_TIMEOUT) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        shown = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))
        text = out.replace(str(cwd) + "/", "")
        raise BuildError(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n{bound_output(text)}\ncommand: {bound_output(shown, 2000)}",
                         reason)


def bound_output(text: str, limit: int = _LOG_LIMIT) -> str:
    """A compiler's output cut to `limit` characters, keeping its head and its tail."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}\n... [{len(text) - limit} chars cut] ...\n{text[-(limit - head):]}"
