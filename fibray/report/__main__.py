"""`python -m fibray.report --store ROOT [--sweep NAME] [--baseline-sweep NAME] --out DIR`.

Prints the tables and writes the PNGs and report.html under DIR; a missing or empty store,
or an unknown sweep, is a one-line error and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from fibray.analysis import AnalysisError
from fibray.report.build import build_report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fibray.report", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="trace store root (definition=*/sweep=*/part-*.parquet)")
    parser.add_argument("--sweep", help="sweep to report on (default: the latest finished)")
    parser.add_argument("--baseline-sweep", help="compare the sweep with this one: regressions, improvements, status flips")
    parser.add_argument("--out", required=True, help="folder for the PNGs and report.html (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap (default 0)")
    parser.add_argument("--show-cpu-speedups", action="store_true",
                        help="show speedups timed by wall clock on a CPU (hidden by default: not meaningful)")
    args = parser.parse_args(argv)
    try:
        report = build_report(args.store, args.out, sweep=args.sweep, baseline=args.baseline_sweep, seed=args.seed,
                              show_cpu_speedups=args.show_cpu_speedups)
    except AnalysisError as e:
        print(f"fibray.report: error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
