"""`python -m fibray.serve [overrides]` starts the service; `--status` describes it; `--stop` stops it.

Overrides are Hydra's, on conf/serve.yaml (`cluster=ray`, `service.name=...`, `runner.lanes=2`, ...).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from fibray.serve.config import validate_serve_config
from fibray.sweep.service import ServiceError, auth_mode, read_state, use_auth
from fibray.store import StoreError
from fibray.sweep.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
_ACTIONS = {"--stop": "stop", "--status": "status"}


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    if not OmegaConf.has_resolver("fibray_root"):
        OmegaConf.register_new_resolver("fibray_root", lambda: str(REPO_ROOT))
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        raw = compose(config_name="serve", overrides=overrides)
    return validate_serve_config(OmegaConf.to_container(raw, resolve=True))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    actions = [a for a in argv if a in _ACTIONS]
    overrides = [a for a in argv if a not in _ACTIONS]
    if len(actions) > 1 or any(a.startswith("--") for a in overrides):
        print("usage: python -m fibray.serve [--status | --stop] [key=value ...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from fibray.serve.service import format_status, service_status, start_service, stop_service

    try:
        cfg = _compose(overrides)
        s = cfg.service
        action = _ACTIONS[actions[0]] if actions else "start"
        state = read_state(s.name, s.state_dir)
        use_auth(state.auth_mode if state is not None and action != "start" else auth_mode())  # before Ray is imported
        if action == "status":
            print(format_status(service_status(s.name, cfg.cluster.address, s.state_dir)))
        elif action == "stop":
            st = stop_service(s.name, cfg.cluster.address, s.state_dir)
            print(f"service {s.name!r} stopped" + (f" after answering {st['answered']} job(s)" if "answered" in st else ""))
        else:
            status, steps = start_service(cfg)
            print(format_status(status))
            print("start-up: " + ", ".join(f"{k} {v:.1f}s" for k, v in steps.items()))
    except (ConfigError, ServiceError, StoreError) as e:
        print(f"fibray.serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # hydra's override errors name the override
        if type(e).__module__.startswith(("hydra", "omegaconf")):
            print(f"fibray.serve: error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
