"""The fault-injection suite: every offender in tests/candidates gets its designed status and
reason, the honest controls pass exactly as they do without offenders, the sweep finishes,
and nothing is left running."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import ray

from fibray.store import TraceStore, scan
from fibray.sweep import run_sweep
from fibray.schema.reasons import FAULT_REASONS
from fibray.workers.process.sandbox import network_namespaces_available
from _sweep_helpers import REPO, designed_verdict, expected_verdict, meets_extra, reachable_tmpdir, smoke_config

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

SECRET = "fibray-test-secret-7f3a"
EXPECTED = json.loads((REPO / "tests" / "fault_expectations.json").read_text())
CONTROLS = ["rmsnorm_h4096_torch", "rmsnorm_h4096_triton"]
PROBE = "offender_privilege_probe"
FORGED_MARK = Path("/tmp/fibray-forged-reply-ran")  # what offender_forged_reply's payload would create


def _config(store: Path, workdir: Path, roots: list[str], names: list[str] | None = None):
    return smoke_config(
        store, dataset__definitions=["rmsnorm_h4096"], dataset__max_workloads_per_definition=3,
        solutions__roots=roots, solutions__names=names, sweep__name="faults",
        eval__build_deadline_s=8, eval__run_deadline_s=20, runner__quarantine_after=2, runner__workdir=str(workdir),
        runner__scratch_gb=0.25,  # offender_fills_disk fills it
        runner__memory_limit_gb=2,  # offender_forks_past_memory goes over it, not over the host's
    )


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    os.environ["FIBRAY_TEST_SECRET_TOKEN"] = SECRET  # set before Ray starts, so every Ray process has it
    FORGED_MARK.unlink(missing_ok=True)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 47831))
    listener.listen(64)
    ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        base = tmp_path_factory.mktemp("faults")
        workdir = reachable_tmpdir("fibray-faults-")
        with_offenders = run_sweep(_config(base / "all", workdir, [str(REPO / "solutions"), str(REPO / "tests" / "candidates")]))
        # the same secret input salt, so that the controls alone see the same inputs
        TraceStore(base / "controls").sweep_salt("faults", adopt=TraceStore(base / "all").sweep_salt("faults"))
        controls_only = run_sweep(_config(base / "controls", workdir, [str(REPO / "solutions")], CONTROLS))
        yield {"all": scan(base / "all").collect(), "controls": scan(base / "controls").collect(),
               "report": with_offenders, "controls_report": controls_only, "workdir": workdir}
    finally:
        ray.shutdown()
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)
        os.environ.pop("FIBRAY_TEST_SECRET_TOKEN", None)


def test_every_offender_gets_its_status_and_reason(sweeps):
    df = sweeps["all"]
    assert len(df) == sweeps["report"].total_jobs == 3 * (7 + len(EXPECTED))
    quarantined = 0
    for row in df.iter_rows(named=True):
        name = row["solution"]
        if name == PROBE:
            continue
        status, reason = expected_verdict(EXPECTED[name]) if name in EXPECTED else designed_verdict(name, row["definition"])
        if row["reason"] == "quarantined":
            quarantined += 1
            assert reason in FAULT_REASONS and row["status"] == status, name
            assert "quarantined after 2 faults" in row["log"]
            continue
        assert (row["status"], row["reason"]) == (status, reason), f"{name}: {row['log'][-500:]}"
        assert meets_extra(EXPECTED.get(name, []), row["timing_mode"], row["latency_ms"]), (name, row["latency_ms"])
        if reason in FAULT_REASONS:
            assert row["isolation"] == "isolated", name  # escalated, or isolated after an earlier fault
    assert quarantined >= 1, "no solution reached the quarantine"


def test_a_forged_reply_is_refused_without_running_its_payload(sweeps):
    df = sweeps["all"]
    rows = df.filter(df["solution"] == "offender_forged_reply").to_dicts()
    assert rows and {(r["status"], r["reason"]) for r in rows} <= {("RUNTIME_ERROR", "bad_message"),
                                                                  ("RUNTIME_ERROR", "quarantined")}
    assert any("os.system" in r["log"] or "posix.system" in r["log"] for r in rows), rows[0]["log"][-500:]
    assert not FORGED_MARK.exists(), "the supervisor unpickled the candidate's payload and ran it"


def test_faults_are_escalated_to_fresh_processes(sweeps):
    df = sweeps["all"]
    for name in ("offender_hang_in_run", "offender_segfault", "offender_sleep_at_import"):
        rows = df.filter(df["solution"] == name)
        assert rows["escalated"].any(), name
    assert not df.filter(df["solution"].is_in(CONTROLS))["escalated"].any()
    assert sum(s["promotions"] for s in sweeps["report"].slot_stats) >= 1  # a standby took over


def test_honest_controls_pass_exactly_as_without_offenders(sweeps):
    cols = ["solution", "workload_uuid", "status", "max_abs_error", "max_rel_error"]
    mixed = sweeps["all"].filter(sweeps["all"]["solution"].is_in(CONTROLS)).select(cols).sort(cols[:2])
    alone = sweeps["controls"].select(cols).sort(cols[:2])
    assert mixed.to_dicts() == alone.to_dicts()
    assert set(mixed["status"]) == {"PASSED"}


def test_every_row_says_the_supervisor_verified_its_memory(sweeps):
    df = sweeps["all"]
    ran = df.filter(df["reason"].is_null() | (df["reason"] != "quarantined"))  # quarantined jobs never ran
    assert len(ran) and set(ran["checks"]) == {"supervisor"}


def test_candidate_cannot_read_driver_secret_or_reach_network(sweeps):
    rows = sweeps["all"].filter(sweeps["all"]["solution"] == PROBE)
    assert set(rows["status"]) == {"PASSED"}, rows["log"].to_list()
    assert rows["privileges_dropped"].all()
    assert rows["network_isolated"].all() == network_namespaces_available()


def test_nothing_is_left_running(sweeps):
    workdir = str(sweeps["workdir"])
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if workdir in cmd or cwd.startswith(workdir) or "fibray-orphan-marker" in cmd:
            leftovers.append((pid, cmd[:120]))
    assert not leftovers
