"""Build python and triton solutions: write the sources to a private package and import it.

Each solution becomes its own package (named after its hash), so two solutions with a
`main.py` never collide in sys.modules. Import-time errors are build errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from fibray.compile.base import BuildError, Runnable, format_raised, register_builder
from fibray.schema import Solution
from fibray.schema.reasons import Reason


def write_sources(solution: Solution, workdir: Path) -> Path:
    """Write the solution's sources under workdir/src and return that folder."""
    src = workdir / "src"
    for f in solution.sources:
        target = src / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text(encoding="utf-8") != f.content:
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(f.content, encoding="utf-8")
            tmp.replace(target)
    return src


def import_entry(solution: Solution, src: Path) -> object:
    """Import the entry file of the solution from src as a private package module."""
    pkg = f"_fibray_sol_{solution.hash[:24]}"
    init = src / "__init__.py"
    if not init.exists():
        init.write_text("", encoding="utf-8")
    entry = Path(solution.entry_file)
    if entry.suffix != ".py":
        raise BuildError(f"spec.entry_point: {solution.entry_file!r} is not a .py file", Reason.BAD_ENTRY_POINT)
    modname = ".".join((pkg, *entry.with_suffix("").parts))
    before = set(sys.modules)
    sys.path.insert(0, str(src))  # lets sibling files import each other by plain name
    try:
        if pkg not in sys.modules:
            spec = importlib.util.spec_from_file_location(pkg, init, submodule_search_locations=[str(src)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[pkg] = module
            spec.loader.exec_module(module)
        return importlib.import_module(modname)
    except BaseException as e:  # a candidate may raise anything at import, SystemExit included
        sys.modules.pop(pkg, None)
        kind = Reason.SYNTAX_ERROR if isinstance(e, SyntaxError) else Reason.IMPORT_ERROR
        raise BuildError(format_raised(e), kind) from None
    finally:
        sys.path.remove(str(src))
        for name in set(sys.modules) - before:
            mod_file = getattr(sys.modules[name], "__file__", None) or ""
            if not name.startswith(pkg) and mod_file.startswith(str(src)):
                sys.modules.pop(name, None)  # sibling imported by plain name; keep it private


@register_builder("python", "triton")
def build_python(solution: Solution, workdir: Path) -> Runnable:
    """Import a python or triton solution and return its entry callable."""
    if solution.spec.language.value == "triton":
        from fibray.compile.triton_interp import prepare_triton

        prepare_triton()
    module = import_entry(solution, write_sources(solution, workdir))
    fn = getattr(module, solution.entry_symbol, None)
    if not callable(fn):
        raise BuildError(
            f"spec.entry_point: {solution.spec.entry_point!r}: symbol {solution.entry_symbol!r} "
            f"is missing or not callable", Reason.MISSING_ENTRY_SYMBOL,
        )
    return Runnable(fn=fn, destination_passing_style=solution.spec.destination_passing_style, solution_hash=solution.hash)


def build_reference(source: str, name: str, workdir: Path) -> callable:
    """Build a definition's reference source (value-returning `run`)."""
    path = workdir / f"_reference_{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"_fibray_ref_{abs(hash(source))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run
