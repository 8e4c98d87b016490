"""The sweep driver: dataset -> jobs -> GPU slots -> trace store, resumable and single-writer.

The store is the ledger: jobs whose id is already recorded are skipped, so a killed
sweep resumes where it stopped. Records are buffered and published in atomic files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

from fibray import deadlines
from fibray.dataset import Dataset, DatasetError, load_dataset
from fibray.schema import Definition, Job, JobResult, Solution
from fibray.store import StoreError, TraceStore, to_row
from fibray.sweep.config import ConfigError, SweepConfig
from fibray.sweep.console import Progress, quiet_ray
from fibray.sweep.reuse import known_references
from fibray.sweep.summary import format_summary, summary_rows  # noqa: F401  (their old home)
from fibray.evaluate.phases import now_iso, top_level

if TYPE_CHECKING:
    from fibray.sweep.pool import PoolOptions

log = logging.getLogger(__name__)

REFERENCE_AUTHOR = "reference"
"""Author of the reference candidates that `solutions.include_reference` adds."""


def reference_solution(definition: Definition) -> Solution:
    """The definition's reference as a candidate: `<definition>_reference` by author `reference`."""
    return Solution.model_validate({
        "name": f"{definition.name}_reference", "definition": definition.name, "author": REFERENCE_AUTHOR,
        "spec": {"language": "python", "target_hardware": ["cuda", "cpu"], "entry_point": "main.py::run",
                 "destination_passing_style": False},
        "sources": [{"path": "main.py", "content": definition.reference}],
        "description": "The definition's reference, evaluated as a candidate (solutions.include_reference).",
    })


def add_references(ds: Dataset) -> list[str]:
    """Add each selected definition's reference to the dataset's solutions; returns the names added
    (a solution already named `<definition>_reference` is kept and not replaced)."""
    added = []
    for definition in ds.definitions.values():
        sol = reference_solution(definition)
        if sol.name not in ds.solutions:
            ds.solutions[sol.name] = sol
            added.append(sol.name)
    return added


def unsolved_definitions(ds: Dataset) -> list[str]:
    """Selected definitions that have workloads but no solution to evaluate."""
    return [name for name in ds.definitions if ds.workloads.get(name) and not ds.solutions_for(name)]


def make_jobs(ds: Dataset, cfg: SweepConfig) -> list[Job]:
    """Every (workload, solution) pair of every selected definition, in workload order."""
    jobs = []
    for name, definition in ds.definitions.items():
        solutions = ds.solutions_for(name)
        for workload in ds.workloads.get(name, []):
            for sol in solutions:
                jobs.append(Job(
                    job_id=Job.make_id(definition, workload, sol, cfg.eval), sweep=cfg.sweep.name,
                    definition=definition, workload=workload, solution=sol, settings=cfg.eval,
                    dataset_root=str(ds.root.resolve()), split=ds.split_of(workload.uuid),
                ))
    return jobs


def check_one_dataset(store: TraceStore, cfg: SweepConfig, ds: Dataset) -> None:
    """Refuse to add this dataset's results to a sweep that holds another dataset's (by content hash)."""
    if cfg.sweep.allow_mixed_datasets:
        return
    table = store.read(sweep=cfg.sweep.name, columns=["dataset_name", "dataset_hash"])
    others = sorted({(n or "?", h) for n, h in zip(table.column("dataset_name").to_pylist(),
                                                  table.column("dataset_hash").to_pylist()) if h and h != ds.hash})
    if others:
        held = ", ".join(f"{n!r} ({h[:12]})" for n, h in others)
        raise StoreError(f"sweep.name: sweep {cfg.sweep.name!r} in {store.root} holds results of dataset {held}, not of "
                         f"{ds.name!r} ({ds.hash[:12]}) at {ds.root}; choose another sweep.name, or set "
                         f"sweep.allow_mixed_datasets=true to mix them")


class SweepInterrupted(KeyboardInterrupt):
    """The sweep was interrupted (Ctrl-C); what was recorded is saved and a rerun resumes."""

    def __init__(self, sweep: str, saved: int, total_saved: int, total_jobs: int, store: Path) -> None:
        super().__init__(sweep)
        self.sweep, self.saved, self.total_saved, self.total_jobs, self.store = sweep, saved, total_saved, total_jobs, store


@dataclass
class SweepReport:
    """What a sweep run did."""

    sweep: str
    total_jobs: int
    skipped: int
    recorded: int
    counts: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    files: list[Path] = field(default_factory=list)
    slot_stats: list[dict] = field(default_factory=list)
    slots: int = 0
    lanes: int = 1
    """Jobs in flight per slot."""
    privileges_dropped: bool = True
    """Executors ran as uids of their own (False only with an explicit runner.drop_privileges=false)."""
    setup_s: float = 0.0
    """Loading the dataset, starting Ray and compiling ahead, before the first job."""
    start_s: float = 0.0
    """Slots starting, until the first job was sent."""
    run_s: float = 0.0
    """First job sent to last result."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per job phase, summed over the jobs this run evaluated (JobResult.phases)."""

    def time_breakdown(self) -> str:
        """Where the slots' time went: job phases, and the rest (slot start-up, dispatch, idle)."""
        capacity = self.slots * self.lanes * self.run_s
        if capacity <= 0:
            return "no jobs ran"
        parts = sorted(((k, v) for k, v in self.phases.items() if "." not in k), key=lambda kv: -kv[1])
        rest = max(0.0, capacity - top_level(self.phases))
        cells = []
        for k, v in parts:
            inner = sorted(((n.split(".", 1)[1], s) for n, s in self.phases.items() if n.startswith(k + ".")),
                           key=lambda kv: -kv[1])
            within = f" [{', '.join(f'{n} {s:.2f}s' for n, s in inner)}]" if inner else ""
            cells.append(f"{k} {v:.2f}s ({100 * v / capacity:.0f}%){within}")
        cells.append(f"dispatch/idle {rest:.2f}s ({100 * rest / capacity:.0f}%)")
        lanes = f"{self.lanes} lane(s) x " if self.lanes > 1 else ""
        return (f"setup {self.setup_s:.1f}s, slot start-up {self.start_s:.1f}s; jobs: {self.slots} slot(s) x {lanes}"
                f"{self.run_s:.1f}s = {capacity:.1f} {'lane' if self.lanes > 1 else 'slot'}-s: " + ", ".join(cells))


class _Recorder:
    """Buffers rows and publishes them to the store by size or age. A row leaves the buffer and is counted in
    `published` exactly when its file is published, inside `shield` (a Ctrl-C there is deferred to the next
    check), so an interrupted or failed flush neither loses a row nor writes one twice."""

    def __init__(self, store: TraceStore, flush_rows: int, flush_interval_s: float, ds: Dataset,
                 shield: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.store, self.flush_rows, self.flush_interval_s, self.shield = store, flush_rows, flush_interval_s, shield
        self.dataset = (ds.name, ds.hash)
        self.published = 0
        """Rows already in published files."""
        self.buffer: list[dict] = []
        self.seen: set[str] = set()
        self.files: list[Path] = []
        self._last = time.monotonic()

    def add(self, job: Job, result: JobResult) -> bool:
        if job.job_id in self.seen:
            return False
        result = result.model_copy(update={"finished_at": now_iso()})  # the driver's clock, not a slot's
        row = to_row(job, result, dataset_name=self.dataset[0], dataset_hash=self.dataset[1])
        with self.shield():
            self.seen.add(job.job_id)
            self.buffer.append(row)
        if len(self.buffer) >= self.flush_rows or time.monotonic() - self._last > self.flush_interval_s:
            self.flush()
        return True

    def flush(self) -> None:
        """Publish the buffer one partition at a time (the store writes one file per partition)."""
        while self.buffer:
            key = (self.buffer[0]["definition"], self.buffer[0]["sweep"])
            group = [r for r in self.buffer if (r["definition"], r["sweep"]) == key]
            with self.shield():
                self.files.extend(self.store.append(group))
                self.published += len(group)
                self.buffer = [r for r in self.buffer if (r["definition"], r["sweep"]) != key]
        self._last = time.monotonic()


class ClusterError(RuntimeError):
    """Ray could not be started or joined; the message says which and why, in one line."""


RAY_START_TRIES = 2
"""Tries to start a local Ray: its node gives up after a fixed 30 s, which a busy machine can exceed."""


def _ray_init(what: str, tries: int = 1, **kwargs: object) -> None:
    import ray

    for attempt in range(1, tries + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception when its node times out starting
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if attempt < tries and "timed out during startup" in first:
                log.warning("%s did not start in time (a busy machine?); trying again", what)
                ray.shutdown()
                continue
            hint = " (a busy machine: retry, or start one with `ray start --head` and pass cluster=ray)" \
                if "timed out" in first else ""
            raise ClusterError(f"cluster: {what} did not start: {first}{hint}") from None


def init_ray(cfg: SweepConfig, verbose: Optional[bool] = None) -> tuple[int, bool]:
    """Start or join Ray; returns (GPU slots to use, whether we started Ray). Only `cfg.cluster` is read,
    and `cfg.sweep.verbose` unless `verbose` is given (the agent loop's config has no sweep section)."""
    import ray

    quiet = not ((cfg.sweep.verbose if verbose is None else verbose) or cfg.cluster.log_to_driver)
    quiet_ray(quiet)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    started = False
    if ray.is_initialized():
        pass
    elif address:
        log.info("joining the Ray cluster at %s ...", address)
        _ray_init(address, address=address, log_to_driver=cfg.cluster.log_to_driver, configure_logging=not quiet)
    else:
        from fibray.workers.start import visible_gpu_count

        real = visible_gpu_count()  # not torch: importing it here would delay Ray's start by seconds
        if real and cfg.cluster.num_gpus and cfg.cluster.num_gpus > real:
            raise ConfigError(f"cluster.num_gpus: {cfg.cluster.num_gpus} requested but this machine has {real} GPU(s)")
        gpus = (cfg.cluster.num_gpus or real) if real else (cfg.cluster.num_gpus or 2)
        log.info("starting a local Ray (%d %sGPU(s)) ...", gpus, "" if real else "logical ")
        _ray_init("a local Ray", tries=RAY_START_TRIES, address="local", num_gpus=gpus, num_cpus=cfg.cluster.num_cpus,
                  include_dashboard=False, log_to_driver=cfg.cluster.log_to_driver, configure_logging=False)
        started = True
    available = int(ray.cluster_resources().get("GPU", 0))
    if available < 1:
        raise ConfigError(f"cluster: the Ray cluster at {address or 'local'} has no GPU resources (declare cluster.num_gpus)")
    slots = min(available, cfg.cluster.num_gpus) if cfg.cluster.num_gpus else available
    return slots, started


def compile_ahead_on_cpus(todo: list[Job], cfg: SweepConfig) -> Optional[str]:
    """Compile CUDA/C++ solutions in CPU Ray tasks before any GPU sees them; returns the shared
    artifact cache the executors should use (None: each slot keeps its own)."""
    import ray

    from fibray.compile.cache import compile_ahead
    from fibray.workers.process.compile_jail import compile_jail
    from fibray.workers.process.sandbox import world_executable

    solutions = {j.solution.hash: j.solution for j in todo if j.solution.spec.language.value in ("cuda", "cpp")}
    cache = Path(cfg.store.root).resolve() / "_builds"
    if not solutions:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    if not world_executable(str(cache.parent)):
        log.warning("store root %s is not reachable by unprivileged executors; builds are not shared", cache.parent)
        return None
    deadline = cfg.eval.build_deadline_s
    log.info("compiling %d CUDA/C++ solution(s) ahead on CPU workers ...", len(solutions))
    task = ray.remote(num_cpus=1)(compile_ahead)
    jail = compile_jail(cfg.runner.drop_privileges, cfg.runner.uid_range)  # the compiler reads what any user may
    refs = [task.remote(s, str(cache), deadline, jail) for s in solutions.values()]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=deadline + deadlines.COMPILE_AHEAD_GRACE_S)
    failed = sum(1 for r in done if ray.get(r) is not None)
    log.info("compiled %d CUDA/C++ solutions ahead on CPU workers (%d failed, %d still compiling)",
             len(done), failed, len(pending))
    return str(cache)


def pool_options(cfg: SweepConfig, slots: int, cpus: int, build_cache: Optional[str],
                 workdir: Optional[str] = None) -> PoolOptions:
    """The worker pool's options from the runner and cluster sections (sweeps and the agent loop share them);
    `workdir` overrides runner.workdir."""
    from fibray.sweep.pool import PoolOptions

    return PoolOptions.from_runner(cfg.runner, num_slots=slots, torch_threads=max(1, cpus // slots),
                                   start_deadline_s=cfg.cluster.start_deadline_s, build_cache=build_cache,
                                   workdir=workdir)



def load_sweep_dataset(cfg: SweepConfig) -> Dataset:
    """The dataset as the config selects it, with the references added when asked; definitions
    without a workload (in the selected set and split) or a solution are a warning, and none
    with one at all is an error."""
    log.info("loading dataset %s ...", cfg.dataset.root)
    ds = load_dataset(
        cfg.dataset.root, definitions=cfg.dataset.definitions, solution_roots=cfg.solutions.roots,
        solutions=cfg.solutions.names, workload_set=cfg.dataset.workload_set,
        max_workloads_per_definition=cfg.dataset.max_workloads_per_definition, split=cfg.dataset.split,
    )
    if cfg.solutions.include_reference:
        add_references(ds)
    empty = [name for name in ds.definitions if not ds.workloads.get(name)]
    if empty:
        where = ds.root / "workloads" / (cfg.dataset.workload_set or "")
        split = f" of split {cfg.dataset.split}" if cfg.dataset.split != "all" else ""
        hint = " (dataset.workload_set=null reads every set)" if cfg.dataset.workload_set else ""
        msg = (f"no workloads{split} in {where}/ for {len(empty)} selected definition(s), which get no jobs: "
               f"{', '.join(empty)}{hint}")
        if len(empty) == len(ds.definitions):
            raise DatasetError(f"{'dataset.workload_set' if cfg.dataset.workload_set else 'dataset.root'}: {msg}")
        log.warning("%s", msg)
    unsolved = unsolved_definitions(ds)
    hint = ("set solutions.include_reference=true to evaluate each definition's reference, or name a folder of "
            "solutions with solutions.roots=[DIR]")
    if unsolved and len(unsolved) == sum(1 for n in ds.definitions if ds.workloads.get(n)):
        raise DatasetError(f"solutions: no solution for any selected definition of {ds.root} "
                           f"({', '.join(unsolved)}); {hint}")
    if unsolved:
        log.warning("no solutions for %d definition(s), which get no jobs: %s (%s)", len(unsolved), ", ".join(unsolved), hint)
    return ds


def _make_workdir(cfg: SweepConfig, started_ray: bool) -> tuple[Optional[str], Optional[str]]:
    """(where the slots make their private directories, a folder to remove when the sweep ends).

    For a Ray of our own that is one temporary folder, removed at the end (also on error or Ctrl-C);
    otherwise runner.workdir as given (None: the slots' own default)."""
    if cfg.runner.workdir or not started_ray:
        return cfg.runner.workdir, None
    path = tempfile.mkdtemp(prefix=f"fibray-sweep-{cfg.sweep.name}-")
    os.chmod(path, 0o755)  # unprivileged executors reach their directories through it
    return path, path


class _Interrupts:
    """Ctrl-C that cannot be lost: the handler notes it before raising KeyboardInterrupt, so one raised where
    Python swallows exceptions (a fork hook while Ray starts its processes, a finaliser) still ends the sweep
    at the next check."""

    def __init__(self) -> None:
        self.seen = False
        self._shielded = 0

    def handler(self, signum: int, frame: object) -> None:
        self.seen = True
        if not self._shielded:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def shielded(self):
        """A Ctrl-C inside is noted, not raised: the next check() raises it (a file published and counted as one)."""
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    def _unraisable(self, info) -> None:
        if not (self.seen and isinstance(info.exc_value, KeyboardInterrupt)):  # that one is noted, not lost
            self._hook(info)

    @contextlib.contextmanager
    def kept(self):
        try:
            previous = signal.signal(signal.SIGINT, self.handler)
        except ValueError:  # not the main thread: signals reach the main thread's handler only
            yield self
            return
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        try:
            yield self
        finally:
            if sys.unraisablehook == self._unraisable:
                sys.unraisablehook = self._hook
            if signal.getsignal(signal.SIGINT) == self.handler:
                signal.signal(signal.SIGINT, previous)


def _second_interrupt(signum: int, frame: object) -> None:
    print("\nfibray.sweep: interrupted again; exiting without waiting for the slots to stop", flush=True)
    os._exit(130)


def run_sweep(cfg: SweepConfig) -> SweepReport:
    """Run (or resume) a sweep to completion and return what it did.

    Ctrl-C (KeyboardInterrupt) publishes what was recorded, stops the slots and Ray, and raises
    SweepInterrupted with the counts; a second Ctrl-C exits at once.
    """
    from fibray.sweep.service import auth_kept

    with auth_kept():  # joining a service sets Ray's auth mode; the process gets its own back
        return _run_sweep(cfg)


def _run_sweep(cfg: SweepConfig) -> SweepReport:
    t0 = time.monotonic()
    ds = load_sweep_dataset(cfg)
    jobs = make_jobs(ds, cfg)
    if cfg.service.name:  # before anything imports Ray, which reads its auth mode once
        from fibray.sweep.service import prepare_auth

        prepare_auth(cfg.service.name, cfg.cluster.address, cfg.service.state_dir)
    store = TraceStore(cfg.store.root)
    with store.lock(cfg.sweep.name):
        check_one_dataset(store, cfg, ds)
        done = store.job_ids(cfg.sweep.name)
        salt = store.sweep_salt(cfg.sweep.name)  # inputs no candidate can predict; the same on a resume
        todo = [j.salted(salt) for j in jobs if j.job_id not in done]
        todo = known_references(store, todo, ds.hash)  # no reference timed twice (issue 15.2)
        log.info("sweep %s: dataset %s (%s), %d definitions, %d solutions, %d jobs, %d already recorded",
                 cfg.sweep.name, ds.name, ds.hash[:12], len(ds.definitions), len(ds.solutions), len(jobs),
                 len(jobs) - len(todo))
        report = SweepReport(cfg.sweep.name, len(jobs), len(jobs) - len(todo), 0,
                             privileges_dropped=cfg.runner.drop_privileges)
        if not todo:
            report.wall_s = time.monotonic() - t0
            return report
        from fibray.workers.process.sandbox import preflight

        from fibray.sweep.pool import PoolOptions

        problem = preflight(PoolOptions.from_runner(cfg.runner, num_slots=1).sandbox, cfg.store.root, cfg.runner.workdir)
        if problem is not None:
            raise ConfigError(problem)  # fails closed: no candidate runs with more privilege than asked
        if not cfg.runner.drop_privileges:
            log.warning("runner.drop_privileges=false: candidates run as uid %d, like fibray itself", os.geteuid())
        interrupts = _Interrupts()
        recorder = _Recorder(store, cfg.sweep.flush_rows, cfg.sweep.flush_interval_s, ds, interrupts.shielded)
        try:
            with interrupts.kept():
                _run(cfg, todo, report, recorder, t0, interrupts)
        except KeyboardInterrupt:
            raise SweepInterrupted(cfg.sweep.name, recorder.published, len(done) + recorder.published, len(jobs),
                                   store.root.resolve()) from None
        return report


def _service(cfg: SweepConfig):
    """The running service this sweep should use (cfg.service.name), or None: start private slots."""
    if not cfg.service.name:
        return None
    from fibray.sweep.service import attach_service  # the service is optional; most sweeps never load it

    return attach_service(cfg.service.name, cfg.cluster.address, cfg.service.state_dir, cfg.cluster.log_to_driver)


def _run(cfg: SweepConfig, todo: list[Job], report: SweepReport, recorder: _Recorder, t0: float,
         interrupts: _Interrupts) -> None:
    service = _service(cfg)  # a running fibray.serve: its warm slots take the jobs, this driver records
    import ray  # after _service, which may set the auth mode Ray reads at import

    from fibray.sweep.pool import WorkerPool, WorkerStartError

    started, pool, progress, remove, previous = False, None, None, None, None
    try:
        slots, started = (service.num_slots, service.joined) if service else init_ray(cfg)
        interrupts.check()
        workdir, remove = (None, None) if service else _make_workdir(cfg, started)
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        r = cfg.runner
        build_cache = None if service else compile_ahead_on_cpus(todo, cfg)
        interrupts.check()
        pool = service or WorkerPool(pool_options(cfg, slots, cpus, build_cache, workdir=workdir))
        interrupts.check()
        log.info("starting %d GPU slot(s) (executors, torch, warm standby) ...", slots)
        progress = Progress(len(todo), cfg.sweep.progress)

        def on_result(job: Job, result: JobResult) -> None:
            if recorder.add(job, result):
                progress.update(result.evaluation.status.value)
                for name, seconds in result.phases.items():
                    report.phases[name] = report.phases.get(name, 0.0) + seconds
            interrupts.check()  # after recording: the result is kept

        report.slots, report.lanes, report.setup_s = slots, service.lanes if service else pool.opt.lanes, time.monotonic() - t0
        pool.run(todo, on_result)
        interrupts.check()
        first = pool.first_dispatch if pool.first_dispatch is not None else time.monotonic()
        report.start_s, report.run_s = first - t0 - report.setup_s, time.monotonic() - first
        report.slot_stats = pool.slot_stats()
        if not service:
            report.lanes = pool.lanes()
    except WorkerStartError as e:
        raise ClusterError(str(e)) from None
    except KeyboardInterrupt:
        with contextlib.suppress(ValueError):  # not the main thread: no handler to change
            previous = signal.signal(signal.SIGINT, _second_interrupt)  # cleaning up; a second Ctrl-C leaves at once
        raise
    finally:
        recorder.flush()
        if progress is not None:
            progress.close()
        try:
            # After Ctrl-C, Ray's own processes (same process group) may be gone already: stopping is best effort.
            with contextlib.suppress(Exception) if previous is not None else contextlib.nullcontext():
                try:
                    if pool is not None:
                        pool.shutdown()
                finally:
                    if started:
                        ray.shutdown()
        finally:
            if remove:
                shutil.rmtree(remove, ignore_errors=True)
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
    report.recorded = len(recorder.seen)
    report.counts = dict(progress.counts)
    report.files = recorder.files
    report.wall_s = time.monotonic() - t0
