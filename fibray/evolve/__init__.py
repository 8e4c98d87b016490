"""The agent loop (`python -m fibray.evolve`): rounds of generate -> evaluate -> feedback per definition,
public workloads feeding back and hidden ones scoring; shell, callable and built-in search generators."""

from fibray.evolve.backend import EvalBackend, PoolBackend
from fibray.evolve.config import EvolveConfig, validate_evolve_config
from fibray.evolve.generators import CallableGenerator, Generator, GeneratorOutput, ShellGenerator, parse_output
from fibray.evolve.ledger import Ledger, RoundRecord
from fibray.evolve.loop import DefinitionSummary, EvolveReport, build_task, make_generator, run_evolve
from fibray.evolve.search import SearchGenerator, TuningTemplate, load_template
from fibray.evolve.split import WorkloadSplit, split_workloads

__all__ = [
    "CallableGenerator", "DefinitionSummary", "EvalBackend", "EvolveConfig", "EvolveReport", "Generator",
    "GeneratorOutput", "Ledger", "PoolBackend", "RoundRecord", "SearchGenerator", "ShellGenerator", "TuningTemplate",
    "WorkloadSplit", "build_task", "load_template", "make_generator", "parse_output", "run_evolve", "split_workloads",
    "validate_evolve_config",
]
