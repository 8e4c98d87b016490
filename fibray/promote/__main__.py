"""`python -m fibray.promote`: run the automated gates, record a review or a rollout step, show stages.

    python -m fibray.promote --store S --dataset D --sweep NAME [--gates hidden,memcheck,...]
    python -m fibray.promote --store S --approve SOLUTION [--waive memcheck,racecheck] [--note TEXT]
    python -m fibray.promote --store S --stage SOLUTION canary|default|demoted
    python -m fibray.promote --store S --report
"""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
from typing import Optional

from fibray.store.promotions import (
    AUTOMATED_GATES, SERVING_STAGES, Gate, Outcome, PromotionLog, PromotionRecord, Stage,
)

ROLLOUT = {Stage.SHADOW: {Stage.CANARY, Stage.DEFAULT, Stage.DEMOTED}, Stage.CANARY: {Stage.DEFAULT, Stage.DEMOTED},
           Stage.DEFAULT: {Stage.DEMOTED}}
"""Stage -> the stages `--stage` may move it to (forward, or out)."""


class PromoteError(ValueError):
    """A request the promotions table cannot honour; the message says why."""


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _artifact_rows(plog: PromotionLog, solution: str, artifact: Optional[str]) -> list[PromotionRecord]:
    """The history of the artifact meant: --artifact (a prefix), else the solution's latest artifact here."""
    from fibray.promote.artifact import environment_key, running_environment_record

    rows = [r for r in plog.read() if r.solution == solution]
    if artifact:
        rows = [r for r in rows if r.artifact_id.startswith(artifact)]
        if not rows:
            raise PromoteError(f"--artifact: no artifact {artifact!r} of {solution!r} in {plog.folder}")
    else:
        here = environment_key(running_environment_record())
        rows = [r for r in rows if r.environment_key == here]
        if not rows:
            raise PromoteError(f"no artifact of {solution!r} for this environment in {plog.folder} "
                               "(run the gates here first, or name one with --artifact)")
    latest = rows[-1].artifact_id
    return [r for r in rows if r.artifact_id == latest]


def _follow(last: PromotionRecord, stage: Stage, gate: Gate, reason: str, evidence: dict, actor: str) -> PromotionRecord:
    return last.model_copy(update={"stage": stage, "gate": gate, "outcome": Outcome.PASSED, "reason": reason,
                                   "evidence": evidence, "actor": actor,
                                   "recorded_at": PromotionRecord.model_fields["recorded_at"].default_factory()})


def approve(plog: PromotionLog, solution: str, *, waive: list[Gate], note: str, actor: str,
            artifact: Optional[str] = None) -> PromotionRecord:
    """Record a review: a validated artifact (or one whose not-run gates are all waived) goes to shadow."""
    rows = _artifact_rows(plog, solution, artifact)
    last = rows[-1]
    summaries = [r for r in rows if r.gate is Gate.AUTOMATED]
    if last.stage is Stage.CANDIDATE and summaries and last is summaries[-1]:
        unmet = set(last.evidence.get("not_run", [])) | set(last.evidence.get("not_recorded", []))
        missing = sorted(unmet - {g.value for g in waive})
        if missing:
            raise PromoteError(f"--approve {solution}: artifact {last.artifact_id[:12]} has gates that did not run "
                               f"({', '.join(missing)}); run them, or --waive them in the review")
    elif last.stage is not Stage.VALIDATED:
        raise PromoteError(f"--approve {solution}: artifact {last.artifact_id[:12]} is {last.stage.value} "
                           f"({last.gate.value}: {last.reason}); only a validated artifact can be approved")
    row = _follow(last, Stage.SHADOW, Gate.REVIEW, note or "approved",
                  {"waived": sorted(g.value for g in waive), "note": note}, actor)
    plog.append([row])
    return row


def set_stage(plog: PromotionLog, solution: str, stage: Stage, *, note: str, actor: str,
              artifact: Optional[str] = None) -> PromotionRecord:
    """Record a rollout step (shadow -> canary -> default) or a demotion by hand."""
    last = _artifact_rows(plog, solution, artifact)[-1]
    allowed = ROLLOUT.get(last.stage, set())
    if stage not in allowed:
        raise PromoteError(f"--stage {solution} {stage.value}: artifact {last.artifact_id[:12]} is {last.stage.value}; "
                           f"it may go to {', '.join(sorted(s.value for s in allowed)) or 'nothing (review it first)'}")
    row = _follow(last, stage, Gate.ROLLOUT, note or f"{last.stage.value} -> {stage.value}",
                  {"from": last.stage.value, "note": note}, actor)
    if stage is Stage.DEMOTED:
        row = row.model_copy(update={"outcome": Outcome.FAILED})
    plog.append([row])
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fibray.promote", description=(
        "Promotion: gate a sweep's PASSED candidates (hidden workloads, compute-sanitizer, shared-memory "
        "poison, fresh-process re-benchmark), record reviews and rollout steps, show the stage table."))
    p.add_argument("--store", required=True, help="trace store root (promotions in <store>/_promotions)")
    p.add_argument("--dataset", help="dataset root (needed to run gates)")
    p.add_argument("--sweep", help="run the automated gates for the PASSED candidates of this sweep")
    p.add_argument("--workload-set", help="workloads/<set>/ only, as the sweep used")
    p.add_argument("--solutions-root", action="append", default=[], help="extra solution folder (repeatable)")
    p.add_argument("--definitions", help="comma-separated definition names")
    p.add_argument("--solutions", help="comma-separated solution names")
    p.add_argument("--gates", default=",".join(g.value for g in AUTOMATED_GATES),
                   help="comma-separated gates to run (default: all automated gates)")
    p.add_argument("--num-gpus", type=int, help="cluster.num_gpus of the gate sweeps")
    p.add_argument("--max-workloads", type=int, help="at most N workloads per definition in the gates")
    p.add_argument("--ci-k", type=float, default=3.0, help="re-benchmark: standard errors of the median allowed")
    p.add_argument("--ci-floor", type=float, default=0.10, help="re-benchmark: the interval is at least +-this x median")
    p.add_argument("--sanitizer-deadline-s", type=float, default=600.0,
                   help="deadline of one sanitizer or smem_poison run")
    p.add_argument("--sanitizer-parallel", type=int, default=2, help="sanitizer and smem_poison runs at once")
    p.add_argument("--no-drop-privileges", action="store_true",
                   help="run sanitizer and smem_poison runs with fibray's own privileges (default: uids of their "
                        "own, as root)")
    p.add_argument("--memory-limit-gb", type=float, default=16.0,
                   help="host memory bound of each sanitizer and smem_poison run, in GiB, through a memory cgroup "
                        "(0: none; as root without a memory cgroup, the runs are refused unless 0)")
    p.add_argument("--revalidate", action="store_true", help="also gate validated or serving artifacts")
    p.add_argument("--tag", default="", help="gate sweeps are <sweep>.hidden.TAG, <sweep>.rebench.TAG (a new tag "
                                             "measures again; the same name reuses its rows)")
    p.add_argument("--approve", metavar="SOLUTION", help="record the human review: the artifact goes to shadow")
    p.add_argument("--waive", default="", help="with --approve: comma-separated gates that did not run, accepted")
    p.add_argument("--stage", nargs=2, metavar=("SOLUTION", "STAGE"), help="rollout: canary, default or demoted")
    p.add_argument("--artifact", help="with --approve/--stage: the artifact id (a prefix) instead of the latest here")
    p.add_argument("--note", default="", help="with --approve/--stage: a note recorded as the reason")
    p.add_argument("--actor", default=None, help="who is recording (default: user@host)")
    p.add_argument("--report", action="store_true", help="print the stage table per definition")
    return p


def _gates(text: str, what: str) -> list[Gate]:
    names = [g.strip() for g in text.split(",") if g.strip()]
    valid = {g.value for g in AUTOMATED_GATES}
    bad = [g for g in names if g not in valid]
    if bad:
        raise PromoteError(f"{what}: unknown gate(s) {', '.join(bad)} (gates: {', '.join(sorted(valid))})")
    return [Gate(g) for g in names]


def main(argv: Optional[list[str]] = None) -> int:
    import logging

    from fibray.dataset import DatasetError
    from fibray.store import StoreError
    from fibray.sweep.config import ConfigError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    actor = args.actor or _actor()
    plog = PromotionLog(args.store)
    if not (args.sweep or args.approve or args.stage or args.report):
        print("fibray.promote: error: nothing to do: give --sweep, --approve, --stage or --report", file=sys.stderr)
        return 2
    try:
        if args.sweep:
            from fibray.promote.gates import PromoteOptions, run_gates

            if not args.dataset:
                raise PromoteError("--sweep needs --dataset (the dataset the sweep ran)")
            split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
            run_gates(PromoteOptions(
                store=args.store, dataset=args.dataset, sweep=args.sweep, workload_set=args.workload_set,
                solution_roots=args.solutions_root, definitions=split(args.definitions), solutions=split(args.solutions),
                gates=_gates(args.gates, "--gates"), num_gpus=args.num_gpus, max_workloads=args.max_workloads,
                ci_k=args.ci_k, ci_floor=args.ci_floor, sanitizer_deadline_s=args.sanitizer_deadline_s,
                sanitizer_parallel=args.sanitizer_parallel, revalidate=args.revalidate, tag=args.tag,
                drop_privileges=not args.no_drop_privileges, memory_limit_gb=args.memory_limit_gb or None,
                actor=actor))
        if args.approve:
            row = approve(plog, args.approve, waive=_gates(args.waive, "--waive"), note=args.note, actor=actor,
                          artifact=args.artifact)
            print(f"{row.solution}: artifact {row.artifact_id[:12]} -> {row.stage.value} (review by {actor})")
        if args.stage:
            name, stage = args.stage
            if stage not in {s.value for s in (*SERVING_STAGES, Stage.DEMOTED)} or stage == Stage.SHADOW.value:
                raise PromoteError(f"--stage: {stage!r} is not canary, default or demoted (shadow comes from --approve)")
            row = set_stage(plog, name, Stage(stage), note=args.note, actor=actor, artifact=args.artifact)
            print(f"{row.solution}: artifact {row.artifact_id[:12]} -> {row.stage.value}")
        if args.report:
            from fibray.promote.artifact import environment_key, running_environment_record
            from fibray.promote.report import format_stage_table, stage_rows

            print(format_stage_table(stage_rows(plog.read(), environment_key(running_environment_record()))))
    except (PromoteError, DatasetError, StoreError, ConfigError, ValueError) as e:
        print(f"fibray.promote: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
