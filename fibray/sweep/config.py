"""The sweep's typed configuration, validated from the composed Hydra config before any work.

An unknown key or a bad value is one ConfigError naming the key (e.g. `eval.trials`).
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Callable, Literal, Optional, TypeVar, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from fibray import deadlines
from fibray.schema import EvalSettings


M = TypeVar("M", bound=BaseModel)


def name_of_at_most(n: int) -> Any:
    """A str type for names that become folder names and Ray names: 1-n of letters, digits, '_', '.', '-'."""

    def check(v: str) -> str:
        if not re.fullmatch(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{n - 1}}}", v):
            raise ValueError(f"must be 1-{n} of letters, digits, '_', '.', '-'")
        return v

    return Annotated[str, AfterValidator(check)]


Name = name_of_at_most(128)


class ConfigError(ValueError):
    """The sweep configuration is invalid; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class DatasetConfig(_Strict):
    root: str
    """FlashInfer Trace dataset folder."""
    definitions: Optional[list[str]] = None
    """Definition names to sweep; null for all."""
    workload_set: Optional[str] = None
    """Read workloads from workloads/<workload_set>/ only; null for all."""
    max_workloads_per_definition: Optional[int] = Field(default=None, ge=1)
    """Keep the first N workloads of each definition."""
    split: Literal["all", "public", "hidden", "replay"] = "all"
    """Run only workloads of this split (the dataset's splits/ sidecar; unlisted workloads are public)."""


class SolutionsConfig(_Strict):
    roots: list[str] = Field(default_factory=list)
    """Extra folders of solution JSON files (beside the dataset's own solutions/)."""
    names: Optional[list[str]] = None
    """Solution names to sweep; null for all."""
    include_reference: bool = False
    """Also evaluate each definition's reference as a candidate (author `reference`)."""


class StoreConfig(_Strict):
    root: str = "fibray-store"
    """Trace store root (any shared path on a cluster)."""


class ClusterConfig(_Strict):
    address: Optional[str] = None
    """Ray address to join; null starts a local Ray (RAY_ADDRESS also joins)."""
    num_gpus: Optional[int] = Field(default=None, ge=1)
    """GPUs to use; on a CPU-only machine this many logical GPUs are declared. null: all GPUs, or 2 logical."""
    num_cpus: Optional[int] = Field(default=None, ge=1)
    """CPUs for a local Ray; null: all."""
    start_deadline_s: float = Field(default=deadlines.SLOT_START_S, gt=0)
    """Deadline for one worker actor to start, seconds."""
    log_to_driver: bool = False
    """Forward worker (candidate) stdout/stderr to the driver's console."""


MAX_AUTO_LANES = 4
"""`runner.lanes: auto` never gives more lanes than this: past it a GPU's timings, not its lanes' compiles, bound it."""


MAX_AUTO_STANDBYS = 8
"""`runner.standby: auto` never keeps more warm executors than this per GPU."""


def standby_count(standby: bool | int | str, lanes: int, cpus_per_gpu: int) -> int:
    """Warm standbys of a slot with `lanes` lanes for runner.standby. auto: one per lane, and up to
    one per two of the host's CPUs per GPU (at most MAX_AUTO_STANDBYS). An executor serves one
    solution and takes seconds to start (torch, the device context, Triton's helpers: 6.25 s on
    the H200 host), while a solution's jobs there take tenths of a second, so on the H200 one standby
    left the GPU idle most of the sweep and eight hid the starts (benchmarks/RESULTS.md, section 13)."""
    if standby == "auto":
        return max(lanes, min(MAX_AUTO_STANDBYS, cpus_per_gpu // 2))
    return int(standby)  # True: 1, False: 0


def auto_lanes(lanes: int | str, cpus_per_gpu: int) -> int:
    """The lanes of a slot: `lanes` when it is a number; for `auto`, one lane per two of the host's CPUs per
    GPU (a lane's executor compiles while its supervisor thread judges), at least 1 and at most MAX_AUTO_LANES."""
    if lanes != "auto":
        return int(lanes)
    return min(MAX_AUTO_LANES, max(1, cpus_per_gpu // 2))


class RunnerConfig(_Strict):
    isolation: Literal["auto", "persistent", "isolated"] = "auto"
    """auto: persistent executors, a faulty job re-run in a fresh process; persistent: never escalate;
    isolated: a fresh process for every job."""
    quarantine_after: int = Field(default=3, ge=1)
    """Faults (hang, crash, poisoned context) before a solution is quarantined for the rest of the sweep."""
    max_attempts: int = Field(default=3, ge=1)
    """Runs of a job whose worker slot was lost (node or actor death) before it is recorded as worker_lost."""
    standby: Union[Literal["auto"], bool, Annotated[int, Field(ge=0, le=16)]] = "auto"
    """Warm standby executors per GPU, each ready to take a retired lane's place at once (an executor
    serves one solution, so each change of solution retires one; its successor starts while the
    lanes run): auto, one per lane and up to one per two CPUs per GPU (see standby_count); true,
    one; false, none; or a number."""
    spare_isolated: int = Field(default=1, ge=0)
    """Pre-warmed single-use executors per GPU for fresh-process isolation."""
    lanes: Union[Literal["auto"], Annotated[int, Field(ge=1, le=16)]] = "auto"
    """Jobs in flight per GPU, each on its own executor: their builds, trials and checks overlap on the
    GPU; timing (the candidate's and the reference's) always has the GPU to itself. auto: `auto_lanes`
    of the host's CPUs per GPU on a CPU slot, fibray.workers.spec.GPU_AUTO_LANES on a GPU (slot_lanes)."""
    prewarm: Union[Literal["auto"], bool] = "auto"
    """While a slot runs one solution's jobs, ready a standby for the solution it likely takes next: it
    builds that solution and calls it once on inputs of its own, judged by nobody, so the first call's
    costs (Triton's JIT) fall off the job's path. Kept only if it comes back as it went in. auto: on GPU
    slots (on the H200 it took 4-5 s of trials off 224 evaluations, benchmarks/RESULTS.md section 21); a
    CPU slot interprets Triton, so a warm-up there would only take cores from the jobs."""
    workdir: Optional[str] = None
    """Where slots create private executor directories; null: the system temp dir."""
    isolate_network: bool = True
    """Run candidates in a new network namespace where the OS allows it (root)."""
    drop_privileges: bool = True
    """Run each executor as a uid of its own (from uid_range; fibray must run as root). If it cannot be
    put in force the sweep refuses to start; false runs candidates with fibray's own uid (recorded per row)."""
    uid_range: Optional[list[int]] = None
    """[first, last] uids (inclusive) leased to executors, one per live executor and one per slot (the
    signaller that stops neighbours around timed windows); null: [200000, 200999]."""
    executor_checks: bool = False
    """On a GPU whose driver cannot share memory with executors (CUDA VMM with POSIX file-descriptor
    handles), let each executor stage its job's memory through host shared memory, so that outputs,
    inputs and guard bytes are verified on copies the executor made (recorded per row as
    checks=executor). False: such a GPU refuses to judge candidates."""
    fork_server: bool = True
    """Fork each executor from a warm server per slot (torch, Triton and fibray imported once; each child
    closes the server's descriptors and enters the same sandbox before any candidate code runs); false:
    each executor starts its own interpreter (seconds more per executor, and an executor per solution)."""
    memory_limit_gb: Optional[float] = Field(default=16.0, gt=0)
    """Host memory of an executor and every process it starts, together, GiB: a memory cgroup of its own,
    over which the kernel ends a process and the job fails with out_of_memory. Where none can be made,
    executors with dropped privileges are refused; without dropped privileges a CPU executor's address
    space is bounded instead, process by process (RLIMIT_AS; never under CUDA, which reserves far more
    than it uses). Null: no bound."""
    scratch_gb: Optional[float] = Field(default=1.0, gt=0)
    """All an executor may write, GiB: a memory-backed scratch of its own (its home and TMPDIR, also on
    /dev/shm); every other mount, /tmp included, is read-only to it. Null: it writes wherever its uid may (a candidate
    that fills the disk could then stop the sweep)."""
    max_open_files: int = Field(default=4096, ge=64)
    """Open-file limit of an executor."""
    max_processes: int = Field(default=4096, ge=16)
    """Process limit of an executor (per user; not enforced for root)."""


    @field_validator("uid_range")
    @classmethod
    def _validate_uid_range(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and (len(v) != 2 or not 0 < v[0] <= v[1]):
            raise ValueError("must be [first, last] with 0 < first <= last")
        return v


class SweepSection(_Strict):
    name: Name = "default"
    """Sweep name: a store partition; rerunning the same name resumes it."""
    flush_rows: int = Field(default=64, ge=1)
    """Write a Parquet file after this many new records..."""
    flush_interval_s: float = Field(default=10.0, gt=0)
    """...or after this many seconds, whichever comes first."""
    progress: bool = True
    """Show start-up phases and a progress bar (plain lines when output is not a terminal)."""
    allow_mixed_datasets: bool = False
    """Let this sweep name hold results of more than one dataset (refused by default)."""
    verbose: bool = False
    """Show Ray's own messages and fibray's debug log."""


class ServiceRef(_Strict):
    name: Optional[str] = "fibray"
    """Run on the service of this name when one is running (python -m fibray.serve); null (`service=off`):
    always start private slots."""
    state_dir: Optional[str] = None
    """Where local services leave their state files; null: $FIBRAY_STATE_DIR or ~/.cache/fibray/serve."""


class SweepConfig(_Strict):
    dataset: DatasetConfig
    solutions: SolutionsConfig = Field(default_factory=SolutionsConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    sweep: SweepSection = Field(default_factory=SweepSection)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    service: ServiceRef = Field(default_factory=ServiceRef)


def config_keys(model: type[BaseModel] = SweepConfig, prefix: str = "") -> list[str]:
    """Every valid key of the sweep configuration, dotted (`eval.iterations`), in declaration order."""
    keys = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += config_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


SECTIONS = tuple(SweepConfig.model_fields)
"""The top-level sections (dataset, solutions, ...)."""


def unknown_key_message(key: str) -> Optional[str]:
    """None for a valid key or section; else 'unknown key X (did you mean Y?)'."""
    keys = config_keys()
    if key in keys or key in SECTIONS:
        return None
    section = key.split(".", 1)[0]
    pool = [k for k in keys if k.startswith(section + ".")] if section in SECTIONS else keys
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6) or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else " (python -m fibray.sweep --help lists every key)"
    return f"unknown key {key}{hint}"


def validate_model(model: type[M], raw: dict[str, Any], what: str,
                   unknown: Callable[[str], Optional[str]] = lambda key: None) -> M:
    """Validate a plain dict (a resolved Hydra config, its `hydra` section left out) into `model`;
    ConfigError names every bad key. `unknown(key)` may explain an unknown key (None: "unknown key")."""
    raw = {k: v for k, v in raw.items() if k != "hydra"}
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                lines.append(unknown(key) or f"{key}: unknown key")
                continue
            if err["type"] == "missing":
                msg = "required key is missing"
            elif err["type"] != "value_error":
                msg = f"{msg} (got {err.get('input')!r})"
            lines.append(f"{key}: {msg}")
        if len(lines) == 1:
            raise ConfigError(f"invalid {what} configuration: {lines[0]}") from None
        raise ConfigError(f"invalid {what} configuration:\n" + "\n".join(f"  {ln}" for ln in lines)) from None


def validate_config(raw: dict[str, Any]) -> SweepConfig:
    """Validate a plain dict (the resolved Hydra config) into a SweepConfig."""
    return validate_model(SweepConfig, raw, "sweep", unknown_key_message)
