"""`python -m fibray.evolve +experiment=...`: compose conf/evolve.yaml, validate it, run (or resume) the loop."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from fibray.dataset import DatasetError
from fibray.evolve.config import validate_evolve_config
from fibray.evolve.loop import run_evolve
from fibray.store import StoreError
from fibray.sweep.config import ConfigError
from fibray.sweep.driver import ClusterError

REPO_ROOT = Path(__file__).resolve().parents[2]
if not OmegaConf.has_resolver("fibray_root"):
    OmegaConf.register_new_resolver("fibray_root", lambda: str(REPO_ROOT))


@hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"), config_name="evolve")
def main(raw: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = validate_evolve_config(OmegaConf.to_container(raw, resolve=True))
        report = run_evolve(cfg)
    except (ConfigError, DatasetError, StoreError, ClusterError, ValueError) as e:
        print(f"fibray.evolve: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"\nrun {report.run_id!r}: {report.evaluated} evaluations in {report.wall_s:.1f}s; "
          f"store {Path(cfg.store.root).resolve()}")
    print(report.text())


if __name__ == "__main__":
    main()
