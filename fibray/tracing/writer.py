"""Write traced calls as a FlashInfer Trace dataset that `load_dataset` and a sweep read unchanged.

Layout under the root: definitions/<op_type>/<name>.json (added when missing),
workloads/<set>/<op_type>/<name>.jsonl (appended), and
blob/workloads/<set>/<op_type>/<name>/<name>_<uuid>.safetensors. Workload uuids are
content hashes, so tracing the same calls twice adds nothing. Files are written under
a temporary name and renamed; an existing definition is never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Union

import torch

from fibray.dataset import DatasetError, read_json
from fibray.schema import Definition, RandomInput, SafetensorsInput, ScalarInput, Trace, Workload

Scalar = Union[bool, int, float]
_NAMESPACE = uuid.UUID("5b1e3c4e-0f1b-4b8e-9a57-6b1f1d7f4a10")


class TracingError(RuntimeError):
    """A traced dataset cannot be written as asked (e.g. a different definition of the same name)."""


@dataclass
class TracedCall:
    """One recorded call: var-axis values, the inputs to replay exactly, and scalar inputs."""

    definition: str
    axes: dict[str, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Input name -> CPU copy, saved as safetensors."""
    scalars: dict[str, Scalar] = field(default_factory=dict)
    """Input name -> value of a scalar input."""

    def uuid(self) -> str:
        """A content hash of everything the workload will contain."""
        h = hashlib.sha256(json.dumps([self.definition, self.axes, self.scalars], sort_keys=True).encode())
        for name in sorted(self.tensors):
            t = self.tensors[name].contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return str(uuid.uuid5(_NAMESPACE, h.hexdigest()))


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        # safetensors creates 0600 files; a sweep's candidates may run as another (unprivileged) user
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def existing_definitions(root: Path) -> dict[str, tuple[Path, Definition]]:
    """Definitions already under root/definitions, by name."""
    found = {}
    for path in sorted((root / "definitions").glob("**/*.json")):
        try:
            d = read_json(Definition, path)
        except DatasetError as e:
            raise TracingError(f"cannot trace into {root}: {e}") from None
        found[d.name] = (path, d)
    return found


def ensure_definitions(root: Path, definitions: Mapping[str, Definition]) -> None:
    """Add the definitions the root lacks; fail if one of the same name differs."""
    have = existing_definitions(root)
    for name, d in definitions.items():
        if name in have:
            path, old = have[name]
            if old.to_json_dict() != d.to_json_dict():
                raise TracingError(f"{path}: a different definition named {name!r} is already there")
            continue
        text = json.dumps(d.to_json_dict(), indent=2) + "\n"
        _atomic_write(root / "definitions" / d.op_type / f"{name}.json", lambda p: p.write_text(text, encoding="utf-8"))


def _known_uuids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines()
    return {json.loads(line)["workload"]["uuid"] for line in lines if line.strip()}


def write_calls(root: Path, definitions: Mapping[str, Definition], calls: list[TracedCall], workload_set: str) -> int:
    """Append the calls as workloads (blobs first, then the JSONL line); returns how many were new."""
    from safetensors.torch import save_file

    root = Path(root)
    ensure_definitions(root, {c.definition: definitions[c.definition] for c in calls})
    written = 0
    by_def: dict[str, list[TracedCall]] = {}
    for call in calls:
        by_def.setdefault(call.definition, []).append(call)
    for name, group in by_def.items():
        d = definitions[name]
        jsonl = root / "workloads" / workload_set / d.op_type / f"{name}.jsonl"
        known = _known_uuids(jsonl)
        lines = []
        for call in group:
            wid = call.uuid()
            if wid in known:
                continue
            known.add(wid)
            inputs: dict[str, object] = {}
            if call.tensors:
                rel = Path("blob") / "workloads" / workload_set / d.op_type / name / f"{name}_{wid}.safetensors"
                tensors = {k: v.contiguous() for k, v in call.tensors.items()}
                _atomic_write(root / rel, lambda p: save_file(tensors, str(p)))
                inputs.update({k: SafetensorsInput(path=rel.as_posix(), tensor_key=k) for k in tensors})
            inputs.update({k: ScalarInput(value=v) for k, v in call.scalars.items()})
            ordered = {k: inputs.get(k, RandomInput()) for k in d.inputs}
            workload = Workload(axes=call.axes, inputs=ordered, uuid=wid)
            trace = Trace(definition=name, workload=workload, solution=None, evaluation=None)
            lines.append(json.dumps(trace.model_dump(mode="json"), sort_keys=False))
        if lines:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            with open(jsonl, "a", encoding="utf-8") as f:  # appends of whole lines; readers skip nothing
                f.write("\n".join(lines) + "\n")
            written += len(lines)
    return written
