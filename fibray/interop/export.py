"""Export trace-store rows to a FlashInfer Trace dataset folder that flashinfer-bench 0.1.2 loads.

Writes definitions/, solutions/, workloads/ (and the blobs they name) and
traces/<op_type>/<definition>.jsonl with one Trace per store row. Definitions and solutions
come from the dataset roots the sweep used; a row whose solution hash differs from the
solution found there is an error, because the code that was judged would not be the code
exported. c_abi solutions, which flashinfer-bench cannot build, are exported as torch
extensions wrapping the same run_kernel. It writes into a new folder, all at once or not at all.

    python -m fibray.interop.export --store ROOT [--sweep NAME] --dataset DIR [--solutions DIR ...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from fibray.dataset.loader import DatasetError, load_dataset
from fibray.schema import (
    Correctness, Definition, Environment, Evaluation, EvaluationStatus, Performance, SafetensorsInput, Solution,
    Trace, Workload,
)

__all__ = ["ExportError", "ExportReport", "evaluation_from_row", "export_store", "main", "torch_shim_solution"]

log = logging.getLogger(__name__)

FLASHINFER_BINDINGS = (None, "torch", "tvm-ffi")
"""Bindings flashinfer-bench 0.1.2's BuildSpec accepts."""
SHIM_FILE = "_fibray_torch_shim.cpp"


class ExportError(ValueError):
    """The rows cannot be exported as asked; the message names the row, solution or folder."""


@dataclass
class ExportReport:
    """What an export wrote."""

    out: Path
    traces: int = 0
    definitions: int = 0
    solutions: int = 0
    workloads: int = 0
    blobs: int = 0
    converted: list[str] = field(default_factory=list)
    """c_abi solutions exported as torch extensions."""
    skipped: Counter = field(default_factory=Counter)
    """solution name -> rows not exported (a binding FlashInfer Trace cannot express)."""
    missing_blobs: list[str] = field(default_factory=list)


# -- rows -> models ----------------------------------------------------------------------
def _num(v: Optional[float]) -> float:
    return float("nan") if v is None else float(v)


def evaluation_from_row(row: dict[str, Any]) -> Evaluation:
    """The FlashInfer Trace Evaluation of one store row."""
    status = EvaluationStatus(row["status"])
    correctness = performance = None
    if status in (EvaluationStatus.PASSED, EvaluationStatus.INCORRECT_NUMERICAL):
        extra = json.loads(row["correctness_extra"]) if row.get("correctness_extra") else None
        correctness = Correctness(max_relative_error=_num(row.get("max_rel_error")),
                                  max_absolute_error=_num(row.get("max_abs_error")), extra=extra)
    if status == EvaluationStatus.PASSED:
        fields = {"latency_p95_ms": row.get("latency_p95_ms"), "latency_mean_ms": row.get("latency_mean_ms"),
                  "latency_cv": row.get("latency_cv"), "n_samples": row.get("n_samples")}
        performance = Performance(latency_ms=row.get("latency_ms") or 0.0,
                                  reference_latency_ms=row.get("reference_latency_ms") or 0.0,
                                  speedup_factor=row.get("speedup") or 0.0,
                                  **{k: v for k, v in fields.items() if v is not None and not _nan(v)})
    return Evaluation(
        status=status, log=row.get("log") or "", correctness=correctness, performance=performance,
        environment=Environment(hardware=row.get("hardware") or "unknown", libs=json.loads(row.get("libs") or "{}")),
        timestamp=row.get("evaluation_timestamp") or str(row.get("finished_at")), reason=row.get("reason"),
    )


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


# -- c_abi -> torch extension -------------------------------------------------------------
def _cident(name: str) -> str:
    return "a_" + re.sub(r"\W", "_", name)


def torch_shim_solution(solution: Solution, definition: Definition) -> Solution:
    """The c_abi solution as a torch-binding solution: a pybind11 `run` that calls run_kernel.

    Same kernel sources and calling convention (fibray.compile.cuda); the shim passes data
    pointers, scalars (double / int64_t) and the var-axis sizes read off the tensors.
    """
    from fibray.compile.cuda import CAbiArgumentError, c_abi_axis_sources

    try:
        locations = c_abi_axis_sources(definition)
    except CAbiArgumentError as e:
        raise ExportError(f"solution {solution.name!r}: {e}") from None
    entry = solution.entry_symbol
    tensors = [*definition.inputs.items(), *definition.outputs.items()]
    c_params, py_params, call, checks = [], [], [], []
    for i, (name, spec) in enumerate(tensors):
        ident = _cident(name)
        is_input = i < len(definition.inputs)
        if spec.shape is None and is_input:
            ctype = "double" if spec.dtype.value.startswith(("float", "bfloat")) else "int64_t"
            c_params.append(ctype)
            py_params.append(f"{ctype} {ident}")
            call.append(ident)
        else:
            c_params.append("void*" if not is_input else "const void*")
            py_params.append(f"{'const ' if is_input else ''}at::Tensor& {ident}")
            call.append(f"{ident}.data_ptr()")
            checks.append(f'  TORCH_CHECK({ident}.is_cuda() && {ident}.is_contiguous(), "{name}: expected a contiguous CUDA tensor");')
    c_params += ["int64_t"] * len(locations)
    call += [f"{_cident(tensors[i][0])}.size({d})" for i, d in locations]
    shim = (
        "// Generated by fibray.interop.export: the c_abi entry of this solution as a torch extension,\n"
        "// because flashinfer-bench 0.1.2 builds torch and tvm-ffi bindings only. Same convention:\n"
        "// inputs (tensor -> pointer, float scalar -> double, int scalar -> int64_t), outputs, var axes.\n"
        "#include <ATen/core/Tensor.h>\n#include <torch/csrc/utils/pybind.h>\n\n#include <cstdint>\n\n"
        f"extern \"C\" void {entry}({', '.join(c_params)});\n\n"
        f"void run({', '.join(py_params)}) {{\n" + "\n".join(checks) + ("\n" if checks else "")
        + f"  {entry}({', '.join(call)});\n}}\n\n"
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"run\", &run); }\n"
    )
    if any(s.path == SHIM_FILE for s in solution.sources):
        raise ExportError(f"solution {solution.name!r} already has a source named {SHIM_FILE}")
    data = solution.to_json_dict()
    data["spec"] = {**data["spec"], "binding": "torch", "entry_point": f"{SHIM_FILE}::run"}
    data["sources"] = [*data["sources"], {"path": SHIM_FILE, "content": shim}]
    data["description"] = ((solution.description or "").rstrip() + " [exported from binding c_abi by fibray]").strip()
    return Solution.model_validate(data)


def _exportable(solution: Solution, definition: Definition) -> Optional[tuple[Solution, bool]]:
    """(the solution as FlashInfer Trace can hold it, whether it was converted) or None."""
    if solution.spec.language.value not in ("cuda", "cpp"):
        return solution, False
    binding = solution.spec.binding
    if binding == "c_abi":
        return torch_shim_solution(solution, definition), True
    if binding is None:  # fibray's default for cuda/cpp is torch; flashinfer-bench's would be tvm-ffi
        data = solution.to_json_dict()
        data["spec"] = {**data["spec"], "binding": "torch"}
        return Solution.model_validate(data), False
    return (solution, False) if binding in FLASHINFER_BINDINGS else None


# -- the export ---------------------------------------------------------------------------
def _load_sources(datasets: Sequence[Path], solution_roots: Sequence[Path]):
    definitions: dict[str, tuple[Definition, Path]] = {}
    solutions: dict[str, tuple[Solution, str]] = {}
    for root in datasets:
        try:
            ds = load_dataset(root, solution_roots=solution_roots, require_blobs=False)
        except DatasetError as e:
            raise ExportError(f"--dataset {root}: {e}") from None
        for name, d in ds.definitions.items():
            if name in definitions and definitions[name][0] != d:
                raise ExportError(f"definition {name!r} differs between {definitions[name][1]} and {root}")
            definitions.setdefault(name, (d, Path(root)))
        for name, s in ds.solutions.items():
            if name in solutions and solutions[name][0].hash != s.hash:
                raise ExportError(f"solution {name!r} differs between {solutions[name][1]} and {ds.origin[f'solution:{name}']}")
            solutions.setdefault(name, (s, ds.origin[f"solution:{name}"]))
    return definitions, solutions


def export_store(store_root: str | Path, out: str | Path, *, datasets: Sequence[str | Path],
                 solution_roots: Sequence[str | Path] = (), sweep: Optional[str] = None) -> ExportReport:
    """Export the rows of one sweep (or the whole store) into a new dataset folder `out`."""
    from fibray.store import TraceStore

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty folder")
    rows = TraceStore(store_root).read(sweep=sweep).to_pylist()
    if not rows:
        raise ExportError(f"--store {store_root}: no rows{f' for sweep {sweep!r}' if sweep else ''}")
    definitions, solutions = _load_sources([Path(d) for d in datasets], [Path(s) for s in solution_roots])

    report = ExportReport(out=out)
    traces: dict[str, list[dict[str, Any]]] = {}
    workloads: dict[str, dict[str, Workload]] = {}
    exported: dict[str, Solution] = {}
    rows.sort(key=lambda r: (r["definition"], r["solution"], r["workload_uuid"], str(r.get("finished_at"))))
    for row in rows:
        where = f"store row {row['job_id'][:12]} (sweep {row['sweep']!r})"
        if row["definition"] not in definitions:
            raise ExportError(f"{where}: definition {row['definition']!r} is in none of --dataset {list(map(str, datasets))}")
        definition, _ = definitions[row["definition"]]
        if row["solution"] not in solutions:
            raise ExportError(f"{where}: solution {row['solution']!r} is in none of the datasets' solutions/ "
                              f"or --solutions {list(map(str, solution_roots))}")
        solution, origin = solutions[row["solution"]]
        if solution.hash != row["solution_hash"]:
            raise ExportError(f"{where}: solution {row['solution']!r} was evaluated with hash {row['solution_hash'][:16]}, "
                              f"but {origin} has hash {solution.hash[:16]}: its code changed since the sweep")
        if solution.name not in exported:
            found = _exportable(solution, definition)
            if found is None:
                report.skipped[solution.name] += 1
                continue
            exported[solution.name], converted = found
            if converted:
                report.converted.append(solution.name)
        workload = Workload.model_validate_json(row["workload"])
        workloads.setdefault(definition.name, {})[workload.uuid] = workload
        trace = Trace(definition=definition.name, workload=workload, solution=solution.name,
                      evaluation=evaluation_from_row(row))
        trace_json = json.loads(trace.model_dump_json(exclude_unset=True))  # NaN/inf as "NaN" strings: strict JSON
        trace_json["fibray"] = {"job_id": row["job_id"], "sweep": row["sweep"], "solution_hash": row["solution_hash"],
                                "worker": row.get("worker"), "isolation": row.get("isolation"), "attempt": row.get("attempt")}
        traces.setdefault(definition.name, []).append(trace_json)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        for name in sorted(traces):
            definition, root = definitions[name]
            op = definition.op_type
            _write_json(tmp / "definitions" / op / f"{name}.json", definition.to_json_dict())
            lines = [Trace(definition=name, workload=w).to_json_dict() for w in workloads[name].values()]
            _write_jsonl(tmp / "workloads" / op / f"{name}.jsonl", lines)
            _write_jsonl(tmp / "traces" / op / f"{name}.jsonl", traces[name])
            report.definitions += 1
            report.workloads += len(lines)
            report.traces += len(traces[name])
            for w in workloads[name].values():
                for src in w.inputs.values():
                    if isinstance(src, SafetensorsInput):
                        blob, target = root / src.path, tmp / src.path
                        if target.exists():
                            continue
                        if blob.is_file():
                            target.parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(blob, target)
                            report.blobs += 1
                        elif src.path not in report.missing_blobs:
                            report.missing_blobs.append(src.path)
        for sol in exported.values():
            op = definitions[sol.definition][0].op_type
            _write_json(tmp / "solutions" / op / sol.definition / f"{sol.name}.json", sol.to_json_dict())
            report.solutions += 1
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fibray.interop.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, type=Path, help="trace store root")
    p.add_argument("--sweep", default=None, help="sweep name (default: every row of the store)")
    p.add_argument("--dataset", required=True, action="append", type=Path, help="dataset root the sweep used (repeatable)")
    p.add_argument("--solutions", nargs="*", action="extend", default=[], type=Path, help="extra solution folders")
    p.add_argument("--out", required=True, type=Path, help="new dataset folder to write")
    a = p.parse_args(argv)
    try:
        report = export_store(a.store, a.out, datasets=a.dataset, solution_roots=a.solutions, sweep=a.sweep)
    except ExportError as e:
        print(f"fibray.interop.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {report.out.resolve()}: {report.traces} traces (traces/), {report.definitions} definitions, "
          f"{report.solutions} solutions, {report.workloads} workloads, {report.blobs} blobs; "
          "flashinfer_bench's TraceSet.from_path loads it")
    if report.converted:
        print(f"c_abi solutions exported as torch extensions: {', '.join(report.converted)}")
    for name, n in sorted(report.skipped.items()):
        print(f"warning: {n} rows of solution {name!r} skipped: its binding cannot be expressed in FlashInfer Trace",
              file=sys.stderr)
    for blob in report.missing_blobs:
        print(f"warning: blob {blob} not found under the dataset roots; the trace names it anyway", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
