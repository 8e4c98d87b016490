"""Build cuda and cpp solutions: a torch extension (pybind11) or a C-ABI shared library (ctypes).

Compiling needs nvcc (and a host compiler), never a GPU, so CI catches compile errors; a
runnable from here raises DeviceRequired when called where no GPU is. Artifacts go through
the shared ArtifactCache (FIBRAY_BUILD_CACHE, else the worker's build folder).

Bindings (``spec.binding``):

- ``torch`` (also when binding is None): a torch extension, built like
  ``torch.utils.cpp_extension.load`` builds one (same include paths, defines and nvcc flags,
  .cu with nvcc, .cpp/.cc/.cxx with the host compiler, linked against libtorch), imported as
  module ``fibray_ext_<hash[:24]>``. The sources must define
  ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }``; the entry point
  ``binding.cpp::run`` names the exported function (the file part is informational). Called
  as ``run(*inputs, *outputs)`` (destination-passing) or ``run(*inputs)`` returning outputs; a
  scalar input arrives as ``double`` or ``int64_t``. Launch on torch's current stream. This
  is the same convention as flashinfer-bench's torch binding. With a CPU-only torch there is
  no libtorch_cuda to link against: the sources are compiled (nvcc -c, host files
  -fsyntax-only) to catch errors, and the runnable raises DeviceRequired. A ``cpp`` solution
  with no .cu file is built and runs on the CPU.
- ``c_abi``: ``nvcc -shared -Xcompiler -fPIC -O3`` into one .so loaded with ctypes. Always
  destination-passing. The entry (``kernel.cu::run_kernel``) is ``extern "C" void
  run_kernel(...)`` with, in this order:
    1. each definition input, in definition order: a tensor as ``void*`` (device pointer,
       contiguous), a scalar (shape null) as ``double`` if its dtype is floating, else ``int64_t``;
    2. each definition output, in order, as ``void*``;
    3. each var axis of the definition, in axes order, as ``int64_t``.
  The kernel launches on the default (legacy) stream and must not synchronise; fibray checks
  the launch error right after the call and synchronises the device before reading outputs.
  A c_abi runnable needs the definition to marshal arguments: ``bind(runnable, definition)``.
- ``tvm-ffi`` and anything else: BuildError reason ``unsupported_binding``.

Target (fibray.compile.toolchain): ``-gencode arch=compute_90,code=sm_90`` (H100/H200); FIBRAY_CUDA_ARCH overrides it
("90", "90a", "80,90"). Compile errors are BuildError ``nvcc_error`` (host compiler:
``cxx_error``, linker: ``link_error``) with the bounded compiler output.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import BaseModel

from fibray import deadlines
from fibray.compile.base import BuildError, Runnable, register_builder
from fibray.compile.cache import ArtifactCache, CacheResult, register_compiler
from fibray.compile.toolchain import (
    cuda_arch, cuda_home, gencode_flags, host_compiler, nvcc, nvcc_or_name, run_compiler, tool_version,
)
from fibray.schema import Definition, Solution
from fibray.schema.reasons import Reason

__all__ = [
    "CAbiArgumentError", "CudaLaunchError", "DeviceRequired", "bind", "build_cuda", "c_abi_argtypes",
    "c_abi_arguments", "c_abi_axis_sources", "compile_solution", "cuda_arch", "gencode_flags", "load_artifact", "toolchain_fingerprint",
]

BUILDER_VERSION = "2"
"""Bump when the build recipe changes: it is part of every cache key."""
BINDINGS = ("torch", "c_abi")
ARTIFACT_FILE = "cuda_artifact.json"
COMPILED_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx", ".c")
_CUDA_CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"
_SUPPORT_SOURCE = r"""
#include <cuda_runtime.h>
#include <stdio.h>
extern "C" int fibray_cabi_set_device(int device) { return (int)cudaSetDevice(device); }
extern "C" int fibray_cabi_last_error(char* buf, int n) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess && buf && n > 0) snprintf(buf, n, "%s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
  return (int)e;
}
"""


class DeviceRequired(RuntimeError):
    """A compiled CUDA solution was called where it cannot run: no GPU, or inputs not on one."""


class CAbiArgumentError(ValueError):
    """Arguments of a c_abi call do not match the definition (count, tensor, layout)."""


class CudaLaunchError(RuntimeError):
    """The CUDA runtime reported an error right after a c_abi call (bad launch configuration, ...)."""


class CudaArtifact(BaseModel):
    """What a compile left in its artifact directory (cuda_artifact.json)."""

    binding: Literal["torch", "c_abi"]
    """The binding it was built for."""
    mode: Literal["full", "compile_only"]
    """full: loadable library; compile_only: sources checked, nothing to load (CPU-only torch)."""
    library: Optional[str] = None
    """Library file name inside the artifact directory (full mode)."""
    module: Optional[str] = None
    """Python module name of a torch extension."""
    needs_cuda: bool = True
    """Whether running it needs a GPU."""


def binding_of(solution: Solution) -> str:
    """The solution's binding (None means torch); BuildError for one fibray cannot build."""
    binding = solution.spec.binding or "torch"
    if binding not in BINDINGS:
        raise BuildError(
            f"spec.binding: {binding!r} is not supported for {solution.spec.language.value} solutions "
            f"(supported: {', '.join(BINDINGS)}; None means torch)", Reason.UNSUPPORTED_BINDING)
    return binding


def toolchain_fingerprint(solution: Solution) -> dict[str, str]:
    """Everything besides the sources that changes the artifact (part of the cache key)."""
    binding = solution.spec.binding or "torch"
    fp = {"builder": BUILDER_VERSION, "binding": binding, "nvcc": tool_version(nvcc_or_name()),
          "cxx": tool_version(host_compiler()), "arch": ",".join(cuda_arch())}
    if binding == "torch":
        import torch

        fp.update(torch=torch.__version__, torch_cuda=str(torch.version.cuda),
                  python=sysconfig.get_config_var("SOABI") or sys.version.split()[0])
    return fp


# -- compile -----------------------------------------------------------------------------
@register_compiler("cuda", "cpp", fingerprint=toolchain_fingerprint)
def compile_solution(solution: Solution, outdir: Path, timeout_s: float = deadlines.COMPILE_S) -> None:
    """Compile a cuda/cpp solution into outdir (sources in outdir/src, the library, cuda_artifact.json)."""
    binding = binding_of(solution)
    entry = Path(solution.entry_file)
    if entry.suffix not in COMPILED_SUFFIXES:
        raise BuildError(f"spec.entry_point: {solution.entry_file!r} is not a {'/'.join(COMPILED_SUFFIXES)} file",
                         Reason.BAD_ENTRY_POINT)
    src = outdir / "src"
    for f in solution.sources:
        target = src / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f.content, encoding="utf-8")
    sources = [src / f.path for f in solution.sources if Path(f.path).suffix in COMPILED_SUFFIXES]
    if binding == "c_abi":
        if not solution.spec.destination_passing_style:
            raise BuildError("spec.destination_passing_style: c_abi solutions are always destination-passing",
                             Reason.BAD_SPEC)
        artifact = _compile_c_abi(sources, src, outdir, solution.entry_symbol, timeout_s)
    else:
        artifact = _compile_torch(solution, sources, src, outdir, timeout_s)
    (outdir / ARTIFACT_FILE).write_text(artifact.model_dump_json(indent=2), encoding="utf-8")


def _exports(outdir: Path, symbols: Sequence[str]) -> str:
    """A linker version script exporting only these symbols.

    Everything else stays local, so two solutions loaded into one worker cannot bind to each
    other's symbols: function-local statics of inline functions are STB_GNU_UNIQUE and would
    otherwise be shared process-wide even between libraries loaded with RTLD_LOCAL.
    """
    path = outdir / "exports.map"
    path.write_text("{\n  global: " + " ".join(f"{s};" for s in symbols) + "\n  local: *;\n};\n", encoding="utf-8")
    return str(path)


def _compile_c_abi(sources: list[Path], src: Path, outdir: Path, entry: str, timeout_s: float) -> CudaArtifact:
    support = outdir / "_fibray_cabi_support.cu"
    support.write_text(_SUPPORT_SOURCE, encoding="utf-8")
    exports = _exports(outdir, [entry, "fibray_cabi_set_device", "fibray_cabi_last_error"])
    cmd = [nvcc(), "-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17", *gencode_flags(), f"-I{src}",
           *map(str, sources), str(support), "-Xlinker", f"--version-script={exports}", "-o", str(outdir / "lib.so")]
    run_compiler(cmd, outdir, timeout_s, Reason.NVCC_ERROR)
    return CudaArtifact(binding="c_abi", mode="full", library="lib.so")


def _compile_torch(solution: Solution, sources: list[Path], src: Path, outdir: Path, timeout_s: float) -> CudaArtifact:
    import torch
    import torch.utils.cpp_extension as ce

    module = f"fibray_ext_{solution.hash[:24]}"
    cu = [s for s in sources if s.suffix == ".cu"]
    with_cuda = bool(cu) or solution.spec.language.value == "cuda"
    full = torch.version.cuda is not None or not with_cuda
    try:
        torch_includes = ce.include_paths(device_type="cpu")
    except TypeError:  # torch < 2.6: include_paths(cuda: bool)
        torch_includes = ce.include_paths(False)
    includes = [*torch_includes, sysconfig.get_path("include", scheme="posix_prefix")]
    home = cuda_home()
    if with_cuda and home is not None:
        includes.append(str(home / "include"))
    if with_cuda and not any((Path(i) / _CUDA_CMAKE_MACROS).is_file() for i in torch_includes):
        # A CPU-only torch ships c10/cuda headers without this cmake-generated one; supply its one define.
        shim = outdir / "cpu_torch_shim"
        (shim / _CUDA_CMAKE_MACROS).parent.mkdir(parents=True, exist_ok=True)
        (shim / _CUDA_CMAKE_MACROS).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n", encoding="utf-8")
        includes.append(str(shim))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        abi = list(getattr(ce, "_get_pybind11_abi_build_flags", lambda: [])())
    common = [f"-DTORCH_EXTENSION_NAME={module}", "-DTORCH_API_INCLUDE_EXTENSION_H",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *abi, f"-I{src}",
              *(f for inc in includes for f in ("-isystem", inc))]
    objects = []
    for source in sources:
        obj = outdir / "obj" / (source.relative_to(src).as_posix().replace("/", "__") + ".o")
        obj.parent.mkdir(exist_ok=True)
        if source.suffix == ".cu":
            cmd = [nvcc(), *common, *ce.COMMON_NVCC_FLAGS, *gencode_flags(), "--compiler-options", "-fPIC",
                   "-O3", "-std=c++20", "-c", str(source), "-o", str(obj)]
            run_compiler(cmd, outdir, timeout_s, Reason.NVCC_ERROR)
        elif full:
            run_compiler([host_compiler(), *common, "-fPIC", "-O3", "-std=c++20", "-c", str(source), "-o", str(obj)], outdir,
                 timeout_s, Reason.CXX_ERROR)
        else:  # nothing will be linked: a syntax check finds the errors at a fraction of the cost
            run_compiler([host_compiler(), *common, "-fPIC", "-std=c++20", "-fsyntax-only", str(source)], outdir, timeout_s,
                 Reason.CXX_ERROR)
            continue
        objects.append(str(obj))
    if not full:
        return CudaArtifact(binding="torch", mode="compile_only", module=module, needs_cuda=True)
    libs = ["-lc10", *(["-lc10_cuda"] if with_cuda else []), "-ltorch_cpu", *(["-ltorch_cuda"] if with_cuda else []),
            "-ltorch", "-ltorch_python"]
    cuda_libs = [f"-L{home / 'lib64'}", "-lcudart"] if with_cuda and home is not None else []
    library = f"{module}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    exports = _exports(outdir, [f"PyInit_{module}"])
    run_compiler([host_compiler(), *objects, "-shared", f"-Wl,--version-script={exports}", f"-L{ce.TORCH_LIB_PATH}", *libs, *cuda_libs,
          "-o", str(outdir / library)],
         outdir, timeout_s, Reason.LINK_ERROR)
    return CudaArtifact(binding="torch", mode="full", library=library, module=module, needs_cuda=with_cuda)


# -- load --------------------------------------------------------------------------------
def load_artifact(solution: Solution, folder: Path) -> Runnable:
    """A Runnable from a compiled artifact directory (import the extension / dlopen the library)."""
    artifact = CudaArtifact.model_validate_json((folder / ARTIFACT_FILE).read_text(encoding="utf-8"))
    meta: dict[str, Any] = {"binding": artifact.binding, "mode": artifact.mode, "artifact": str(folder)}
    symbol = solution.entry_symbol
    if artifact.binding == "c_abi":
        return _load_c_abi(solution, folder / artifact.library, symbol, meta)
    if artifact.mode == "compile_only":
        return Runnable(fn=_device_required(solution, "torch was built without CUDA: the extension compiled but cannot be linked"),
                        destination_passing_style=solution.spec.destination_passing_style,
                        solution_hash=solution.hash, meta=meta)
    import torch  # the extension resolves libtorch's symbols from the loaded torch

    module = sys.modules.get(artifact.module)
    if module is None:
        spec = importlib.util.spec_from_file_location(artifact.module, folder / artifact.library)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as e:
            raise BuildError(f"cannot import the built extension {artifact.library}: {e}", Reason.LOAD_ERROR) from None
        sys.modules[artifact.module] = module
    fn = getattr(module, symbol, None)
    if not callable(fn):
        raise BuildError(f"spec.entry_point: {solution.spec.entry_point!r}: the extension exports no {symbol!r} "
                         f"(exports: {sorted(n for n in dir(module) if not n.startswith('_'))})", Reason.MISSING_ENTRY_SYMBOL)
    if artifact.needs_cuda and not torch.cuda.is_available():
        fn = _device_required(solution, "no CUDA device is available")
    return Runnable(fn=fn, destination_passing_style=solution.spec.destination_passing_style,
                    solution_hash=solution.hash, meta=meta)


def _device_required(solution: Solution, why: str) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        raise DeviceRequired(f"solution {solution.name!r} needs a CUDA GPU ({why})")

    return call


def _load_c_abi(solution: Solution, path: Path, symbol: str, meta: dict[str, Any]) -> Runnable:
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        raise BuildError(f"cannot load {path.name}: {e}", Reason.LOAD_ERROR) from None
    try:
        lib[symbol]
    except AttributeError:
        raise BuildError(f"spec.entry_point: {solution.spec.entry_point!r}: the library exports no extern \"C\" "
                         f"symbol {symbol!r}", Reason.MISSING_ENTRY_SYMBOL) from None
    bound: dict[str, Runnable] = {}

    def bind_to(definition: Definition) -> Runnable:
        key = definition.model_dump_json()
        if key not in bound:
            bound[key] = Runnable(fn=_CAbiCall(lib, symbol, definition, solution.name), destination_passing_style=True,
                                  solution_hash=solution.hash, meta={**meta, "definition": definition.name})
        return bound[key]

    def unbound(*args: Any) -> Any:
        raise CAbiArgumentError(f"c_abi solution {solution.name!r} must be bound to its definition first: "
                                "fibray.compile.bind(runnable, definition)")

    meta.update(library=str(path), bind=bind_to)
    return Runnable(fn=unbound, destination_passing_style=True, solution_hash=solution.hash, meta=meta)


def bind(runnable: Runnable, definition: Definition) -> Runnable:
    """The runnable ready to call for this definition (c_abi marshalling); others come back unchanged."""
    binder = runnable.meta.get("bind")
    return binder(definition) if binder is not None else runnable


# -- the c_abi calling convention ---------------------------------------------------------
def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def c_abi_argtypes(definition: Definition) -> list[type]:
    """ctypes argument types of run_kernel for a definition (see the module docstring)."""
    types: list[type] = []
    for spec in definition.inputs.values():
        if spec.shape is None:
            types.append(ctypes.c_double if _is_floating(spec.dtype.value) else ctypes.c_int64)
        else:
            types.append(ctypes.c_void_p)
    types += [ctypes.c_void_p] * len(definition.outputs)
    types += [ctypes.c_int64] * len(definition.var_axes)
    return types


class _Marshal:
    """Turns a DPS call's arguments into run_kernel's (precomputed per definition)."""

    def __init__(self, definition: Definition) -> None:
        self.definition = definition
        self.names = [*definition.inputs, *definition.outputs]
        specs = [*definition.inputs.values(), *definition.outputs.values()]
        n_in = len(definition.inputs)
        # per argument: "ptr", "float" or "int" (scalar inputs only; an output is always a pointer)
        self.kinds = ["ptr" if i >= n_in or s.shape is not None else ("float" if _is_floating(s.dtype.value) else "int")
                      for i, s in enumerate(specs)]
        self.axes: list[tuple[int, int]] = []
        for axis in definition.var_axes:
            loc = next(((i, s.shape.index(axis)) for i, s in enumerate(specs) if s.shape and axis in s.shape), None)
            if loc is None:
                raise CAbiArgumentError(f"definition {definition.name!r}: var axis {axis!r} is in no tensor shape, "
                                        "so a c_abi call cannot pass its value")
            self.axes.append(loc)

    def __call__(self, args: Sequence[Any]) -> list[int | float]:
        import torch

        if len(args) != len(self.kinds):
            raise CAbiArgumentError(
                f"definition {self.definition.name!r} takes {len(self.definition.inputs)} inputs and "
                f"{len(self.definition.outputs)} outputs, got {len(args)} arguments")
        out: list[int | float] = []
        for name, kind, arg in zip(self.names, self.kinds, args):
            if kind != "ptr":
                value = arg.item() if isinstance(arg, torch.Tensor) else arg
                out.append(float(value) if kind == "float" else int(value))
            elif not isinstance(arg, torch.Tensor):
                raise CAbiArgumentError(f"argument {name!r}: expected a tensor, got {type(arg).__name__}")
            elif not arg.is_contiguous():
                raise CAbiArgumentError(f"argument {name!r}: c_abi passes raw pointers, the tensor must be contiguous")
            else:
                out.append(arg.data_ptr())
        out += [int(args[i].shape[d]) for i, d in self.axes]
        return out


def c_abi_arguments(definition: Definition, args: Sequence[Any]) -> list[int | float]:
    """The run_kernel arguments (pointers, scalars, var-axis sizes) for a DPS call's args."""
    return _Marshal(definition)(args)


def c_abi_axis_sources(definition: Definition) -> list[tuple[int, int]]:
    """For each var axis in order: (index among inputs+outputs, dimension) of the tensor it is read from."""
    return list(_Marshal(definition).axes)


class _CAbiCall:
    """run_kernel bound to one definition: marshal, call, check the launch error."""

    def __init__(self, lib: ctypes.CDLL, symbol: str, definition: Definition, solution: str) -> None:
        self.definition, self.solution = definition, solution
        self.entry = lib[symbol]  # a fresh function object: argtypes are per binding
        self.entry.argtypes, self.entry.restype = c_abi_argtypes(definition), None
        self.marshal = _Marshal(definition)  # raises at bind time, not at the first call
        self._set_device, self._last_error = lib.fibray_cabi_set_device, lib.fibray_cabi_last_error
        self._set_device.argtypes, self._set_device.restype = [ctypes.c_int], ctypes.c_int
        self._last_error.argtypes, self._last_error.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_int
        self._device: Optional[int] = None
        self._errbuf = ctypes.create_string_buffer(512)

    def __call__(self, *args: Any) -> None:
        import torch

        if not torch.cuda.is_available():
            raise DeviceRequired(f"solution {self.solution!r} (c_abi) needs a CUDA GPU; none is available")
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or device.type != "cuda":
            raise DeviceRequired(f"solution {self.solution!r} (c_abi) takes device pointers; arguments are on {device}")
        cargs = self.marshal(args)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != self._device:
            code = self._set_device(index)
            if code:
                raise CudaLaunchError(f"cudaSetDevice({index}) failed with CUDA error {code}")
            self._device = index
        self.entry(*cargs)
        if self._last_error(self._errbuf, len(self._errbuf)):
            raise CudaLaunchError(f"solution {self.solution!r}: run_kernel left a CUDA error: "
                                  f"{self._errbuf.value.decode(errors='replace')}")


# -- the builder --------------------------------------------------------------------------
@register_builder("cuda", "cpp")
def build_cuda(solution: Solution, workdir: Path) -> Runnable:
    """Build (through the shared artifact cache) and load a cuda/cpp solution."""
    binding_of(solution)
    shared = os.environ.get("FIBRAY_BUILD_CACHE")
    if shared and os.environ.get("FIBRAY_EXECUTOR") == "1":
        # an executor only reads the shared cache (fibray's compile-ahead writes it); what it must
        # compile itself goes to its own folder, where no other candidate can plant an artifact
        entry = ArtifactCache(shared).lookup(solution)
        if entry is not None:
            folder = CacheResult(Path(shared) / entry.key, entry, compiled_here=False, waited_s=0.0).raise_if_failed()
            return load_artifact(solution, folder)
        shared = None
    folder = ArtifactCache(shared or str(Path(workdir) / "artifacts")).artifact(solution)
    return load_artifact(solution, folder)

