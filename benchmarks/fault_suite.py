"""Run the fault-injection suite as one sweep and print every verdict against its expectation.

    python benchmarks/fault_suite.py [--store DIR] [--workloads 3] [--lanes 1] [--only NAME,...]
                                     [--override runner.prewarm=true ...]

On a GPU machine the GPU-only offenders (tests/candidates_gpu) join the sweep. Prints the
wall time, slot counters (standby promotions, escalations, strays killed) and whether the
honest controls matched a sweep of the controls alone. Exit status 1 on any mismatch. An expectation
is [status, reason] or [status, reason, timing-mode variant]: the latter also wants the row's
timing_mode to end with "+variant" (a lie on a GPU slot kept at the supervisor's clock: host_bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

CONTROLS = ["rmsnorm_h4096_torch", "rmsnorm_h4096_triton"]


def main() -> int:
    import torch
    import yaml

    from _sweep_helpers import designed_verdict, meets_extra, smoke_config
    from fibray.store import TraceStore
    from fibray.sweep import run_sweep
    from fibray.schema.reasons import FAULT_REASONS

    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None)
    ap.add_argument("--workloads", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=1, help="runner.lanes: offenders and controls share the GPU")
    ap.add_argument("--only", default=None, help="comma-separated candidates (the controls always run)")
    ap.add_argument("--override", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra settings for both sweeps, YAML values (e.g. runner.prewarm=true)")
    args = ap.parse_args()
    if bad_items := [item for item in args.override if "=" not in item or "." not in item.partition("=")[0]]:
        ap.error(f"--override wants SECTION.KEY=VALUE, got {bad_items}")
    try:
        extra = {key.replace(".", "__", 1): yaml.safe_load(value)
                 for key, _, value in (item.partition("=") for item in args.override)}
    except yaml.YAMLError as exc:
        ap.error(f"--override: {exc}")
    base = Path(args.store or tempfile.mkdtemp(prefix="fibray-faults-"))
    gpu = torch.cuda.is_available()
    expected = json.loads((REPO / "tests" / "fault_expectations.json").read_text())
    roots = [str(REPO / "solutions"), str(REPO / "tests" / "candidates")]
    if gpu:
        expected.update(json.loads((REPO / "tests" / "fault_expectations_gpu.json").read_text()))
        roots.append(str(REPO / "tests" / "candidates_gpu"))
    common = dict(dataset__definitions=["rmsnorm_h4096"], dataset__workload_set="gpu" if gpu else "cpu_small",
                  dataset__max_workloads_per_definition=args.workloads, sweep__name="faults", sweep__progress=False,
                  eval__build_deadline_s=15 if gpu else 8, eval__run_deadline_s=15 if gpu else 20,
                  eval__warmup=3, eval__iterations=10, eval__trials=2, runner__quarantine_after=2,
                  runner__lanes=args.lanes, runner__scratch_gb=0.25,  # offender_fills_disk fills it
                  runner__memory_limit_gb=6 if gpu else 2)  # offender_forks_past_memory goes over it (5 x 1.5 GiB)
    common.update(extra)
    t0 = time.monotonic()
    only = dict(solutions__names=sorted({*args.only.split(","), *CONTROLS})) if args.only else {}
    report = run_sweep(smoke_config(base / "all", solutions__roots=roots, **only, **common))
    wall = time.monotonic() - t0
    # the same secret input salt, so that the controls alone see the same inputs
    TraceStore(base / "controls").sweep_salt("faults", adopt=TraceStore(base / "all").sweep_salt("faults"))
    run_sweep(smoke_config(base / "controls", solutions__roots=roots[:1], solutions__names=CONTROLS, **common))
    cols = ["solution", "workload_uuid", "axes", "status", "reason", "isolation", "escalated", "latency_ms",
            "reference_latency_ms", "timing_mode", "max_abs_error", "network_isolated", "privileges_dropped", "log"]
    rows = sorted(TraceStore(base / "all").read(columns=cols).to_pylist(), key=lambda r: (r["solution"], r["axes"]))
    bad = 0
    print(f"{'solution':42s} {'axes':22s} {'status':20s} {'reason':22s} {'isolation':10s} esc  timing         lat_ms   ok")
    for r in rows:
        name = r["solution"]
        entry = expected[name] if name in expected else list(designed_verdict(name, "rmsnorm_h4096"))
        want, got = tuple(entry[:2]), (r["status"], r["reason"])
        ok = got == want or (r["reason"] == "quarantined" and want[1] in FAULT_REASONS and r["status"] == want[0])
        ok = ok and meets_extra(entry, r["timing_mode"], r["latency_ms"])
        bad += not ok
        lat = f"{r['latency_ms']:.4f}" if r["latency_ms"] else "-"
        print(f"{name:42s} {r['axes']:22s} {r['status']:20s} {str(r['reason']):22s} {r['isolation']:10s} "
              f"{'yes' if r['escalated'] else 'no ':3s}  {str(r['timing_mode']):14s} {lat:>8s}   {'ok' if ok else 'MISMATCH'}")
        if not ok:
            print("    log:", (r["log"] or "")[-800:].replace("\n", " | "))
    mixed = sorted(((r["solution"], r["workload_uuid"], r["status"], r["max_abs_error"]) for r in rows if r["solution"] in CONTROLS))
    solo = sorted((r["solution"], r["workload_uuid"], r["status"], r["max_abs_error"])
                  for r in TraceStore(base / "controls").read(columns=cols).to_pylist())
    same = mixed == solo and all(m[2] == "PASSED" for m in mixed)
    # the reference is timed once per workload and slot, in a window of its own: whoever was timed before
    # it must not have changed it (compared with the same workloads' references timed with controls only)
    solo_ref = {r["workload_uuid"]: r["reference_latency_ms"]
                for r in TraceStore(base / "controls").read(columns=cols).to_pylist() if r["reference_latency_ms"]}
    ratios = sorted(r["reference_latency_ms"] / solo_ref[r["workload_uuid"]] for r in rows
                    if r["reference_latency_ms"] and solo_ref.get(r["workload_uuid"]))
    if ratios:
        print(f"reference latency, this sweep / controls alone: min {ratios[0]:.3f}, max {ratios[-1]:.3f} "
              f"over {len(ratios)} PASSED rows")
    print(f"\nlanes {args.lanes}; overrides {args.override}; records: {len(rows)} (expected {report.total_jobs}); mismatches: {bad}; wall {wall:.1f}s")
    print(f"controls identical to a sweep without offenders: {same}")
    print(f"slot counters: {report.slot_stats}")
    sandbox = {(r["network_isolated"], r["privileges_dropped"]) for r in rows}
    print(f"sandbox (network_isolated, privileges_dropped): {sorted(sandbox, key=str)}")
    return 0 if bad == 0 and same and len(rows) == report.total_jobs else 1


if __name__ == "__main__":
    sys.exit(main())
