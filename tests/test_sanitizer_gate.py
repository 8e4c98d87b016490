"""The sanitizer gate's CPU path: not_run (never passed) without a GPU or a sanitizer, and the
sandboxed runner process with its own deadline, exercised bare (no sanitizer prefix) on the CPU."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
from _apply_fixtures import _definition, _solution

from fibray.promote.sanitize_runner import SanitizeJob
from fibray.promote.sanitizer import SANITIZER_ENV, run_tool, sanitizer_command, sanitizer_gates, unavailable
from fibray.schema import Definition, Solution, Workload
from fibray.store import Gate, Outcome

DEFINITION = Definition.model_validate(_definition("scale_h64"))
WORKLOAD = Workload.model_validate({"uuid": "w-n4", "axes": {"n": 4},
                                    "inputs": {"x": {"type": "random"}, "w": {"type": "random"}}})


def job(body: str, tmp_path: Path, **kw: object) -> SanitizeJob:
    sol = Solution.model_validate(_solution("scale_h64", "s", body, **kw))
    return SanitizeJob(definition=DEFINITION, workload=WORKLOAD, solution=sol, dataset_root=str(tmp_path), device="cpu")


def test_without_a_sanitizer_every_sanitizer_gate_is_not_run_with_the_reason(monkeypatch) -> None:
    monkeypatch.setenv(SANITIZER_ENV, "/nonexistent/compute-sanitizer")
    results = sanitizer_gates([])
    assert set(results) == {Gate.MEMCHECK, Gate.RACECHECK, Gate.INITCHECK, Gate.SYNCCHECK}
    for r in results.values():
        assert r.outcome is Outcome.NOT_RUN and r.reason.startswith("not_run: compute-sanitizer not found")


def test_without_a_gpu_a_found_sanitizer_is_not_run_either(monkeypatch) -> None:
    from fibray.workers.start import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv(SANITIZER_ENV, "/bin/true")  # found and executable; the GPU check must still refuse
    exe, why = unavailable()
    assert exe is None and why.startswith("no GPU visible")
    assert all(r.outcome is Outcome.NOT_RUN for r in sanitizer_gates([]).values())


@pytest.mark.slow
def test_the_runner_runs_a_candidate_once_in_its_sandboxed_process(tmp_path: Path) -> None:
    run = run_tool([], "memcheck", job("return x * w", tmp_path), deadline_s=120)
    assert (run.outcome, run.returncode) == ("clean", 0), run.tail
    assert "scale_h64_s on w-n4: ran" in run.tail


@pytest.mark.slow
def test_the_runner_runs_destination_passing_candidates_into_their_outputs(tmp_path: Path) -> None:
    run = run_tool([], "memcheck", job("torch.mul(x, w, out=y)", tmp_path, dps=True), deadline_s=120)
    assert run.outcome == "clean", run.tail


@pytest.mark.slow
def test_a_candidate_that_raises_is_a_runner_failure_not_a_clean_run(tmp_path: Path) -> None:
    run = run_tool([], "memcheck", job("raise RuntimeError('boom')", tmp_path), deadline_s=120)
    assert run.outcome == "runner_failed" and "RuntimeError: boom" in run.tail


@pytest.mark.slow
def test_a_hung_candidate_is_killed_with_its_process_group_at_its_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    tmp_path.chmod(0o777)
    body = (f"import subprocess\nchild = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\ntime.sleep(300)")
    t0 = time.monotonic()
    run = run_tool([], "memcheck", job(body, tmp_path), deadline_s=8)
    assert run.outcome == "timeout" and time.monotonic() - t0 < 60
    if pidfile.exists():  # the candidate got as far as starting its child: it must be gone too
        pid = int(pidfile.read_text())
        time.sleep(0.5)
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.slow
def test_a_run_and_what_it_starts_stay_under_its_memory_bound_together(tmp_path: Path) -> None:
    """A candidate whose forked children take more host memory than the gate's bound: the kernel ends
    one, and the run says so (unbounded, the same candidate runs clean)."""
    from fibray.promote.smem_poison import Verdict, check_of
    from fibray.workers.process.cgroup import memory_hierarchy
    from fibray.workers.process.sandbox import SandboxPolicy

    if memory_hierarchy() is None:
        pytest.skip("no memory cgroup can be made here (fibray not root, or no memory controller)")
    body = ("import os\npids = []\nfor _ in range(2):\n    pid = os.fork()\n    if pid == 0:\n"
            "        held = [b'\\x01' * (1 << 27) for _ in range(8)]\n        time.sleep(1.0)\n        os._exit(0)\n"
            "    pids.append(pid)\nfor pid in pids:\n    os.waitpid(pid, 0)\nreturn x * w")
    tmp_path.chmod(0o755)
    bounded = run_tool([], "memcheck", job(body, tmp_path), deadline_s=120,
                       policy=SandboxPolicy(memory_limit_bytes=3 << 29))  # 1.5 GiB; the children want 2
    assert bounded.outcome == "out_of_memory", (bounded.outcome, bounded.tail)
    assert "host memory bound of 1.5 GiB" in bounded.tail
    check = check_of(bounded, 120)
    assert check.verdict is Verdict.ERROR and "memory bound" in check.detail
    free = run_tool([], "memcheck", job(body, tmp_path), deadline_s=120, policy=SandboxPolicy(memory_limit_bytes=None))
    assert free.outcome == "clean", free.tail


def test_each_tool_gets_its_own_sanitizer_command_with_an_error_exit_code() -> None:
    cmd = sanitizer_command("/cs", "racecheck")
    assert cmd[:5] == ["/cs", "--tool", "racecheck", "--error-exitcode", "86"]
    assert "--racecheck-report" in cmd and "--racecheck-report" not in sanitizer_command("/cs", "memcheck")


def test_a_failing_sanitizer_probe_is_reported_as_not_run_with_its_output(monkeypatch, tmp_path: Path) -> None:
    import fibray.workers.start as start

    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\necho '========= Error: Target device is not supported'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(SANITIZER_ENV, str(fake))
    monkeypatch.setattr(start, "visible_gpu_count", lambda: 1)  # the refusal comes after the GPU check
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    exe, why = unavailable(deadline_s=30)
    assert exe is None and "does not work on this device" in why and "not supported" in why
    assert os.access(fake, os.X_OK)
    assert not list(temp.iterdir())  # the probe's working directory is gone with it


@pytest.mark.slow
def test_the_runner_binds_a_c_abi_solution_to_its_definition_before_calling_it(tmp_path: Path) -> None:
    """A c_abi entry takes pointers and var axes, so the runner must marshal it as the executor does:
    unbound it raised CAbiArgumentError on the H200 and every sanitizer tool saw a runner failure."""
    from fibray.compile import DeviceRequired
    from fibray.dataset import load_dataset
    from fibray.promote.sanitize_runner import run

    repo = Path(__file__).resolve().parents[1]
    data = load_dataset(repo / "datasets" / "llm", workload_set="cpu_small")
    definition = data.definitions["rmsnorm_h4096"]
    sol = data.solutions["rmsnorm_h4096_cuda_c_abi"]
    sj = SanitizeJob(definition=definition, workload=data.workloads[definition.name][0], solution=sol,
                     dataset_root=str(data.root), device="cpu")
    with pytest.raises(DeviceRequired):  # bound, it gets as far as asking for the GPU this machine lacks
        run(sj, tmp_path)
