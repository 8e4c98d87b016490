"""The sweep driver: dataset -> jobs -> GPU slots -> trace store, resumable and single-writer.

The store is the ledger: jobs whose id is already recorded are skipped, so a killed
sweep resumes where it stopped. Records are buffered and published in atomic files.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fibray.dataset import Dataset, load_dataset
from fibray.schema import EvaluationStatus, Job, JobResult
from fibray.store import TraceStore, to_row
from fibray.sweep.config import ConfigError, SweepConfig
from fibray.evaluate.phases import top_level

if TYPE_CHECKING:
    from fibray.sweep.pool import PoolOptions

log = logging.getLogger(__name__)


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


class Progress:
    """A one-line progress report with counts per status."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.counts: Counter[str] = Counter()
        self.t0 = self._last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, status: str) -> None:
        self.counts[status] += 1
        now = time.monotonic()
        done = sum(self.counts.values())
        if self.enabled and (self.tty or now - self._last > 5 or done == self.total):
            self._last = now
            self._print(done, now)

    def _print(self, done: int, now: float) -> None:
        rate = done / max(now - self.t0, 1e-9)
        counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        line = f"[{done}/{self.total}] {rate:.1f} eval/s  {counts}"
        print(("\r" + line + "\x1b[K") if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and self.counts:
            print(file=sys.stderr)


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
    """Buffers rows and publishes them to the store by size or age."""

    def __init__(self, store: TraceStore, flush_rows: int, flush_interval_s: float) -> None:
        self.store, self.flush_rows, self.flush_interval_s = store, flush_rows, flush_interval_s
        self.buffer: list[dict] = []
        self.seen: set[str] = set()
        self.files: list[Path] = []
        self._last = time.monotonic()

    def add(self, job: Job, result: JobResult) -> bool:
        if job.job_id in self.seen:
            return False
        self.seen.add(job.job_id)
        self.buffer.append(to_row(job, result))
        if len(self.buffer) >= self.flush_rows or time.monotonic() - self._last > self.flush_interval_s:
            self.flush()
        return True

    def flush(self) -> None:
        if self.buffer:
            self.files.extend(self.store.append(self.buffer))
            self.buffer = []
        self._last = time.monotonic()


def init_ray(cfg: SweepConfig) -> tuple[int, bool]:
    """Start or join Ray; returns (GPU slots to use, whether we started Ray)."""
    import ray

    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    started = False
    if ray.is_initialized():
        pass
    elif address:
        ray.init(address=address, log_to_driver=cfg.cluster.log_to_driver)
    else:
        from fibray.workers.start import visible_gpu_count

        real = visible_gpu_count()  # not torch: importing it here would delay Ray's start by seconds
        if real and cfg.cluster.num_gpus and cfg.cluster.num_gpus > real:
            raise ConfigError(f"cluster.num_gpus: {cfg.cluster.num_gpus} requested but this machine has {real} GPU(s)")
        gpus = (cfg.cluster.num_gpus or real) if real else (cfg.cluster.num_gpus or 2)
        ray.init(address="local", num_gpus=gpus, num_cpus=cfg.cluster.num_cpus, include_dashboard=False,
                 log_to_driver=cfg.cluster.log_to_driver, configure_logging=False)
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
    task = ray.remote(num_cpus=1)(compile_ahead)
    refs = [task.remote(s, str(cache), deadline) for s in solutions.values()]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=deadline + 120)
    failed = sum(1 for r in done if ray.get(r) is not None)
    log.info("compiled %d CUDA/C++ solutions ahead on CPU workers (%d failed, %d still compiling)",
             len(done), failed, len(pending))
    return str(cache)


def pool_options(cfg: SweepConfig, slots: int, cpus: int, build_cache: Optional[str]) -> PoolOptions:
    """The worker pool's options from the runner and cluster sections (sweeps and the agent loop share them)."""
    from fibray.sweep.pool import PoolOptions

    r = cfg.runner
    return PoolOptions(
        num_slots=slots, torch_threads=max(1, cpus // slots), start_deadline_s=cfg.cluster.start_deadline_s,
        isolation=r.isolation, quarantine_after=r.quarantine_after, max_attempts=r.max_attempts,
        standby=r.standby, spare_isolated=r.spare_isolated, lanes=r.lanes, workdir=r.workdir,
        sandbox={"isolate_network": r.isolate_network, "drop_privileges": r.drop_privileges,
                 "memory_limit_bytes": int(r.memory_limit_gb * (1 << 30)) if r.memory_limit_gb else None,
                 "max_open_files": r.max_open_files, "max_processes": r.max_processes,
                 "build_cache": build_cache},
    )


def run_sweep(cfg: SweepConfig) -> SweepReport:
    """Run (or resume) a sweep to completion and return what it did."""
    from fibray.sweep.pool import WorkerPool

    t0 = time.monotonic()
    ds = load_dataset(
        cfg.dataset.root, definitions=cfg.dataset.definitions, solution_roots=cfg.solutions.roots,
        solutions=cfg.solutions.names, workload_set=cfg.dataset.workload_set,
        max_workloads_per_definition=cfg.dataset.max_workloads_per_definition, split=cfg.dataset.split,
    )
    jobs = make_jobs(ds, cfg)
    store = TraceStore(cfg.store.root)
    with store.lock(cfg.sweep.name):
        done = store.job_ids(cfg.sweep.name)
        salt = store.sweep_salt(cfg.sweep.name)  # inputs no candidate can predict; the same on a resume
        todo = [j.salted(salt) for j in jobs if j.job_id not in done]
        log.info("sweep %s: %d definitions, %d solutions, %d jobs, %d already recorded",
                 cfg.sweep.name, len(ds.definitions), len(ds.solutions), len(jobs), len(jobs) - len(todo))
        report = SweepReport(cfg.sweep.name, len(jobs), len(jobs) - len(todo), 0)
        if not todo:
            report.wall_s = time.monotonic() - t0
            return report
        import ray

        slots, started = init_ray(cfg)
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        r = cfg.runner
        build_cache = compile_ahead_on_cpus(todo, cfg)
        pool = WorkerPool(pool_options(cfg, slots, cpus, build_cache))
        recorder = _Recorder(store, cfg.sweep.flush_rows, cfg.sweep.flush_interval_s)
        progress = Progress(len(todo), cfg.sweep.progress)

        def on_result(job: Job, result: JobResult) -> None:
            if recorder.add(job, result):
                progress.update(result.evaluation.status.value)
                for name, seconds in result.phases.items():
                    report.phases[name] = report.phases.get(name, 0.0) + seconds

        report.slots, report.lanes, report.setup_s = slots, r.lanes, time.monotonic() - t0
        try:
            pool.run(todo, on_result)
            first = pool.first_dispatch if pool.first_dispatch is not None else time.monotonic()
            report.start_s, report.run_s = first - t0 - report.setup_s, time.monotonic() - first
            report.slot_stats = pool.slot_stats()
        finally:
            recorder.flush()
            progress.close()
            pool.shutdown()
            if started:
                ray.shutdown()
        report.recorded = len(recorder.seen)
        report.counts = dict(progress.counts)
        report.files = recorder.files
        report.wall_s = time.monotonic() - t0
        return report


def summary_rows(store: TraceStore, sweep: str, splits: Optional[tuple[str, ...]] = ("public",)) -> list[dict]:
    """Per (definition, solution): passed/total and geomean speedup over passed workloads.

    This is feedback (what a sweep tells the candidates' authors), so by default it counts
    public workloads only (rows from before splits count as public); splits=None counts all.
    """
    table = store.read(sweep=sweep, columns=["definition", "solution", "author", "language", "status", "speedup",
                                             "latency_ms", "split"])
    groups: dict[tuple[str, str], dict] = {}
    for r in table.to_pylist():
        if splits is not None and (r["split"] or "public") not in splits:
            continue
        g = groups.setdefault((r["definition"], r["solution"]), {
            "definition": r["definition"], "solution": r["solution"], "author": r["author"],
            "language": r["language"], "passed": 0, "total": 0, "_logs": [], "statuses": Counter()})
        g["total"] += 1
        g["statuses"][r["status"]] += 1
        if r["status"] == EvaluationStatus.PASSED.value:
            g["passed"] += 1
            if r["speedup"]:
                g["_logs"].append(math.log(r["speedup"]))
    out = []
    for key in sorted(groups):
        g = groups[key]
        logs = g.pop("_logs")
        g["geomean_speedup"] = math.exp(sum(logs) / len(logs)) if logs else None
        g["statuses"] = dict(g["statuses"])
        out.append(g)
    return out


def format_summary(rows: list[dict]) -> str:
    """The summary table as aligned text."""
    header = ("definition", "solution", "author", "lang", "passed", "geomean_speedup", "statuses")
    body = [(
        r["definition"], r["solution"], r["author"], r["language"], f"{r['passed']}/{r['total']}",
        f"{r['geomean_speedup']:.3f}x" if r["geomean_speedup"] else "-",
        ", ".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items())),
    ) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*b) for b in body)])
