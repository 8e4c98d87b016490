"""The sanitizer gate: compute-sanitizer memcheck, racecheck, initcheck and synccheck on every workload.

Each (tool, workload) runs in its own process: the executor sandbox's launcher (limits, no
network, a leased uid of its own where fibray runs as root; the gate is not_run when that
cannot be put in force), then `compute-sanitizer --tool X
--error-exitcode 86`, then fibray.promote.sanitize_runner, with its own deadline and its
process group killed when it passes. Where there is no GPU, no compute-sanitizer, or one that
refuses this device (a probe that must run clean), every tool is `not_run`, never passed.
initcheck sees global memory only: a read of shared memory no thread wrote is the
fibray.promote.smem_poison gate's, which starts its runs through run_many here, bare.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fibray.promote.sanitize_runner import RUNNER_FAILED, SanitizeJob
from fibray.store.promotions import SANITIZER_GATES, Gate, Outcome
from fibray.workers.process.sandbox import SandboxPolicy

if TYPE_CHECKING:
    from fibray.workers.process.cgroup import ExecutorCgroup

SANITIZER_ENV = "FIBRAY_COMPUTE_SANITIZER"
"""Path of the compute-sanitizer executable, when it is not on PATH or under CUDA_HOME/bin."""
ERROR_EXITCODE = 86
"""`--error-exitcode`: compute-sanitizer exits with this when its tool reported an error."""
DEADLINE_S = 600.0
"""Default deadline of one (tool, workload) run: sanitizers slow kernels 10-100x and torch starts slowly."""
PROBE_DEADLINE_S = 300.0
"""Deadline of the probe that proves the sanitizer works on this device."""
TAIL_CHARS = 6000
"""Output kept per run in the evidence."""
RUNNER = "fibray.promote.sanitize_runner"
"""The module run_tool starts (`python -m RUNNER JOB.json`) unless told another."""
_PROBE = "import torch; x = torch.ones(8, device='cuda'); torch.cuda.synchronize(); print('probe', float(x.sum()))"


@dataclass
class ToolRun:
    """One tool on one workload."""

    tool: str
    workload: str
    outcome: str
    """clean, flagged (the tool reported errors), runner_failed (the candidate raised), timeout,
    out_of_memory (the kernel ended a process of the run at its memory bound), error."""
    returncode: int | None
    errors: int | None
    """Errors the tool's summary line counted."""
    wall_s: float
    tail: str = field(repr=False, default="")
    found: Any = None
    """What run_tool's `inspect` made of the run's work dir before it was removed (None without one)."""


@dataclass
class GateResult:
    """The verdict of one gate for one artifact."""

    gate: Gate
    outcome: Outcome
    reason: str = ""
    evidence: dict = field(default_factory=dict)


def find_sanitizer() -> str | None:
    """The compute-sanitizer executable: $FIBRAY_COMPUTE_SANITIZER, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin."""
    if os.environ.get(SANITIZER_ENV):
        path = os.environ[SANITIZER_ENV]
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(Path(home) / "bin" / "compute-sanitizer", os.X_OK):
            return str(Path(home) / "bin" / "compute-sanitizer")
    return None


def unavailable(deadline_s: float = PROBE_DEADLINE_S) -> tuple[str | None, str | None]:
    """(executable, None) when the sanitizer works here, else (None, why not)."""
    from fibray.workers.start import visible_gpu_count

    exe = find_sanitizer()
    if exe is None:
        return None, f"compute-sanitizer not found (${SANITIZER_ENV}, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"
    if visible_gpu_count() == 0:
        return None, "no GPU visible to this process (NVML counts none)"
    workdir = Path(tempfile.mkdtemp(prefix="fibray-probe-"))
    try:
        run = _run([exe, "--tool", "memcheck", "--error-exitcode", str(ERROR_EXITCODE), sys.executable, "-c", _PROBE],
                   tool="memcheck", workload="probe", deadline_s=deadline_s, workdir=workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if run.outcome != "clean" or "probe 8.0" not in run.tail:
        last = " | ".join(line.strip() for line in run.tail.strip().splitlines()[-4:])
        return None, f"compute-sanitizer does not work on this device ({run.outcome}, exit {run.returncode}): {last}"
    return exe, None


def _errors(text: str) -> int | None:
    for line in reversed(text.splitlines()):
        if "ERROR SUMMARY:" in line:
            try:
                return int(line.split("ERROR SUMMARY:", 1)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def _run(argv: list[str], *, tool: str, workload: str, deadline_s: float, workdir: Path,
         policy: SandboxPolicy | None = None, build_cache: str | None = None) -> ToolRun:
    """Run argv in its own session (with a policy: through the executor launcher, as a leased uid of
    its own when the policy drops privileges, in a memory cgroup of its own when it bounds memory);
    kill its group, its uid's and its cgroup's processes at the end."""
    from fibray.workers.process.launch import sandbox_argv
    from fibray.workers.process.sandbox import kill_tree, network_namespaces_available, scrubbed_env, uid_pool

    env = scrubbed_env({"HOME": str(workdir), "TMPDIR": str(workdir), "PYTHONUNBUFFERED": "1",
                        "PYTHONDONTWRITEBYTECODE": "1", "TRITON_CACHE_DIR": str(workdir / "triton")})
    if build_cache:  # compiled CUDA/C++ artifacts, shared by the runs of one gate (compiled once)
        env["FIBRAY_BUILD_CACHE"] = build_cache
    lease = cgroup = None
    if policy is not None:
        # one cudaMalloc per tensor: inside torch's caching pool a write past a tensor's end lands in
        # memory the pool owns, where memcheck cannot see it, and reused blocks look initialised
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        lease = uid_pool(policy).lease() if policy.drop_privileges else None
        if lease is not None:
            for p in (workdir, *workdir.iterdir()):
                os.chown(p, lease.uid, lease.uid)
        cgroup = _memory_cgroup(policy)  # the run and all it starts: policy.memory_limit_bytes of host memory
        argv = [*sandbox_argv(max_open_files=policy.max_open_files, max_processes=policy.max_processes,
                              memory_limit_bytes=None, cpu_seconds=None,
                              netns=policy.isolate_network and network_namespaces_available(),
                              uid=lease.uid if lease else None,
                              cgroup=cgroup.procs_files if cgroup is not None else None), *argv]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=deadline_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid, proc.pid)
            out, _ = proc.communicate()
            timed_out = True
        finally:
            kill_tree(proc.pid, proc.pid)  # whatever the candidate left behind in its group
    finally:
        if lease is not None:
            lease.release()  # kills anything still running as its uid
        oom_kills = _end(cgroup) if cgroup is not None else 0
    text = out.decode(errors="replace")
    rc = proc.returncode
    if oom_kills:
        outcome = "out_of_memory"
        text += (f"\n[fibray] the run and the processes it started went over their host memory bound of "
                 f"{cgroup.memory_limit / (1 << 30):g} GiB (--memory-limit-gb): the kernel ended {oom_kills} of them\n")
    elif timed_out:
        outcome = "timeout"
    elif rc == 0:
        outcome = "clean"
    elif rc == ERROR_EXITCODE:
        outcome = "flagged"
    elif rc == RUNNER_FAILED:
        outcome = "runner_failed"
    else:
        outcome = "error"
    return ToolRun(tool, workload, outcome, None if timed_out else rc, _errors(text), round(time.monotonic() - t0, 2),
                   text[-TAIL_CHARS:])


def _memory_cgroup(policy: SandboxPolicy) -> ExecutorCgroup | None:
    """The run's memory cgroup, bounded as `policy` asks (None: no bound asked, or none possible and
    none required: fibray's own privileges, as an executor's). Fails closed like the sweep's executors."""
    from fibray.workers.process.cgroup import ExecutorCgroup

    if not policy.memory_limit_bytes:
        return None
    cgroup = ExecutorCgroup.create(cpu=False, memory_bytes=policy.memory_limit_bytes)
    if cgroup is None and policy.drop_privileges:
        raise RuntimeError(f"a gate run's host memory cannot be bounded to {policy.memory_limit_bytes / (1 << 30):g} "
                           f"GiB: no memory cgroup could be made (give --memory-limit-gb 0 to run without the bound)")
    return cgroup


def _end(cgroup: ExecutorCgroup) -> int:
    """Kill what is left in the run's cgroup (a process that left its session and uid behind), remove
    the cgroup, and say how many processes the kernel ended in it for going over its bound."""
    cgroup.kill_all()
    kills = cgroup.oom_kills()
    cgroup.remove()
    return kills


def run_tool(prefix: list[str], tool: str, job: SanitizeJob, deadline_s: float, base: Path | None = None,
             build_cache: str | None = None, policy: SandboxPolicy | None = None, *,
             module: str = RUNNER, inspect: Callable[[Path], Any] | None = None) -> ToolRun:
    """One candidate on one workload under `prefix` (the sanitizer command; [] runs it bare), in the
    executor sandbox of `policy` (default: the sweep's, an unprivileged uid of its own when root).
    `module` is the runner (`python -m module JOB.json`); `inspect` reads the work dir once the run
    and every process of its uid are gone, into ToolRun.found."""
    policy = policy or SandboxPolicy()
    workdir = Path(tempfile.mkdtemp(prefix=f"fibray-{tool}-", dir=base))  # 0700, then the leased uid's
    (workdir / "job.json").write_text(job.model_dump_json(), encoding="utf-8")
    argv = [*prefix, sys.executable, "-m", module, str(workdir / "job.json")]
    try:
        run = _run(argv, tool=tool, workload=job.workload.uuid, deadline_s=deadline_s, workdir=workdir,
                   policy=policy, build_cache=build_cache)
        if inspect is not None:
            run.found = inspect(workdir)
        return run
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def sandbox_problem(policy: SandboxPolicy) -> str | None:
    """Why the runs cannot be sandboxed as `policy` asks here (the gates are then not_run), else None."""
    from fibray.workers.process.sandbox import privilege_problem

    problem = privilege_problem(policy, tempfile.gettempdir())
    return None if problem is None else f"the sandbox cannot be put in force: {problem}"


def run_many(work: Sequence[tuple[list[str], str, SanitizeJob]], *, deadline_s: float, parallel: int,
             policy: SandboxPolicy, module: str = RUNNER,
             inspect: Callable[[Path], Any] | None = None) -> list[ToolRun]:
    """run_tool for each (prefix, tool, job), `parallel` at a time, in order; the candidates compiled
    once, here, into a cache the runs only read (an executor never writes a shared cache)."""
    from fibray.compile.cache import compile_ahead
    from fibray.workers.process.compile_jail import compile_jail

    cache = tempfile.mkdtemp(prefix="fibray-gate-builds-")
    os.chmod(cache, 0o755)
    try:
        for solution in {job.solution.hash: job.solution for _, _, job in work}.values():
            compile_ahead(solution, cache, deadline_s, compile_jail(policy.drop_privileges, policy.uid_range))
        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            return list(pool.map(lambda w: run_tool(w[0], w[1], w[2], deadline_s, build_cache=cache, policy=policy,
                                                    module=module, inspect=inspect), work))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def sanitizer_command(exe: str, tool: str) -> list[str]:
    """The compute-sanitizer prefix for one tool."""
    extra = ["--racecheck-report", "all"] if tool == "racecheck" else []
    return [exe, "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE), "--print-limit", "20", *extra]


def sanitizer_gates(jobs: list[SanitizeJob], *, deadline_s: float = DEADLINE_S, parallel: int = 2,
                    executable: str | None = None, why_not: str | None = None,
                    policy: SandboxPolicy | None = None) -> dict[Gate, GateResult]:
    """The four sanitizer gates of one candidate over its workloads (jobs: one per workload)."""
    policy = policy or SandboxPolicy()
    if executable is None and why_not is None:
        executable, why_not = unavailable()
    if executable is not None and (problem := sandbox_problem(policy)) is not None:
        executable, why_not = None, problem  # fails closed
    if executable is None:
        return {g: GateResult(g, Outcome.NOT_RUN, f"not_run: {why_not}", {"reason": why_not}) for g in SANITIZER_GATES}
    if not jobs:
        return {g: GateResult(g, Outcome.NOT_RUN, "not_run: no workloads to run it on") for g in SANITIZER_GATES}
    runs = run_many([(sanitizer_command(executable, g.value), g.value, job) for g in SANITIZER_GATES for job in jobs],
                    deadline_s=deadline_s, parallel=parallel, policy=policy)
    results: dict[Gate, GateResult] = {}
    for gate in SANITIZER_GATES:
        mine = [r for r in runs if r.tool == gate.value]
        bad = [r for r in mine if r.outcome != "clean"]
        evidence = {"sanitizer": executable, "runs": [
            {"workload": r.workload, "outcome": r.outcome, "returncode": r.returncode, "errors": r.errors,
             "wall_s": r.wall_s, "report": r.tail if r.outcome != "clean" else r.tail[-400:]} for r in mine]}
        if not bad:
            results[gate] = GateResult(gate, Outcome.PASSED, f"clean on {len(mine)} workload(s)", evidence)
        else:
            first = bad[0]
            what = {"flagged": f"{first.errors if first.errors is not None else 'some'} error(s) reported",
                    "timeout": f"no answer within {deadline_s:.0f}s", "runner_failed": "the candidate raised",
                    "out_of_memory": f"went over its host memory bound of {policy.memory_limit_bytes / (1 << 30):g} GiB",
                    "error": f"exited with status {first.returncode}"}[first.outcome]
            results[gate] = GateResult(gate, Outcome.FAILED,
                                       f"{gate.value}: {len(bad)}/{len(mine)} workload(s) not clean; {first.workload}: {what}",
                                       evidence)
    return results
