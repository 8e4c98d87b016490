"""Import KernelBench-style tasks (`class Model`, `get_inputs`, `get_init_inputs`) as a FlashInfer Trace dataset.

Each task file becomes a Definition (a const axis per tensor dimension; the Model's parameters are
inputs whose values, drawn once from a seed, live in a safetensors blob every workload shares; the
reference is the file itself plus a `run` that calls the Model's forward with those weights),
workloads (get_inputs() under seeds, saved as blobs) and a reference Solution. KernelBench
candidates (`class ModelNew`) become Solutions through the same generated entry. Every file is
checked before anything is written; the output appears all at once, or not at all.

    python -m fibray.interop.kernelbench SRC OUT [--workloads N] [--seed S] [--candidate FILE=DEFINITION ...]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

import torch

from fibray.interop.kernelbench_entry import (
    BINDING, ENTRY_FILE, META_NAME, OP_TYPE, KernelBenchError, entry_block, is_kernelbench, kernelbench_meta,
    kernelbench_solution, wrap_model_new,
)
from fibray.schema import Definition, Solution, Trace, Workload

__all__ = [
    "BINDING", "ENTRY_FILE", "Imported", "ImportedTask", "KernelBenchError", "import_task", "import_tasks", "is_kernelbench",
    "kernelbench_meta", "kernelbench_solution", "main", "wrap_model_new", "write_tasks",
]

_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int64: "int64",
    torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.bool: "bool",
}


@dataclass
class ImportedTask:
    """One task, in memory, before anything is written."""

    source: Path
    definition: Definition
    workloads: list[Workload]
    blobs: dict[str, dict[str, torch.Tensor]]  # relative blob path -> tensors
    solutions: list[Solution] = field(default_factory=list)


# -- reading a task -------------------------------------------------------------------------
def _sanitize(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "task"


def _load(path: Path) -> tuple[str, ModuleType]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise KernelBenchError(f"{path}: cannot read the task: {type(e).__name__}: {e}") from None
    top = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    if "Model" not in top:
        hint = " (it defines ModelNew: pass it as --candidate FILE=DEFINITION)" if "ModelNew" in top else ""
        raise KernelBenchError(f"{path}: no top-level `class Model(nn.Module)`{hint}")
    missing = [f for f in ("get_inputs", "get_init_inputs") if f not in top]
    if missing:
        raise KernelBenchError(f"{path}: missing top-level function(s) {missing}")
    name = f"_fibray_kernelbench_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the task file is foreign code; any failure is a bad task
        raise KernelBenchError(f"{path}: executing the task failed: {type(e).__name__}: {e}") from None
    return text, module


def _call(path: Path, fn: Any, what: str) -> Any:
    try:
        return fn()
    except Exception as e:  # foreign code
        raise KernelBenchError(f"{path}: {what} raised {type(e).__name__}: {e}") from None


def _literal(path: Path, init: Any) -> list[Any]:
    """Init inputs as Python literals (they are written into the generated entry)."""
    if not isinstance(init, (list, tuple)):
        raise KernelBenchError(f"{path}: get_init_inputs() must return a list, got {type(init).__name__}")
    for i, v in enumerate(init):
        try:
            ok = ast.literal_eval(repr(v)) == v
        except (ValueError, SyntaxError, TypeError):
            ok = False
        if not ok:
            raise KernelBenchError(f"{path}: get_init_inputs()[{i}] is a {type(v).__name__} ({v!r:.40}); the importer "
                                   "keeps only literal init inputs (numbers, strings, tuples, lists)")
    return list(init)


def _tensors(path: Path, values: Any, workload: int) -> list[torch.Tensor]:
    if not isinstance(values, (list, tuple)) or not values:
        raise KernelBenchError(f"{path}: get_inputs() must return a non-empty list of tensors, got {values!r:.80}")
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise KernelBenchError(f"{path}: get_inputs()[{i}] is a {type(v).__name__}, not a tensor "
                                   "(non-tensor arguments belong in get_init_inputs)")
        if v.dtype not in _DTYPES:
            raise KernelBenchError(f"{path}: get_inputs()[{i}] has dtype {v.dtype}, which FlashInfer Trace cannot describe")
    return [v.detach().to("cpu").contiguous() for v in values]


def _input_names(path: Path, model_cls: type, count: int) -> list[str]:
    try:
        params = list(inspect.signature(model_cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:count]
    if len(names) != count or len(set(names)) != count or any(n.startswith("_") for n in names):
        names = [f"input{i}" for i in range(count)]
    return names


def _outputs(path: Path, module: ModuleType, init: list[Any], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Output shapes and dtypes: a forward on the meta device (no compute), else on the CPU."""
    try:
        with torch.device("meta"):
            out = module.Model(*init)(*[t.to("meta") for t in inputs])
    except Exception:  # an op without a meta kernel, or data-dependent shapes: compute for real
        try:
            with torch.no_grad():
                out = module.Model(*init)(*inputs)
        except Exception as e:  # foreign code
            raise KernelBenchError(f"{path}: Model(*get_init_inputs())(*get_inputs()) raised {type(e).__name__}: {e}") from None
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if not outs or not all(isinstance(o, torch.Tensor) and o.dtype in _DTYPES for o in outs):
        raise KernelBenchError(f"{path}: Model.forward must return a tensor or a tuple of tensors, got {type(out).__name__}")
    return outs


def import_task(path: str | Path, *, name: Optional[str] = None, workloads: int = 4, seed: int = 0,
                random_inputs: bool = False) -> ImportedTask:
    """Read one task file into a Definition, workloads (+ blobs) and a reference Solution, in memory."""
    path = Path(path)
    text, module = _load(path)
    if META_NAME in text:
        raise KernelBenchError(f"{path}: already holds {META_NAME}; import the original task file")
    init = _literal(path, _call(path, module.get_init_inputs, "get_init_inputs()"))
    def_name = name or f"kb_{_sanitize(path.stem)}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = module.Model(*init)
        except Exception as e:  # foreign code
            raise KernelBenchError(f"{path}: Model(*get_init_inputs()) raised {type(e).__name__}: {e}") from None
        if not isinstance(model, torch.nn.Module):
            raise KernelBenchError(f"{path}: Model is not a torch.nn.Module")
        weights = {p: t.detach().clone().contiguous() for p, t in model.named_parameters()}
        sets = []
        for w in range(workloads):
            torch.manual_seed(seed + 1 + w)
            sets.append(_tensors(path, _call(path, module.get_inputs, "get_inputs()"), w))
    for w, values in enumerate(sets[1:], start=1):
        if [(v.shape, v.dtype) for v in values] != [(v.shape, v.dtype) for v in sets[0]]:
            raise KernelBenchError(f"{path}: get_inputs() changed shapes or dtypes between calls (call {w + 1})")
    names = _input_names(path, module.Model, len(sets[0]))
    params: dict[str, str] = {}
    for p in weights:
        arg = _sanitize(p)
        while arg in params or arg in names:
            arg += "_"
        params[arg] = p
    outs = _outputs(path, module, init, sets[0])
    out_names = ["output"] if len(outs) == 1 else [f"output{i}" for i in range(len(outs))]

    axes: dict[str, dict[str, Any]] = {}

    def tensor(tname: str, t: torch.Tensor) -> dict[str, Any]:
        dims = []
        for d, size in enumerate(t.shape):
            axes[f"{tname}_{d}"] = {"type": "const", "value": int(size)}
            dims.append(f"{tname}_{d}")
        return {"shape": dims, "dtype": _DTYPES[t.dtype]}

    meta = {"init_inputs": init, "seed": seed, "inputs": names, "parameters": params, "task": path.name}
    reference = text.rstrip() + "\n\n\n" + entry_block(meta, "_FibrayModel = Model")
    definition = Definition.model_validate({
        "name": def_name, "op_type": OP_TYPE, "axes": axes,
        "inputs": {**{n: tensor(n, t) for n, t in zip(names, sets[0])},
                   **{a: tensor(a, weights[p]) for a, p in params.items()}},
        "outputs": {n: tensor(n, o) for n, o in zip(out_names, outs)},
        "reference": reference,
        "tags": ["source:kernelbench", f"kernelbench:task:{path.name}"],
        "description": (f"Imported from the KernelBench task {path.name}: Model(*{init!r}).forward({', '.join(names)}) "
                        f"with its parameters ({', '.join(params.values()) or 'none'}) as the inputs "
                        f"{', '.join(params) or '-'}, drawn once with seed {seed}. Candidates: class ModelNew with the "
                        f"same parameter names (fibray.interop.kernelbench.kernelbench_solution)."),
    })

    folder = f"blob/{OP_TYPE}/{def_name}"
    blobs: dict[str, dict[str, torch.Tensor]] = {}
    if params:
        blobs[f"{folder}/weights.safetensors"] = {a: weights[p] for a, p in params.items()}
    wls = []
    for w, values in enumerate(sets):
        blob = f"{folder}/inputs_{w:03d}.safetensors"
        inputs: dict[str, Any] = {}
        for n, v in zip(names, values):
            inputs[n] = {"type": "random"} if random_inputs else {"type": "safetensors", "path": blob, "tensor_key": n}
        for a in params:
            inputs[a] = {"type": "safetensors", "path": f"{folder}/weights.safetensors", "tensor_key": a}
        if not random_inputs:
            blobs[blob] = dict(zip(names, values))
        digest = hashlib.sha256(b"".join(v.reshape(-1).view(torch.uint8).numpy().tobytes() for v in values)).hexdigest()
        wls.append(Workload.model_validate({
            "axes": {}, "inputs": inputs,
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"fibray-kernelbench:{def_name}:{seed}:{w}:{digest}")),
        }))
    reference_solution = kernelbench_solution(
        definition, {"model.py": text}, name=f"{def_name}_reference", author="kernelbench-import",
        entry="model.py::Model", language="python",
        description=f"The task's own Model ({path.name}) as a solution: the eager PyTorch baseline.")
    return ImportedTask(path, definition, wls, blobs, [reference_solution])


def _candidate(spec: str, tasks: dict[str, ImportedTask], out: Path) -> tuple[str, Solution]:
    file, sep, def_name = spec.rpartition("=")
    if not sep or not file:
        raise KernelBenchError(f"--candidate {spec!r}: expected FILE=DEFINITION")
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        raise KernelBenchError(f"{path}: cannot read the candidate: {type(e).__name__}: {e}") from None
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        raise KernelBenchError(f"{path}: no top-level `class ModelNew`")
    if def_name in tasks:
        definition = tasks[def_name].definition
    else:
        found = sorted((out / "definitions").glob(f"**/{def_name}.json")) if out.is_dir() else []
        if not found:
            raise KernelBenchError(f"--candidate {spec!r}: definition {def_name!r} is neither imported now nor in {out}")
        definition = Definition.model_validate_json(found[0].read_text(encoding="utf-8"))
    if not is_kernelbench(definition):
        raise KernelBenchError(f"--candidate {spec!r}: definition {def_name!r} is not a KernelBench import")
    sol = kernelbench_solution(definition, {"model_new.py": text}, name=f"{def_name}_{_sanitize(path.stem)}",
                               author="kernelbench-candidate", description=f"KernelBench candidate {path.name}.")
    return def_name, sol


@dataclass
class Imported:
    """Everything one run of the importer produces: tasks, and candidates for definitions already in OUT."""

    tasks: list[ImportedTask]
    candidates: list[Solution] = field(default_factory=list)


def import_tasks(src: str | Path, *, workloads: int = 4, seed: int = 0, random_inputs: bool = False,
                 candidates: Sequence[str] = (), out: Optional[Path] = None) -> Imported:
    """Every task of a file or folder (**/*.py) and the given candidates; all problems are collected
    into one KernelBenchError, one line per file."""
    src = Path(src)
    if src.is_dir():
        files = sorted(p for p in src.rglob("*.py") if p.is_file() and "__pycache__" not in p.parts)
    elif src.is_file():
        files = [src]
    else:
        raise KernelBenchError(f"{src}: no such file or folder")
    if not files:
        raise KernelBenchError(f"{src}: no task files (*.py)")
    tasks: dict[str, ImportedTask] = {}
    extra: list[Solution] = []
    errors: list[str] = []
    for path in files:
        rel = path.relative_to(src).with_suffix("").as_posix() if src.is_dir() else path.stem
        try:
            task = import_task(path, name=f"kb_{_sanitize(rel)}", workloads=workloads, seed=seed,
                               random_inputs=random_inputs)
        except KernelBenchError as e:
            errors.append(str(e))
            continue
        if task.definition.name in tasks:
            errors.append(f"{path}: definition name {task.definition.name!r} is also that of {tasks[task.definition.name].source}")
        tasks[task.definition.name] = task
    for spec in candidates:
        try:
            def_name, sol = _candidate(spec, tasks, out or Path("/nonexistent"))
        except KernelBenchError as e:
            errors.append(str(e))
            continue
        (tasks[def_name].solutions if def_name in tasks else extra).append(sol)
    if errors:
        raise KernelBenchError("\n".join(errors))
    return Imported(list(tasks.values()), extra)


# -- writing ----------------------------------------------------------------------------------
def _solution_file(s: Solution) -> tuple[str, bytes]:
    return f"solutions/{OP_TYPE}/{s.definition}/{s.name}.json", (json.dumps(s.to_json_dict(), indent=2) + "\n").encode()


def _files(imported: Imported) -> dict[str, bytes]:
    from safetensors.torch import save

    files: dict[str, bytes] = {}
    for task in imported.tasks:
        d = task.definition
        files[f"definitions/{OP_TYPE}/{d.name}.json"] = (json.dumps(d.to_json_dict(), indent=2) + "\n").encode()
        files[f"workloads/{OP_TYPE}/{d.name}.jsonl"] = "".join(
            json.dumps(Trace(definition=d.name, workload=w).to_json_dict()) + "\n" for w in task.workloads).encode()
        for rel, tensors in task.blobs.items():
            files[rel] = save(tensors)
        files.update(_solution_file(s) for s in task.solutions)
    files.update(_solution_file(s) for s in imported.candidates)
    return files


def write_tasks(imported: Imported, out: str | Path) -> list[Path]:
    """Write an import into a dataset folder: staged in a temporary folder, then moved in.

    A new OUT is one rename; into an existing OUT nothing moves if any file would replace a different one.
    """
    out = Path(out)
    files = _files(imported)
    clashes = [rel for rel, data in files.items() if (out / rel).exists() and (out / rel).read_bytes() != data]
    if clashes:
        raise KernelBenchError(f"{out}: would overwrite different existing files: {clashes}")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.kernelbench-", dir=out.parent))
    try:
        for rel, data in files.items():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / rel).write_bytes(data)
        if not out.exists():
            os.chmod(stage, 0o755)
            os.replace(stage, out)
        else:
            for rel in files:
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(stage / rel, out / rel)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return sorted(out / rel for rel in files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fibray.interop.kernelbench", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a KernelBench task file, or a folder of them (**/*.py)")
    parser.add_argument("out", type=Path, help="FlashInfer Trace dataset folder to write (created, or added to)")
    parser.add_argument("--workloads", type=int, default=4, help="workloads per task: get_inputs() under seeds (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights; workload w uses seed+1+w (default 0)")
    parser.add_argument("--random-inputs", action="store_true", help="fibray's seeded random inputs instead of get_inputs() blobs")
    parser.add_argument("--candidate", action="append", default=[], metavar="FILE=DEFINITION",
                        help="a KernelBench candidate (class ModelNew) to add as a solution of DEFINITION (repeatable)")
    a = parser.parse_args(argv)
    if a.workloads < 1:
        print("error: --workloads must be at least 1", file=sys.stderr)
        return 2
    try:
        tasks = import_tasks(a.src, workloads=a.workloads, seed=a.seed, random_inputs=a.random_inputs,
                             candidates=a.candidate, out=a.out)
        written = write_tasks(tasks, a.out)
    except KernelBenchError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    for t in tasks.tasks:
        print(f"{t.definition.name}: {len(t.definition.inputs)} inputs, {len(t.workloads)} workloads, "
              f"solutions {[s.name for s in t.solutions]}")
    for s in tasks.candidates:
        print(f"{s.definition}: solution {s.name}")
    print(f"{len(written)} files under {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
