"""Build and load the compiled hit path (hitpath.cpp): once per machine and torch build, then cached.

It is compiled with the host C++ compiler against the running torch's headers and checked on
tiny tensors before use. Whatever goes wrong (no compiler, a compile error, a failed check) is
logged once and leaves the Python dispatch in charge: this module may make apply faster, never
unavailable.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from importlib.machinery import ExtensionFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path
from typing import Any

import torch

from fibray.compile.base import BuildError
from fibray.compile.cache import BuildLockTimeout, exclusive_lock
from fibray.compile.toolchain import host_compiler, run_compiler

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hitpath.cpp")
MODULE = "_fibray_hitpath"
"""The extension's module name (its PyInit_ symbol)."""
CACHE_ENV = "FIBRAY_BUILD_CACHE"
"""The shared build cache of fibray; the hit path goes to its `apply-hitpath` folder (else ~/.cache/fibray)."""
BUILD_TIMEOUT_S = 300.0


class HitPathUnavailable(Exception):
    """The compiled hit path cannot be used here; the message says why."""


@functools.cache
def hit_path_type() -> type | None:
    """The HitPath class, built or loaded from the cache; None (and one warning) when it cannot be used."""
    try:
        hit_path = _load(_build()).HitPath
        _self_check(hit_path)
    except HitPathUnavailable as e:
        log.warning("apply: the compiled hit path is unavailable, calls use the Python dispatch: %s", e)
        return None
    return hit_path


def _command(cxx: str, output: Path) -> list[str]:
    """The compile-and-link line: the headers and libraries of the torch that is running."""
    root = Path(torch.__file__).parent
    return [
        cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE), "-o", str(output),
        f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{root / 'lib'}",
    ]


def _cache_root() -> Path:
    shared = os.environ.get(CACHE_ENV)
    if shared:
        return Path(shared) / "apply-hitpath"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fibray" / "apply-hitpath"


def _build() -> Path:
    """The extension's path, compiled now if no process on this machine has compiled this version yet."""
    if not SOURCE.is_file():
        raise HitPathUnavailable(f"{SOURCE} is missing from this installation")
    cxx = host_compiler()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # everything the binary depends on: a new torch, Python, compiler or source is a new build
    identity = "\n".join([SOURCE.read_text(), torch.__version__, str(torch.version.git_version), sys.version,
                          suffix, " ".join(_command(cxx, Path("out")))])
    folder = _cache_root() / hashlib.sha256(identity.encode()).hexdigest()[:20]
    target = folder / f"{MODULE}{suffix}"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # concurrent processes: one compiles, the others wait for it
        with exclusive_lock(folder / "build.lock", BUILD_TIMEOUT_S + 30):
            if target.is_file():
                return target
            tmp = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
            try:
                log.info("apply: compiling the C++ hit path into %s (once per torch build, about 30 s)", folder)
                start = time.monotonic()
                _compile(_command(cxx, tmp / target.name), tmp)
                os.replace(tmp / target.name, target)  # atomic: a reader sees no file or the whole one
                log.info("apply: compiled the C++ hit path in %.0f s", time.monotonic() - start)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, BuildLockTimeout) as e:
        raise HitPathUnavailable(f"building under {folder}: {e}") from e
    return target


def _compile(cmd: list[str], cwd: Path) -> None:
    """The build's own compiler runner (process group, deadline, output on failure)."""
    try:
        run_compiler(cmd, cwd, BUILD_TIMEOUT_S, "hitpath_build")
    except BuildError as e:
        raise HitPathUnavailable(f"{cmd[0]}: {e}") from None


def _load(path: Path) -> Any:
    loader = ExtensionFileLoader(MODULE, str(path))
    spec = spec_from_loader(MODULE, loader)
    try:
        module = module_from_spec(spec)  # type: ignore[arg-type]
        loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise HitPathUnavailable(f"loading {path}: {e}") from e
    return module


def _self_check(hit_path: type) -> None:
    """Guards, signatures, outputs and counters on tiny tensors, against what the Python path
    would do: a build that reads tensors wrong (a torch whose layout differs from its headers)
    must never serve a call."""
    path = hit_path(slow=lambda fallback, args, kwargs: "python", on_error=None, normalize=lambda r: r, n_in=2,
                    guards=[(0, torch.float32), (1, torch.float32)], cuda=False, single_output=True)
    w = torch.zeros(5)
    path.put(((3, 5), (5,)), 0, lambda x, w: "solution", "state")
    path.put(((4, 5), (5,)), 2, None, None)
    path.put(((6, 5), (5,)), 1, lambda x, w, y: y.fill_(1.0), "dps state", [((6, 5), torch.float64)])
    cases = {
        "served": (torch.zeros(3, 5), w), "unseen shape": (torch.zeros(2, 5), w), "miss": (torch.zeros(4, 5), w),
        "other dtype": (torch.zeros(3, 5, dtype=torch.float64), w), "non-contiguous": (torch.zeros(5, 3).t(), w),
        "autograd": (torch.zeros(3, 5), w.clone().requires_grad_()), "not a tensor": (torch.zeros(3, 5), 1.0),
    }
    with torch.enable_grad():
        got = {case: path(lambda x, w: "fallback", args, {}) for case, args in cases.items()}
    out = path(None, (torch.zeros(6, 5), w), {})
    want = {case: "python" for case in cases} | {"served": "solution", "miss": "fallback"}
    if got != want:
        raise HitPathUnavailable(f"its self-check routed calls wrongly: {got}")
    if not (isinstance(out, torch.Tensor) and out.shape == (6, 5) and out.dtype == torch.float64 and bool(out.all())):
        raise HitPathUnavailable(f"its self-check got a wrong destination-passing output: {out!r}")
    if path.drain() != [("state", 0, 1), (None, 2, 1), ("dps state", 1, 1)]:
        raise HitPathUnavailable("its self-check counted calls wrongly")
