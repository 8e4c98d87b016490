"""The built-in search: a generator that needs no model. It mutates a template Triton solution's tuning knobs
and keeps the best.

Knobs are what the template declares (`# fibray-tune: BLOCK=[64, 128, 256]` comments, a module-level
`TUNE = {"BLOCK": [...]}` dict) and, found by themselves, integer `num_warps=` / `num_stages=` /
`BLOCK*=` keyword arguments. `# fibray-tune-if: BLOCK_M * BLOCK_N <= 4096 * NUM_WARPS` comments are
constraints: the search proposes no configuration that breaks one (a tile far too large for its warps
spills, and its compilation alone can outlast the run deadline). A knob is set where its value is written: a module-level `NAME = <literal>`
or a `NAME=<literal>` keyword argument. The search is stateless: it reads what it tried, and how that
did, from the task's feedback (each candidate's description records its configuration), so a resumed
loop continues where it was.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import json
import random
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fibray.evolve.generators import GeneratorOutput
from fibray.schema import Solution
from fibray.schema.reasons import GeneratorReason

__all__ = ["Knob", "SearchGenerator", "TuningTemplate", "config_of", "load_template"]

CONFIG_TAG = "fibray-tune: "
"""A search candidate's description starts with this, then its configuration as JSON."""
_AUTO_SPACES = {"num_warps": [1, 2, 4, 8, 16], "num_stages": [1, 2, 3, 4, 5]}
_ELITE = 3
"""Parents are drawn from this many best configurations."""


@dataclass
class Knob:
    """One tuning knob: its values and where the template writes it."""

    name: str
    values: list[Any]
    default: Any
    sites: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(source path, line, start column, end column) of each literal that holds the knob's value."""


_CONSTRAINT_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div,
                     ast.FloorDiv, ast.Mod, ast.Pow, ast.UnaryOp, ast.USub, ast.Not, ast.Compare, ast.Eq, ast.NotEq,
                     ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Name, ast.Load, ast.Constant)


@dataclass
class Constraint:
    """A `# fibray-tune-if: EXPR` comment: arithmetic and comparisons over knob names and numbers."""

    text: str
    code: Any
    names: set[str]
    """The knob names it reads."""

    def holds(self, config: dict[str, Any]) -> bool:
        return bool(eval(self.code, {"__builtins__": {}}, dict(config)))  # noqa: S307  (checked: _constraints)


def _constraints(text: str, where: str) -> list[Constraint]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and "fibray-tune-if:" in tok.string:
            expr = tok.string.split("fibray-tune-if:", 1)[1].strip()
            try:
                tree = ast.parse(expr, mode="eval")
            except SyntaxError as e:
                raise ValueError(f"{where} line {tok.start[0]}: fibray-tune-if: {expr!r}: {e.msg}") from None
            bad = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, _CONSTRAINT_NODES)
                   or (isinstance(n, ast.Constant) and not isinstance(n.value, (int, float)))]
            if bad:
                raise ValueError(f"{where} line {tok.start[0]}: fibray-tune-if: {expr!r}: only knob names, numbers, "
                                 f"arithmetic and comparisons are allowed (found {', '.join(sorted(set(bad)))})")
            out.append(Constraint(expr, compile(tree, where, "eval"), {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}))
    return out


def _comment_knobs(text: str) -> dict[str, list[Any]]:
    knobs: dict[str, list[Any]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and "fibray-tune:" in tok.string:
            for name, values in re.findall(r"(\w+)\s*=\s*(\[[^\]]*\])", tok.string.split("fibray-tune:", 1)[1]):
                knobs[name] = list(ast.literal_eval(values))
    return knobs


def _sites(path: str, tree: ast.Module) -> tuple[dict[str, list[tuple]], dict[str, Any], dict[str, list[Any]]]:
    """Literal sites per name, their first value, and a module-level TUNE dict (if any)."""
    sites: dict[str, list[tuple]] = {}
    first: dict[str, Any] = {}
    tune: dict[str, list[Any]] = {}

    def note(name: str, node: ast.AST) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool) \
                and node.lineno == node.end_lineno:
            sites.setdefault(name, []).append((path, node.lineno, node.col_offset, node.end_col_offset))
            first.setdefault(name, node.value)

    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "TUNE":
                tune = {k: list(v) for k, v in ast.literal_eval(node.value).items()}
            else:
                note(node.targets[0].id, node.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg:
                    note(kw.arg, kw.value)
    return sites, first, tune


def _auto_values(name: str, value: Any) -> Optional[list[Any]]:
    if name in _AUTO_SPACES:
        return _AUTO_SPACES[name]
    if "BLOCK" in name.upper() and isinstance(value, int) and value > 0 and value & (value - 1) == 0:
        return [2 ** k for k in range(4, 14) if 2 ** k <= max(256, 16 * value)]
    return None


class TuningTemplate:
    """A template solution and its knobs; `render(config)` writes a configuration into its sources."""

    def __init__(self, solution: Solution) -> None:
        self.solution = solution
        self.knobs: dict[str, Knob] = {}
        declared: dict[str, list[Any]] = {}
        sites: dict[str, list[tuple]] = {}
        first: dict[str, Any] = {}
        for src in solution.sources:
            if not src.path.endswith(".py"):
                continue
            try:
                tree = ast.parse(src.content)
            except SyntaxError as e:
                raise ValueError(f"template {solution.name!r}: {src.path} line {e.lineno}: {e.msg}") from None
            s, f, tune = _sites(src.path, tree)
            declared.update(tune)
            declared.update(_comment_knobs(src.content))
            for k, v in s.items():
                sites.setdefault(k, []).extend(v)
            for k, v in f.items():
                first.setdefault(k, v)
        for name in sorted(set(declared) | set(sites)):
            values = declared.get(name) or _auto_values(name, first.get(name))
            if values is None:
                continue
            if name not in sites:
                raise ValueError(f"template {solution.name!r}: knob {name!r} is declared but no `{name} = <number>` "
                                 f"or `{name}=<number>` argument holds its value")
            default = first[name]
            self.knobs[name] = Knob(name, values if default in values else sorted({*values, default}), default, sites[name])
        if not self.knobs:
            raise ValueError(f"template {solution.name!r}: no tuning knobs (declare them with `# fibray-tune: NAME=[...]`)")
        self.constraints = [c for src in solution.sources if src.path.endswith(".py")
                            for c in _constraints(src.content, f"template {solution.name!r}: {src.path}")]
        for c in self.constraints:
            unknown = sorted(c.names - set(self.knobs))
            if unknown:
                raise ValueError(f"template {solution.name!r}: fibray-tune-if: {c.text!r} names {unknown}, which are not "
                                 f"knobs ({sorted(self.knobs)})")

    def allows(self, config: dict[str, Any]) -> bool:
        """Whether a configuration (knobs left out take their defaults) keeps every constraint."""
        full = {**self.default, **config}
        return all(c.holds(full) for c in self.constraints)

    @property
    def default(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs.values()}

    def render(self, config: dict[str, Any], *, name: str, author: str = "fibray-search") -> Solution:
        """The template with every knob's literals replaced by the configuration's values."""
        edits: dict[str, list[tuple[int, int, int, str]]] = {}
        for knob in self.knobs.values():
            for path, line, start, end in knob.sites:
                edits.setdefault(path, []).append((line, start, end, repr(config.get(knob.name, knob.default))))
        sources = []
        for src in self.solution.sources:
            lines = src.content.encode().split(b"\n")
            for line, start, end, text in sorted(edits.get(src.path, []), reverse=True):
                row = lines[line - 1]
                lines[line - 1] = row[:start] + text.encode() + row[end:]
            sources.append({"path": src.path, "content": b"\n".join(lines).decode()})
        data = self.solution.to_json_dict()
        data.update(name=name, author=author, sources=sources,
                    description=CONFIG_TAG + json.dumps(config, sort_keys=True))
        return Solution.model_validate(data)


def load_template(path: str | Path, definition: str) -> Solution:
    """A template for one definition: a Solution JSON, or a Triton .py file whose `run` is the entry
    (destination-passing unless it says `# fibray-dps: false`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"evolve.generator.templates: {path} is not a file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        data["definition"] = definition
    else:
        entry = re.search(r"#\s*fibray-entry:\s*(\w+)", text)
        data = {"name": f"{definition}_{path.stem}", "definition": definition, "author": "fibray-template",
                "spec": {"language": "triton", "target_hardware": ["cuda", "cpu"],
                         "entry_point": f"{path.name}::{entry.group(1) if entry else 'run'}",
                         "destination_passing_style": not re.search(r"#\s*fibray-dps:\s*false", text)},
                "sources": [{"path": path.name, "content": text}]}
    return Solution.model_validate(data)


def config_of(description: Optional[str]) -> Optional[dict[str, Any]]:
    """The configuration a search candidate's description records, or None."""
    if not description or not description.startswith(CONFIG_TAG):
        return None
    try:
        return json.loads(description[len(CONFIG_TAG):])
    except json.JSONDecodeError:
        return None


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


class SearchGenerator:
    """Proposes N unseen configurations per round: mutations of the best ones, some drawn at random."""

    name = "search"

    def __init__(self, templates: dict[str, str], *, seed: int = 0, explore: float = 0.25) -> None:
        self.templates, self.seed, self.explore = templates, seed, explore
        self._cache: dict[str, TuningTemplate] = {}

    def template_for(self, definition: str) -> TuningTemplate:
        if definition not in self._cache:
            match = next((p for pattern, p in self.templates.items() if fnmatch.fnmatchcase(definition, pattern)), None)
            if match is None:
                raise ValueError(f"evolve.generator.templates: no template pattern matches definition {definition!r} "
                                 f"(patterns: {sorted(self.templates)})")
            self._cache[definition] = TuningTemplate(load_template(match, definition))
        return self._cache[definition]

    def _mutate(self, config: dict[str, Any], tmpl: TuningTemplate, rng: random.Random) -> dict[str, Any]:
        out = dict(config)
        for name in rng.sample(sorted(tmpl.knobs), k=min(len(tmpl.knobs), 1 if rng.random() < 0.7 else 2)):
            values = tmpl.knobs[name].values
            i = values.index(out[name]) if out.get(name) in values else values.index(tmpl.knobs[name].default)
            step = rng.choice([-1, 1]) * (1 if rng.random() < 0.8 else 2)
            out[name] = values[max(0, min(len(values) - 1, i + step))]
        return out

    def generate(self, task: dict[str, Any]) -> GeneratorOutput:
        definition = task["definition"]["name"]
        tmpl = self.template_for(definition)
        history = []
        for rnd in task.get("feedback", []):
            for cand in rnd.get("candidates", []):
                config = config_of(cand.get("description"))
                if config is not None:
                    history.append((config, cand.get("speedup"), cand["solution"]))
        seen = {_key(c) for c, _, _ in history}
        elite = sorted((h for h in history if h[1]), key=lambda h: -h[1])[:_ELITE]
        rng = random.Random(f"{self.seed}:{definition}:{task['round']}")
        proposals: list[tuple[dict[str, Any], str]] = []

        def propose(config: dict[str, Any], parent: str, *, checked: bool = True) -> None:
            if _key(config) not in seen and (not checked or tmpl.allows(config)):
                seen.add(_key(config))
                proposals.append((config, parent))

        if not history:
            propose(tmpl.default, tmpl.solution.name, checked=False)  # the template as written, whatever it says
        tries = 0
        while len(proposals) < task["candidates"] and tries < 200 * task["candidates"]:
            tries += 1
            if not elite or rng.random() < self.explore:
                propose({k: rng.choice(v.values) for k, v in tmpl.knobs.items()}, tmpl.solution.name)
            else:
                parent = elite[0] if rng.random() < 0.6 else rng.choice(elite)
                propose(self._mutate(parent[0], tmpl, rng), parent[2])
        items = []
        for i, (config, parent) in enumerate(proposals):
            sol = tmpl.render(config, name=f"{definition}_search_r{task['round']:03d}_{i}")
            items.append({**sol.to_json_dict(), "parent": parent})
        if not items:
            return GeneratorOutput(reason=GeneratorReason.NO_CANDIDATES, error="search: every configuration was tried")
        return GeneratorOutput(items=items)
