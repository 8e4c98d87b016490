"""`python -m examples.llama_block --workdir DIR`: trace -> sweep -> apply on the decoder block.

Exits 0 when apply substituted kernels and the block's outputs match plain PyTorch within
tolerance, 1 otherwise. `--json FILE` writes the report for machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from fibray.compile import prepare_triton


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.llama_block", description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the dataset and store go (default: a temp dir)")
    parser.add_argument("--config", default="tiny", help="block shape: tiny (CI) or llama3_8b (GPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    prepare_triton()  # before anything imports triton (CPU hosts run it interpreted)

    from examples.llama_block.block import CONFIGS
    from examples.llama_block.pipeline import run_pipeline

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fibray-llama-block-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)  # the sweep may run candidates as an unprivileged user: they must reach the blobs
    report = run_pipeline(workdir, CONFIGS[args.config])
    for key, value in report.to_json().items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    ok = report.within_tolerance and report.hits > 0 and report.fallbacks == 0
    print("OK: apply substituted verified kernels and matched plain PyTorch" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
