"""The table of sweep configuration keys: what `--help` prints and README's configuration table shows.

One source: README's table is this table rendered (a test compares them), and every key of
SweepConfig appears in exactly one row (a test checks that too).
"""

from __future__ import annotations

from fibray.sweep.config import config_keys

KEY_TABLE: tuple[tuple[tuple[str, ...], str], ...] = (
    (("dataset.root",), "a FlashInfer Trace folder (default: `datasets/core`; the repository also ships `datasets/llm`)"),
    (("dataset.definitions",), "list of definition names, e.g. `'dataset.definitions=[rmsnorm_h4096,gemm_n128_k2048]'`"),
    (("dataset.workload_set",), "read only `workloads/<set>/` (`cpu_small`, `gpu`)"),
    (("dataset.max_workloads_per_definition",), "keep the first N workloads of each definition"),
    (("dataset.split",), "`all` (default), `public`, `hidden` or `replay`: only workloads of that split (the dataset's "
                         "`splits/*.json`, workload uuid -> split; unlisted = public)"),
    (("solutions.roots", "solutions.names"), "extra solution folders / a subset of solutions"),
    (("solutions.include_reference",), "also evaluate each definition's reference as a candidate (author `reference`): "
                                       "a dataset without solutions is useful at once"),
    (("store.root",), "trace store root (any shared path on a cluster)"),
    (("cluster.address", "cluster.num_gpus"), "join a Ray cluster (or `RAY_ADDRESS`); GPUs to use (logical GPUs on a "
                                              "CPU-only machine)"),
    (("cluster.num_cpus", "cluster.start_deadline_s"), "CPUs of a local Ray; seconds one GPU slot may take to start"),
    (("cluster.log_to_driver",), "show candidates' output and Ray's own messages"),
    (("sweep.name",), "the sweep (a store partition); rerunning a name resumes it"),
    (("sweep.allow_mixed_datasets",), "let one sweep name hold results of two datasets (refused by default)"),
    (("sweep.progress", "sweep.verbose"), "start-up phases and a progress bar; Ray's messages and fibray's debug log"),
    (("sweep.flush_rows", "sweep.flush_interval_s"), "write a Parquet file after this many records or seconds"),
    (("eval.warmup", "eval.iterations", "eval.trials", "eval.atol", "eval.rtol", "eval.matched_ratio", "eval.seed"),
     "evaluation settings (part of a job's identity)"),
    (("eval.input_distribution",), "`normal` (N(0,1)), `outliers` (1% of each float input scaled by 1e2–1e3, within the "
                                   "dtype's range; a definition's `random_inputs` says which inputs, how many, how large) "
                                   "or `mixed` (odd trials outliers); part of a job's identity. Every sweep also salts "
                                   "its input seeds with a secret drawn at its first run (`<store.root>/_secrets/`, mode "
                                   "0600), so no candidate can know its inputs beforehand"),
    (("eval.flush_l2", "eval.sync_device", "eval.time_reference"), "timing: flush the L2 between calls, synchronise the "
                                                                   "device before the end mark, time the reference"),
    (("eval.timing",), "`fixed` (default: `eval.iterations` timed calls per input set) or `adaptive` (stop once the "
                       "mean's standard error is under 1% of it, at least 10 calls); part of a job's identity, and the "
                       "row's `timing_mode` ends in `+adaptive` so it is never compared with fixed-count timing "
                       "unawares"),
    (("eval.build_deadline_s", "eval.run_deadline_s"), "deadlines per job"),
    (("eval.log_limit",), "characters of a candidate's error text kept in its record"),
    (("runner.isolation",), "`auto` (persistent, escalate faults), `persistent`, `isolated`"),
    (("runner.lanes",), "jobs in flight per slot (default `auto`: 1 on a GPU, whose timed windows stop the other "
                        "lanes' executors, so more lanes were slower there; on a CPU slot min(4, max(1, CPUs // 2))); "
                        "builds, trials and checks overlap, timing stays exclusive"),
    (("runner.prewarm",), "ready a standby for the solution a GPU likely runs next (default `auto`: on GPU slots): it builds "
                          "and calls it once, judged by nobody, so Triton's JIT falls off the job's path"),
    (("runner.quarantine_after", "runner.max_attempts"), "faults before quarantine; re-runs of a job whose slot was lost"),
    (("runner.standby", "runner.spare_isolated"), "warm standby executors per GPU (`auto`: one per lane, up to one per "
                                                  "two CPUs per GPU, at most 8; `true`: one; `false`; or a number); "
                                                  "pre-warmed single-use executors"),
    (("runner.isolate_network", "runner.drop_privileges", "runner.memory_limit_gb", "runner.max_open_files",
      "runner.max_processes", "runner.workdir", "runner.uid_range"), "executor sandbox"),
    (("runner.scratch_gb",), "all an executor may write, GiB (default 1): a scratch of its own, everything else "
                             "read-only to it; null: wherever its uid may"),
    (("runner.fork_server",), "fork executors from a warm server per GPU (default true: imports paid once; each child "
                              "sheds the server's descriptors and enters the sandbox first); false: an interpreter each"),
    (("runner.executor_checks",), "on a GPU that cannot share memory with executors (CUDA VMM), let executors stage "
                                  "it and record checks=executor (default false: such a GPU refuses to judge)"),
    (("service.name", "service.state_dir"), "run on the running `python -m fibray.serve` of this name when there is one "
                                            "(default `fibray`; `service=off`: always private slots); where local "
                                            "services leave their state files (`$FIBRAY_STATE_DIR`)"),
)


def table_keys() -> list[str]:
    """Every key the table names, in table order."""
    return [k for keys, _ in KEY_TABLE for k in keys]


def missing_from_table() -> list[str]:
    """Valid config keys that no row of the table names (should be none)."""
    named = set(table_keys())
    return [k for k in config_keys() if k not in named]


def markdown_table() -> str:
    """The table as README shows it."""
    rows = ["| key | meaning |", "| --- | --- |"]
    rows += [f"| {', '.join(f'`{k}`' for k in keys)} | {meaning} |" for keys, meaning in KEY_TABLE]
    return "\n".join(rows)


def help_text() -> str:
    """`python -m fibray.sweep --help`: usage, then every key with its meaning."""
    lines = [
        "usage: python -m fibray.sweep [+experiment=smoke|smoke_gpu] [cluster=local|ray|slurm|kuberay] [KEY=VALUE ...]",
        "",
        "Evaluate every solution on every workload of a dataset and record one Parquet row per evaluation.",
        "Rerunning the same command resumes the sweep. Examples:",
        "  python -m fibray.sweep +experiment=smoke",
        "  python -m fibray.sweep +experiment=smoke dataset.root=datasets/llm sweep.name=llm solutions.roots=[]",
        "",
        "options: --help (this text), --cfg (print the composed configuration and exit)",
        "",
        "keys:",
    ]
    width = 38
    for keys, meaning in KEY_TABLE:
        names, text = ", ".join(keys), meaning.replace("`", "")
        if len(names) < width:
            lines.append(f"  {names:<{width}} {text}")
        else:
            lines += [f"  {names}", f"  {'':<{width}} {text}"]
    return "\n".join(lines)
