"""Import an XPU-OJ style problem package into a FlashInfer Trace dataset folder.

A package is a folder with one problem file (Python: getNumOfTestcases, getTestCaseSize reading
the case id from stdin, genTestCase, baseline, check, INPUT_CLASS) and optionally one CUDA
submission exporting ``extern "C" void run_kernel(...)`` in the problem's argument order. It
becomes a Definition (axes inferred from the test cases, reference = the problem's baseline),
one workload per test case (tensors saved as safetensors blobs) and a c_abi Solution whose
generated entry reorders fibray's arguments for the submission. It runs the problem's Python
(as the judge would) and writes nothing unless every piece was built.

    python -m fibray.interop.xpuoj PACKAGE_DIR OUT_DATASET_DIR [--name NAME] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence

import torch

from fibray.schema import Definition, Solution, Trace, Workload

__all__ = ["ImportedProblem", "XpuojError", "import_package", "main", "write_dataset"]

OP_TYPE = "xpuoj"
_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int64: "int64",
    torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.bool: "bool",
}
_REQUIRED = ("getTestCaseSize", "genTestCase", "baseline")


class XpuojError(ValueError):
    """The package does not follow the XPU-OJ convention; the message names the file and what is wrong."""


@dataclass
class _Arg:
    """One kernel argument of the problem, in the problem's order."""

    name: str
    role: str  # INPUT | OUTPUT
    tensor: bool
    dtype: str
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # per test case
    values: list[Any] = field(default_factory=list)  # scalars: per test case


@dataclass
class ImportedProblem:
    """Everything an import produces, in memory, before anything is written."""

    definition: Definition
    workloads: list[Workload]
    blobs: dict[str, dict[str, torch.Tensor]]  # relative blob path -> tensors
    solution: Optional[Solution]


# -- reading the package ------------------------------------------------------------------
def _find_problem(package: Path) -> Path:
    candidates = [p for p in sorted(package.glob("*.py")) if "def getTestCaseSize" in p.read_text(encoding="utf-8")]
    if len(candidates) != 1:
        raise XpuojError(f"{package}: expected exactly one problem file (*.py defining getTestCaseSize), "
                         f"found {[p.name for p in candidates]}")
    return candidates[0]


def _load_problem(path: Path) -> ModuleType:
    name = f"_fibray_xpuoj_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the problem file is foreign code; any failure is a bad package
        raise XpuojError(f"{path}: cannot execute the problem file: {type(e).__name__}: {e}") from None
    missing = [f for f in _REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise XpuojError(f"{path}: missing {missing} (the problem body may have failed inside its try/except)")
    return module


@contextlib.contextmanager
def _stdin(text: str) -> Iterator[None]:
    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def _case_sizes(problem: ModuleType, case: int, path: Path) -> list[tuple[int, ...]]:
    with _stdin(f"{case}\n"):
        try:
            sizes = problem.getTestCaseSize()
        except Exception as e:  # foreign code
            raise XpuojError(f"{path}: getTestCaseSize() for test case {case} failed: {type(e).__name__}: {e}") from None
    if isinstance(sizes, tuple) and len(sizes) == 2 and isinstance(sizes[1], tuple):
        sizes = sizes[0]  # (argument shapes, (warmup, iters))
    return [tuple(int(d) for d in s) for s in sizes]


def _arg_names(problem: ModuleType, count: int) -> list[str]:
    try:
        params = list(inspect.signature(problem.baseline).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) != count or len(set(names)) != count or not all(n.isidentifier() for n in names):
        names = [f"arg{i}" for i in range(count)]
    return names


def _tolerances(problem: ModuleType) -> tuple[Optional[float], Optional[float]]:
    check = getattr(problem, "check", None)
    try:
        params = inspect.signature(check).parameters if callable(check) else {}
    except (TypeError, ValueError):
        params = {}
    get = lambda k: float(params[k].default) if k in params and isinstance(params[k].default, (int, float)) else None  # noqa: E731
    return get("atol"), get("rtol")


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "problem"


# -- building the definition --------------------------------------------------------------
def _infer_axes(args: list[_Arg], n_cases: int) -> tuple[dict[tuple[int, int], str], dict[str, dict[str, Any]]]:
    """Name the tensor dimensions: dims with the same value in every case share an axis.

    An axis is named after a scalar argument that always equals it (T, H), else dim<k>;
    it is var when its value changes across test cases, const otherwise.
    """
    scalars = {a.name: a.values for a in args if not a.tensor and a.dtype.startswith("int")}
    axis_of: dict[tuple[int, int], str] = {}
    axes: dict[str, dict[str, Any]] = {}
    by_values: dict[tuple[int, ...], str] = {}
    for i, a in enumerate(args):
        if not a.tensor:
            continue
        for d in range(len(a.shapes[0])):
            values = tuple(s[d] for s in a.shapes)
            if values not in by_values:
                named = next((n for n, v in scalars.items() if tuple(v) == values and n not in axes), None)
                name = named or f"dim{len(axes)}"
                by_values[values] = name
                axes[name] = {"type": "var"} if len(set(values)) > 1 else {"type": "const", "value": values[0]}
            axis_of[(i, d)] = by_values[values]
    return axis_of, axes


def _reference_source(problem_source: str, args: list[_Arg], axis_of: dict[tuple[int, int], str],
                      axes: dict[str, dict[str, Any]]) -> str:
    """The problem file plus a `run(*inputs)` that allocates the outputs and calls baseline()."""
    inputs = [a for a in args if a.role == "INPUT"]
    where: dict[str, str] = {}  # axis -> expression over the inputs
    for i, a in enumerate(args):
        if a.role == "INPUT" and a.tensor:
            for d in range(len(a.shapes[0])):
                where.setdefault(axis_of[(i, d)], f"{a.name}.shape[{d}]")
    lines = ["", "", "# ---- generated by fibray.interop.xpuoj: the FlashInfer Trace reference entry ----",
             "import torch as _fibray_torch", "", "",
             f"def run({', '.join(a.name for a in inputs)}):",
             f"    _args = {{{', '.join(f'{a.name!r}: {a.name}' for a in inputs)}}}"]
    first_tensor = next((a.name for a in inputs if a.tensor), None)
    lines.append(f"    _device = {first_tensor}.device" if first_tensor else "    _device = _fibray_torch.device('cpu')")
    outputs = [(i, a) for i, a in enumerate(args) if a.role == "OUTPUT"]
    for i, a in outputs:
        dims = []
        for d in range(len(a.shapes[0])):
            axis = axis_of[(i, d)]
            if axis in where:
                dims.append(where[axis])
            elif axes[axis]["type"] == "const":
                dims.append(str(axes[axis]["value"]))
            else:
                raise XpuojError(f"output {a.name!r}: dimension {d} (axis {axis!r}) appears in no input, "
                                 "so the reference cannot allocate it")
        lines.append(f"    _args[{a.name!r}] = _fibray_torch.zeros(({', '.join(dims)}{',' if len(dims) == 1 else ''}), "
                     f"dtype=_fibray_torch.{a.dtype}, device=_device)")
    order = [a.name for a in args]
    lines += [f"    _order = {order!r}",
              "    _result = baseline(*[_args[n] for n in _order])",
              "    if isinstance(_result, (list, tuple)) and len(_result) == len(_order):",
              "        _args.update(zip(_order, _result))"]
    outs = [a.name for _, a in outputs]
    lines.append(f"    return _args[{outs[0]!r}]" if len(outs) == 1 else
                 f"    return ({', '.join(f'_args[{n!r}]' for n in outs)})")
    return problem_source.rstrip() + "\n" + "\n".join(lines) + "\n"


# -- the c_abi adapter --------------------------------------------------------------------
def _adapter_source(args: list[_Arg], var_axes: list[str], submission: str) -> str:
    """A c_abi entry in fibray's order (inputs, outputs, var axes) calling the submission's run_kernel."""
    params = []
    for a in args:
        if a.role == "INPUT":
            if a.tensor:
                params.append(f"const void* in_{a.name}")
            else:
                params.append(f"{'double' if a.dtype.startswith(('float', 'bfloat')) else 'int64_t'} in_{a.name}")
    params += [f"void* out_{a.name}" for a in args if a.role == "OUTPUT"]
    params += [f"int64_t axis_{n}" for n in var_axes]
    call = []
    for a in args:
        if a.role == "OUTPUT":
            call.append(f"_AnyPtr{{out_{a.name}}}")
        elif a.tensor:
            call.append(f"_AnyPtr{{const_cast<void*>(in_{a.name})}}")
        else:
            call.append(f"in_{a.name}")
    unused = "".join(f"  (void)axis_{n};\n" for n in var_axes)
    return (
        "// Generated by fibray.interop.xpuoj: fibray's c_abi entry (inputs, outputs, var axes) for an XPU-OJ\n"
        f"// submission whose run_kernel takes ({', '.join(a.name for a in args)}).\n"
        "#include <stdint.h>\n\n"
        f"#define run_kernel xpuoj_submission_run_kernel\n#include \"{submission}\"\n#undef run_kernel\n\n"
        "namespace {\n// Converts to whatever pointer type the submission declares.\n"
        "struct _AnyPtr {\n  void* p;\n  template <class T>\n  operator T*() const { return static_cast<T*>(p); }\n};\n"
        "}  // namespace\n\n"
        f"extern \"C\" void run_kernel({', '.join(params)}) {{\n{unused}"
        f"  xpuoj_submission_run_kernel({', '.join(call)});\n}}\n"
    )


def _submission(package: Path) -> Optional[tuple[Path, list[Path]]]:
    """(the .cu defining run_kernel, other header files) or None when the package has no submission."""
    cu = sorted(package.glob("*.cu"))
    if not cu:
        return None
    if len(cu) > 1:
        raise XpuojError(f"{package}: expected one CUDA submission (*.cu), found {[p.name for p in cu]}")
    if "run_kernel" not in cu[0].read_text(encoding="utf-8"):
        raise XpuojError(f"{cu[0]}: the submission does not define run_kernel")
    headers = [p for p in sorted(package.iterdir()) if p.suffix in (".cuh", ".h", ".hpp")]
    return cu[0], headers


# -- the import ----------------------------------------------------------------------------
def import_package(package: str | Path, *, name: Optional[str] = None, device: str = "cpu",
                   max_case_bytes: int = 256 << 20) -> ImportedProblem:
    """Read an XPU-OJ package into a Definition, workloads (+ blobs) and a c_abi Solution, in memory."""
    package = Path(package)
    if not package.is_dir():
        raise XpuojError(f"{package}: not a directory")
    path = _find_problem(package)
    problem = _load_problem(path)
    count = getattr(problem, "getNumOfTestcases", None)
    if not callable(count):
        raise XpuojError(f"{path}: getNumOfTestcases() is missing")
    n_cases = int(count())
    classes = list(getattr(problem, "INPUT_CLASS", []))
    def_name = f"xpuoj_{_sanitize(name or package.name)}"

    args: list[_Arg] = []
    cases: list[list[Any]] = []
    for case in range(1, n_cases + 1):
        sizes = _case_sizes(problem, case, path)
        torch.manual_seed(case)  # genTestCase draws random data; a fixed seed makes the import repeatable
        try:
            values = list(problem.genTestCase(sizes, device=device))
        except Exception as e:  # foreign code
            raise XpuojError(f"{path}: genTestCase() for test case {case} failed on device {device!r}: "
                             f"{type(e).__name__}: {e}") from None
        if len(values) != len(sizes):
            raise XpuojError(f"{path}: test case {case}: genTestCase returned {len(values)} arguments, "
                             f"getTestCaseSize described {len(sizes)}")
        if not args:
            if len(classes) != len(values) or set(classes) - {"INPUT", "OUTPUT"}:
                raise XpuojError(f"{path}: INPUT_CLASS must list INPUT or OUTPUT for each of the {len(values)} "
                                 f"arguments, got {classes}")
            names = _arg_names(problem, len(values))
            for n, role, v in zip(names, classes, values):
                if isinstance(v, torch.Tensor):
                    if v.dtype not in _DTYPES:
                        raise XpuojError(f"{path}: argument {n!r} has dtype {v.dtype}, which FlashInfer Trace cannot describe")
                    args.append(_Arg(n, role, True, _DTYPES[v.dtype]))
                elif isinstance(v, (bool, int, float)):
                    if role == "OUTPUT":
                        raise XpuojError(f"{path}: argument {n!r} is an OUTPUT but a Python scalar")
                    dtype = "bool" if isinstance(v, bool) else "int64" if isinstance(v, int) else "float32"
                    args.append(_Arg(n, role, False, dtype))
                else:
                    raise XpuojError(f"{path}: argument {n!r} is a {type(v).__name__}; expected a tensor or a scalar")
        for a, v in zip(args, values):
            if a.tensor != isinstance(v, torch.Tensor) or (a.tensor and _DTYPES.get(v.dtype) != a.dtype):
                raise XpuojError(f"{path}: test case {case}: argument {a.name!r} changed type or dtype")
            if a.tensor:
                if len(a.shapes) and len(a.shapes[0]) != v.dim():
                    raise XpuojError(f"{path}: test case {case}: argument {a.name!r} changed rank")
                a.shapes.append(tuple(v.shape))
            else:
                a.values.append(v)
        cases.append(values)

    nbytes = [sum(v.numel() * v.element_size() for v, a in zip(c, args) if a.tensor and a.role == "INPUT") for c in cases]
    kept = [i for i, b in enumerate(nbytes) if b <= max_case_bytes]
    if not kept:
        raise XpuojError(f"{path}: every test case needs more than {max_case_bytes} bytes of input blobs "
                         f"(smallest {min(nbytes)}); raise --max-case-bytes")

    axis_of, axes = _infer_axes(args, n_cases)
    atol, rtol = _tolerances(problem)
    definition = Definition.model_validate({
        "name": def_name, "op_type": OP_TYPE, "axes": axes,
        "inputs": {a.name: {"shape": [axis_of[(i, d)] for d in range(len(a.shapes[0]))] if a.tensor else None,
                            "dtype": a.dtype} for i, a in enumerate(args) if a.role == "INPUT"},
        "outputs": {a.name: {"shape": [axis_of[(i, d)] for d in range(len(a.shapes[0]))], "dtype": a.dtype}
                    for i, a in enumerate(args) if a.role == "OUTPUT"},
        "reference": _reference_source(path.read_text(encoding="utf-8"), args, axis_of, axes),
        "tags": ["source:xpuoj", f"xpuoj:package:{package.name}"],
        "description": (f"Imported from the XPU-OJ package {package.name!r} ({path.name}). Kernel argument order "
                        f"({', '.join(f'{a.name}:{a.role.lower()}' for a in args)}); judged elementwise with the "
                        "problem's check() tolerances (its custom check code is not run)."),
        **({"check": {"kind": "elementwise", "atol": atol, "rtol": rtol}} if atol is not None or rtol is not None else {}),
    })

    workloads, blobs = [], {}
    for i in kept:
        values = cases[i]
        blob = f"blob/workloads/{OP_TYPE}/{def_name}/{def_name}_case{i + 1:03d}.safetensors"
        tensors = {a.name: v.detach().to("cpu").contiguous() for a, v in zip(args, values) if a.tensor and a.role == "INPUT"}
        digest = hashlib.sha256(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())).hexdigest()
        inputs = {}
        for a, v in zip(args, values):
            if a.role != "INPUT":
                continue
            inputs[a.name] = ({"type": "safetensors", "path": blob, "tensor_key": a.name} if a.tensor
                              else {"type": "scalar", "value": v})
        if tensors:
            blobs[blob] = tensors
        workloads.append(Workload.model_validate({
            "axes": {n: int(v) for n, v in _case_axes(args, axis_of, i).items() if axes[n]["type"] == "var"},
            "inputs": inputs,
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"fibray-xpuoj:{def_name}:{i + 1}:{digest}")),
        }))

    solution = None
    found = _submission(package)
    if found is not None:
        cu, headers = found
        sources = [{"path": "submission.cuh", "content": cu.read_text(encoding="utf-8")},
                   *({"path": h.name, "content": h.read_text(encoding="utf-8")} for h in headers),
                   {"path": "kernel.cu", "content": _adapter_source(args, definition.var_axes, "submission.cuh")}]
        solution = Solution.model_validate({
            "name": f"{def_name}_xpuoj_cuda", "definition": def_name, "author": "xpuoj-import",
            "spec": {"language": "cuda", "target_hardware": ["cuda"], "entry_point": "kernel.cu::run_kernel",
                     "dependencies": [], "destination_passing_style": True, "binding": "c_abi"},
            "sources": sources,
            "description": f"The XPU-OJ submission {cu.name} of package {package.name!r}, behind a generated c_abi entry.",
        })
    return ImportedProblem(definition=definition, workloads=workloads, blobs=blobs, solution=solution)


def _case_axes(args: list[_Arg], axis_of: dict[tuple[int, int], str], case: int) -> dict[str, int]:
    return {axis: args[i].shapes[case][d] for (i, d), axis in axis_of.items()}


# -- writing ------------------------------------------------------------------------------
def write_dataset(imported: ImportedProblem, out: str | Path) -> list[Path]:
    """Write the import into a dataset folder (created if needed); refuses to overwrite a different file."""
    from safetensors.torch import save

    out = Path(out)
    d = imported.definition
    files: dict[Path, bytes] = {
        out / "definitions" / OP_TYPE / f"{d.name}.json": (json.dumps(d.to_json_dict(), indent=2) + "\n").encode(),
        out / "workloads" / OP_TYPE / f"{d.name}.jsonl": "".join(
            json.dumps(Trace(definition=d.name, workload=w).to_json_dict()) + "\n" for w in imported.workloads).encode(),
    }
    for rel, tensors in imported.blobs.items():
        files[out / rel] = save(tensors)
    if imported.solution is not None:
        s = imported.solution
        files[out / "solutions" / OP_TYPE / d.name / f"{s.name}.json"] = (json.dumps(s.to_json_dict(), indent=2) + "\n").encode()
    clashes = [p for p, data in files.items() if p.exists() and p.read_bytes() != data]
    if clashes:
        raise XpuojError(f"{out}: would overwrite different existing files: {[str(p) for p in clashes]}")
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)
    return sorted(files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fibray.interop.xpuoj", description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path, help="XPU-OJ problem package folder")
    parser.add_argument("out", type=Path, help="FlashInfer Trace dataset folder to write into")
    parser.add_argument("--name", default=None, help="definition name (default: xpuoj_<package folder>)")
    parser.add_argument("--device", default="cpu", help="device genTestCase draws on (default cpu)")
    parser.add_argument("--max-case-bytes", type=int, default=256 << 20, help="skip test cases with larger input blobs")
    a = parser.parse_args(argv)
    try:
        imported = import_package(a.package, name=a.name, device=a.device, max_case_bytes=a.max_case_bytes)
        written = write_dataset(imported, a.out)
    except XpuojError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sol = imported.solution.name if imported.solution else "no submission"
    print(f"{imported.definition.name}: {len(imported.workloads)} workloads, solution {sol}; {len(written)} files under {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
