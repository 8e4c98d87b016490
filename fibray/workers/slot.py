"""A GPU slot: the Ray actor that owns one GPU and supervises candidate executors on it.

The supervisor never runs candidate code. It holds the reference outputs and the checks
(`Judge`), and drives an active executor process (persistent across jobs), a warm standby
that takes over at once when the active one dies, hangs or fails its health check, and
pre-warmed single-use executors for fresh-process isolation. Every wait has a deadline;
an executor past its deadline is killed with its whole process tree.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from fibray.build import BuildError, prepare_triton
from fibray.candidate import POISONING_REASONS, TrialOutput
from fibray.evaluate import Judge, bound_log, default_device, environment, now_iso, run_job
from fibray.phases import Phases
from fibray.schema import Evaluation, EvaluationStatus, Job, JobResult
from fibray.timing import Timing
from fibray.workers import sandbox
from fibray.workers.protocol import BadMessage, ChannelClosed, DeadlineExceeded, Reply, Request, recv, send

Status = EvaluationStatus
_READY_DEADLINE_S = 180.0
_HEALTH_DEADLINE_S = 30.0
_LEAK_BYTES = 256 << 20


class ExecutorFault(Exception):
    """The executor hung, died or was poisoned: its verdict cannot be trusted as is."""

    def __init__(self, status: Status, reason: str, log: str) -> None:
        super().__init__(f"{reason}: {log[:200]}")
        self.status, self.reason, self.log = status, reason, log


_PHASE_OF = {"trial": "trials", "time": "timing"}
"""run_job's phase for an executor request, where the names differ; the executor's own share goes under it."""


class _RemoteCalls:
    """run_job's candidate side, answered by an executor process under deadlines."""

    def __init__(self, ex: sandbox.Executor, job: Job, phase: Phases) -> None:
        self.ex, self.job, self.phase = ex, job, phase
        self.run_deadline: Optional[float] = None

    def _ask(self, req: Request, deadline: float, phase: str) -> Reply:
        try:
            send(self.ex.conn, req)
            reply: Reply = recv(self.ex.conn, deadline, self.ex.arena)
            self.phase.add(reply.spent, prefix=f"{_PHASE_OF.get(req.op, req.op)}.")
            return reply
        except DeadlineExceeded:
            limit = self.job.settings.build_deadline_s if phase == "build" else self.job.settings.run_deadline_s
            raise ExecutorFault(Status.TIMEOUT, f"{phase}_timeout",
                                f"{phase} did not finish within its deadline of {limit}s; executor killed") from None
        except BadMessage as e:
            raise ExecutorFault(Status.RUNTIME_ERROR, "bad_message",
                                f"the executor's reply during {phase} was not a well-formed reply ({e}); executor killed") from None
        except ChannelClosed:
            try:
                self.ex.proc.wait(timeout=5)
            except Exception:  # still alive after closing its channel: it is killed by the caller
                pass
            reason, detail = self.ex.exit_reason()
            if reason == "alive":
                reason, detail = "crashed", "executor closed its channel"
            raise ExecutorFault(Status.RUNTIME_ERROR, reason, f"{detail} during {phase}\n{self.ex.output_tail()}") from None

    def _run_deadline(self) -> float:
        if self.run_deadline is None:
            self.run_deadline = time.monotonic() + self.job.settings.run_deadline_s
        return self.run_deadline

    def build(self, job: Job) -> Optional[BuildError]:
        reply = self._ask(Request("build", job), time.monotonic() + job.settings.build_deadline_s, "build")
        return None if reply.ok else BuildError(reply.error, reply.reason or "build_failed")

    def _trial_like(self, op: str, job: Job, trial: int = 0) -> TrialOutput:
        reply = self._ask(Request(op, job, trial), self._run_deadline(), "run")
        if not reply.ok:
            raise ExecutorFault(Status.RUNTIME_ERROR, "executor_error", reply.error)
        out: TrialOutput = reply.value
        if out.failure is not None and out.failure.reason in POISONING_REASONS:
            raise ExecutorFault(Status(out.failure.status), out.failure.reason, out.failure.log)
        return out

    def trial(self, job: Job, trial: int) -> TrialOutput:
        return self._trial_like("trial", job, trial)

    def recheck(self, job: Job) -> TrialOutput:
        return self._trial_like("recheck", job)

    def time(self, job: Job) -> Timing:
        reply = self._ask(Request("time", job), self._run_deadline(), "run")
        if not reply.ok:
            if reply.reason in POISONING_REASONS:
                raise ExecutorFault(Status(reply.status or "RUNTIME_ERROR"), reply.reason, reply.error)
            raise _CandidateTimingError(reply.status, reply.reason, reply.error)
        return reply.value


class _CandidateTimingError(Exception):
    def __init__(self, status: str, reason: str, log: str) -> None:
        super().__init__(log)
        self.status, self.reason, self.log = status, reason, log


class GpuSlot:
    """Supervises executors on the GPU Ray gave this actor (or the CPU, for a logical GPU)."""

    def __init__(self, name: str, policy: Optional[dict] = None, workdir: Optional[str] = None,
                 torch_threads: Optional[int] = None, standby: bool = True, spare_isolated: int = 1) -> None:
        prepare_triton()
        sandbox.become_subreaper()
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = default_device()
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)
        self.env = environment(self.device)
        self.name = f"{name}@{socket.gethostname()}:{os.getpid()}"
        base = Path(workdir) if workdir else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix=f"fibray-{name}-", dir=base))
        os.chmod(self.base, 0o755)
        self.cache = self.base / "shared-cache"
        self.policy = sandbox.SandboxPolicy(**(policy or {}))
        self.judge = Judge(self.base / "judge", self.device, self.env)
        self.want_standby, self.spare_isolated = standby, spare_isolated
        self.active = self._spawn(single_use=False)
        self.standby = self._spawn(single_use=False) if standby else None
        self.fresh: list[sandbox.Executor] = []
        self.counters = {"promotions": 0, "retired": 0, "escalations": 0, "strays_killed": 0}

    # -- executors -----------------------------------------------------------------------
    def _spawn(self, single_use: bool) -> sandbox.Executor:
        device = str(self.device) if self.device.type == "cuda" else "cpu"
        return sandbox.spawn(device, self.base, self.policy, single_use, self.cache)

    def _ready(self, ex: sandbox.Executor, deadline_s: float = _READY_DEADLINE_S) -> sandbox.Executor:
        if not ex.ready:
            try:
                reply = recv(ex.conn, time.monotonic() + deadline_s, ex.arena)
            except (DeadlineExceeded, ChannelClosed) as e:
                sandbox.retire(ex)
                raise RuntimeError(f"executor failed to start ({type(e).__name__}): {ex.output_tail()[-2000:]}") from None
            ex.ready, ex.info = True, reply.value
        return ex

    def _active(self) -> sandbox.Executor:
        try:
            return self._ready(self.active)
        except RuntimeError:
            self._discard(self.active)
            return self._ready(self.active)

    def _take_fresh(self) -> sandbox.Executor:
        ex = self.fresh.pop(0) if self.fresh else self._spawn(single_use=True)
        while len(self.fresh) < self.spare_isolated:
            self.fresh.append(self._spawn(single_use=True))  # warms up while this job runs
        return self._ready(ex)

    def _discard(self, ex: sandbox.Executor) -> None:
        """Retire an executor; if it was the active one, the standby takes over at once."""
        sandbox.retire(ex)
        self.counters["retired"] += 1
        if ex is self.active:
            self.counters["promotions"] += 1
            self.active = self.standby if self.standby is not None else self._spawn(single_use=False)
            self.standby = self._spawn(single_use=False) if self.want_standby else None

    def _healthy(self, ex: sandbox.Executor) -> bool:
        try:
            send(ex.conn, Request("health"))
            reply = recv(ex.conn, time.monotonic() + _HEALTH_DEADLINE_S, ex.arena)
        except (DeadlineExceeded, ChannelClosed):
            return False
        h = reply.value if reply.ok else None
        return bool(h and h["canary_ok"] and h["allocated"] - h["baseline"] < _LEAK_BYTES)

    # -- the actor's API -----------------------------------------------------------------
    def info(self) -> dict:
        """Who and where this slot is; waits for its active executor to be warm."""
        ex = self._active()
        return {"name": self.name, "pid": os.getpid(), "device": str(self.device),
                "environment": self.env.model_dump(mode="json"),
                "network_isolated": ex.network_isolated, "privileges_dropped": ex.privileges_dropped}

    def stats(self) -> dict:
        return dict(self.counters)

    def evaluate(self, job: Job, mode: str, started_at: str) -> JobResult:
        """Evaluate one job. mode: persistent | isolated | auto (persistent, escalated on a fault)."""
        phase = Phases()
        with phase("executor_wait"):
            ex = self._take_fresh() if mode == "isolated" else self._active()
        isolation = "isolated" if ex.single_use else "persistent"
        escalated = False
        evaluation, fault = self._run(ex, job, phase)
        # processes the candidate left behind are found before anything retires their parent
        with phase("strays"):
            left = sandbox.descendants(ex.pid) if fault is None and ex.alive() else []
        if fault is not None:
            with phase("retire"):
                self._discard(ex)
            if mode == "auto":
                self.counters["escalations"] += 1
                escalated, isolation = True, "isolated"
                with phase("executor_wait"):
                    ex = self._take_fresh()
                evaluation, fault = self._run(ex, job, phase)
                with phase("strays"):
                    left = sandbox.descendants(ex.pid) if fault is None and ex.alive() else []
                with phase("retire"):
                    self._discard(ex)
            if fault is not None:
                evaluation = self._fault_verdict(job, fault, ex)
        else:
            with phase("health"):
                retire = ex.single_use or left or not self._healthy(ex)
            if retire:
                with phase("retire"):
                    self._discard(ex)
        with phase("strays"):
            keep = {e.pid for e in (self.active, self.standby, *self.fresh) if e is not None}
            strays = sandbox.reap_strays(keep)
        if strays or left:
            self.counters["strays_killed"] += len(set(strays) | set(left))
            if evaluation.status == Status.PASSED:
                evaluation = self.judge.fail(Status.RUNTIME_ERROR, "left_child_process",
                                             f"the candidate left {len(set(strays) | set(left))} process(es) running; killed",
                                             job.settings)
        return JobResult(job_id=job.job_id, evaluation=evaluation, worker=self.name, isolation=isolation,
                         attempt=job.attempt, started_at=started_at, finished_at=now_iso(), escalated=escalated,
                         network_isolated=ex.network_isolated, privileges_dropped=ex.privileges_dropped,
                         phases=phase)

    def _run(self, ex: sandbox.Executor, job: Job, phase: Phases) -> tuple[Optional[Evaluation], Optional[ExecutorFault]]:
        calls = _RemoteCalls(ex, job, phase)
        try:
            evaluation = run_job(job, self.judge, calls, phase)
        except ExecutorFault as f:
            sandbox.kill_tree(ex.pid, ex.pid)  # hung or broken: down at once, whole tree
            return None, f
        except _CandidateTimingError as e:
            reason = "failed_during_timing" if e.reason == "exception" else e.reason
            evaluation = self.judge.fail(e.status or "RUNTIME_ERROR", reason, e.log, job.settings)
        try:
            with phase("finish"):
                send(ex.conn, Request("finish", job))
                recv(ex.conn, time.monotonic() + _HEALTH_DEADLINE_S, ex.arena)
        except (ChannelClosed, DeadlineExceeded):
            pass  # the health check that follows retires it
        return evaluation, None

    def _fault_verdict(self, job: Job, fault: ExecutorFault, ex: sandbox.Executor) -> Evaluation:
        log, tail = fault.log, ex.output_tail()
        if tail and tail not in log:
            log = f"{log}\n--- candidate output (tail) ---\n{tail}"
        return self.judge.fail(fault.status, fault.reason, bound_log(log, job.settings.log_limit), job.settings)

    def shutdown(self) -> None:
        for ex in (self.active, self.standby, *self.fresh):
            if ex is not None:
                sandbox.retire(ex)
        sandbox.reap_strays(set())
