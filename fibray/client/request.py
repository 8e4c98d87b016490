"""What a client or an HTTP request asks the service for, validated at the edge: a solution, a definition
(by name or inline), a workload selection and settings. Every error is a RequestError naming the field
(`solution.spec.entry_point`, `workloads[2]`); nothing is queued for a request that has one."""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from fibray.dataset import Dataset
from fibray.schema import Definition, EvalSettings, Job, Solution, Workload

_FIELDS = {"solution", "definition", "workloads", "max_workloads", "settings", "sweep"}


class RequestError(ValueError):
    """A request that cannot be evaluated; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _model(model: type[BaseModel], value: Any, field: str) -> Any:
    if isinstance(value, model):
        return value
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RequestError(field, f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise RequestError(field, f"expected a JSON object, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join([field, *(str(x) for x in err["loc"])])
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise RequestError(where, msg + more) from None


def _check_workload(d: Definition, w: Workload, field: str, dataset: Optional[Dataset]) -> None:
    """What the dataset loader checks of a workload file, for an inline one."""
    missing = [a for a in d.var_axes if a not in w.axes]
    if missing:
        raise RequestError(f"{field}.axes", f"missing var axes {missing} of definition {d.name!r}")
    unknown = [n for n in w.inputs if n not in d.inputs]
    if unknown:
        raise RequestError(f"{field}.inputs", f"{unknown} are not inputs of definition {d.name!r} ({list(d.inputs)})")
    for name, src in w.inputs.items():
        if src.type == "safetensors" and (dataset is None or not (dataset.root / src.path).is_file()):
            raise RequestError(f"{field}.inputs.{name}.path", f"safetensors blob {src.path!r} is not in the dataset")


def resolve_jobs(body: dict[str, Any], *, sweep: str, dataset: Optional[Dataset], dataset_root: Optional[str],
                 max_workloads: Optional[int] = None) -> list[Job]:
    """The jobs a request stands for, one per selected workload (in selection order)."""
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(unknown[0], f"unknown field (expected some of {sorted(_FIELDS)})")
    if "solution" not in body:
        raise RequestError("solution", "required field is missing")
    if "definition" not in body:
        raise RequestError("definition", "required field is missing")
    solution: Solution = _model(Solution, body["solution"], "solution")
    raw_def = body["definition"]
    if isinstance(raw_def, str) and not raw_def.lstrip().startswith("{"):
        if dataset is None:
            raise RequestError("definition", f"{raw_def!r} is a name, but there is no dataset to find it in "
                                             "(send the definition object)")
        if raw_def not in dataset.definitions:
            raise RequestError("definition", f"unknown definition {raw_def!r} in {dataset.root}")
        definition = dataset.definitions[raw_def]
    else:
        definition = _model(Definition, raw_def, "definition")
    if solution.definition != definition.name:
        raise RequestError("solution.definition", f"{solution.definition!r}, but the definition is {definition.name!r}")
    settings: EvalSettings = _model(EvalSettings, body.get("settings") or {}, "settings")
    sweep = body.get("sweep") or sweep
    if not isinstance(sweep, str) or not sweep.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise RequestError("sweep", f"must be letters, digits, '_', '.', '-' (got {sweep!r})")
    workloads = _workloads(body.get("workloads"), definition, dataset)
    cap = body.get("max_workloads")
    if cap is not None:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise RequestError("max_workloads", f"must be a positive integer (got {cap!r})")
        workloads = workloads[:cap]
    if not workloads:
        raise RequestError("workloads", f"selects no workload of {definition.name!r}")
    if max_workloads is not None and len(workloads) > max_workloads:
        raise RequestError("workloads", f"{len(workloads)} selected; at most {max_workloads} per request")
    root = str(dataset.root.resolve()) if dataset is not None else (dataset_root or ".")
    return [Job(job_id=Job.make_id(definition, w, solution, settings), sweep=sweep, definition=definition, workload=w,
                solution=solution, settings=settings, dataset_root=root) for w in workloads]


def _workloads(selection: Any, definition: Definition, dataset: Optional[Dataset]) -> list[Workload]:
    known = {w.uuid: w for w in dataset.workloads.get(definition.name, [])} if dataset is not None else {}
    if selection is None:
        if dataset is None:
            raise RequestError("workloads", "required when there is no dataset (a list of workload objects)")
        return list(known.values())
    if not isinstance(selection, list):
        raise RequestError("workloads", f"expected a list of workload uuids or objects, got {type(selection).__name__}")
    out = []
    for i, item in enumerate(selection):
        field = f"workloads[{i}]"
        if isinstance(item, str):
            if item not in known:
                raise RequestError(field, f"unknown workload uuid {item!r} for {definition.name!r}")
            out.append(known[item])
        else:
            w = _model(Workload, item, field)
            _check_workload(definition, w, field, dataset)
            out.append(w)
    return out
