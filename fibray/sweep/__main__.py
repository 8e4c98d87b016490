"""`python -m fibray.sweep [+experiment=...] [KEY=VALUE ...]`: compose the config, validate it, run the sweep.

Every user mistake (an unknown key, a bad value, a bad dataset) is one line and exit status 2;
Ctrl-C is one line saying what was saved and exit status 130. `--help` lists every key.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
if not OmegaConf.has_resolver("fibray_root"):
    OmegaConf.register_new_resolver("fibray_root", lambda: str(REPO_ROOT))


def _fail(message: str) -> int:
    print(f"fibray.sweep: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _groups() -> set[str]:
    """Config group names (conf/<group>/), which overrides select rather than set."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


def check_overrides(overrides: list[str]) -> Optional[str]:
    """The first problem with the command-line overrides, as one line, or None.

    Catches a mistyped key before Hydra does, in both spellings (`eval.itertions=5`,
    `+eval.itertions=5`), naming the closest valid key.
    """
    from fibray.sweep.config import unknown_key_message

    groups = _groups()
    for arg in overrides:
        if arg.startswith("-"):
            return f"unknown option {arg} (python -m fibray.sweep --help)"
        if "=" not in arg and not arg.startswith("~"):
            return f"{arg!r} is not KEY=VALUE (python -m fibray.sweep --help lists every key)"
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key in groups and value:
            have = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
            if value not in have:
                close = difflib.get_close_matches(value, have, n=1)
                hint = f"did you mean {key}={close[0]}? " if close else ""
                return f"{key}={value}: no such {key} ({hint}have: {', '.join(have)})"
            continue
        if key.startswith("hydra.") or key.startswith("hydra/") or key.split("/", 1)[0] in groups:
            continue
        problem = unknown_key_message(key)
        if problem:
            return problem
    return None


def compose_config(overrides: list[str]) -> dict:
    """The composed, resolved config as a plain dict; a Hydra error becomes a one-line ValueError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose("config", overrides=overrides)
        return OmegaConf.to_container(raw, resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(first) from None


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        from fibray.sweep.keys import help_text

        print(help_text())
        return 0
    show_cfg = "--cfg" in args
    if show_cfg:  # Hydra's spelling `--cfg job` works too
        i = args.index("--cfg")
        del args[i:i + (2 if args[i + 1:i + 2] in (["job"], ["all"]) else 1)]
    problem = check_overrides(args)
    if problem:
        return _fail(problem)
    try:
        raw = compose_config(args)
    except ValueError as e:
        return _fail(str(e))
    if show_cfg:
        print(OmegaConf.to_yaml(OmegaConf.create({k: v for k, v in raw.items() if k != "hydra"})))
        return 0
    return _run(raw)


def _run(raw: dict) -> int:
    from fibray.dataset import DatasetError
    from fibray.store import StoreError, TraceStore
    from fibray.sweep.config import ConfigError, validate_config
    from fibray.sweep.console import setup_logging
    from fibray.sweep.driver import ClusterError, SweepInterrupted, run_sweep
    from fibray.sweep.summary import sweep_summary

    try:
        cfg = validate_config(raw)
    except ConfigError as e:
        return _fail(str(e))
    setup_logging(verbose=cfg.sweep.verbose)
    store_root = Path(cfg.store.root).resolve()
    try:
        report = run_sweep(cfg)
    except (ConfigError, DatasetError, StoreError, ClusterError) as e:
        return _fail(str(e))
    except SweepInterrupted as e:
        print(f"\nfibray.sweep: interrupted; {e.saved} new result(s) saved ({e.total_saved} of {e.total_jobs} in "
              f"sweep {e.sweep!r}) in {e.store}; rerun the same command to resume", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(f"\nfibray.sweep: interrupted before any job ran; nothing new saved in {store_root}; "
              "rerun the same command to start", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(f"\nsweep {report.sweep!r}: {report.total_jobs} jobs, {report.skipped} already recorded, "
          f"{report.recorded} evaluated in {report.wall_s:.1f}s; store {store_root}")
    if report.recorded:
        print(f"time: {report.time_breakdown()}")
    if not report.privileges_dropped:
        print("privileges: NOT dropped (runner.drop_privileges=false): candidates ran with fibray's own uid; "
              "every row records privileges_dropped=false")
    print(sweep_summary(TraceStore(cfg.store.root), report.sweep))
    return 0


def entry() -> None:
    """Run main; a Ctrl-C even while modules load is one line and exit status 130."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("\nfibray.sweep: interrupted; rerun the same command to resume", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    entry()
